"""Where bench commands put their results: JSON under bench/results/."""
from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def save_json(name: str, obj) -> Path:
    """Write ``obj`` to bench/results/<name> and say so."""
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / name
    out.write_text(json.dumps(obj, indent=2))
    print(f"wrote {out}")
    return out
