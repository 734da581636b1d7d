"""Where bench commands put their results: JSON under bench/results/ in a checkout, and under
./tandem-bench-results where the package is installed (never into site-packages)."""
from __future__ import annotations

import json
from pathlib import Path

_HERE = Path(__file__).resolve().parent
IN_CHECKOUT = (_HERE.parent / "pyproject.toml").is_file()      # an editable install included
RESULTS = _HERE / "results" if IN_CHECKOUT else Path.cwd() / "tandem-bench-results"


def save_json(name: str, obj) -> Path:
    """Write ``obj`` to bench/results/<name> and say so."""
    out = RESULTS / name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(obj, indent=2))
    print(f"wrote {out}")
    return out
