"""Where Tandem keeps files outside any checkout (the XDG base directories)."""
from __future__ import annotations

import os
from pathlib import Path


def _xdg(var: str, fallback: str) -> Path:
    base = os.environ.get(var) or str(Path.home() / fallback)
    return Path(base) / "tandem"


def cache_dir() -> Path:
    """Rebuildable files: converted checkpoints, the trained length predictor."""
    return _xdg("XDG_CACHE_HOME", ".cache")


def data_dir() -> Path:
    """The server's default ``--data-dir``: batch files, their database, learned lengths."""
    return _xdg("XDG_DATA_HOME", ".local/share")
