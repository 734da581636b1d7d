"""Where bench commands put their results: JSON under bench/results/ in a checkout, and under
./tandem-bench-results where the package is installed (never into site-packages)."""
from __future__ import annotations

import json
from pathlib import Path

_HERE = Path(__file__).resolve().parent
IN_CHECKOUT = (_HERE.parent / "pyproject.toml").is_file()      # an editable install included
RESULTS = _HERE / "results" if IN_CHECKOUT else Path.cwd() / "tandem-bench-results"


def result_path(name: str) -> Path:
    """Where the result file ``name`` (a command's --out) goes: under the results dir, or ``name``
    itself where it is an absolute path."""
    return RESULTS / name


def beside(out: Path, tail: str) -> Path:
    """A side file of the result file ``out`` (a plot, a server's log): ``<its stem>_<tail>`` in its
    folder, so runs with different --out keep theirs apart."""
    return out.with_name(f"{out.stem}_{tail}")


def save_json(name: str, obj) -> Path:
    """Write ``obj`` to bench/results/<name> and say so."""
    out = result_path(name)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(obj, indent=2))
    print(f"wrote {out}")
    return out
