"""Where Tandem keeps files outside any checkout (the XDG base directories)."""
from __future__ import annotations

import contextlib
import fcntl
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


@contextlib.contextmanager
def exclusive(lock: Path):
    """Hold an flock on ``lock`` (created, with its folder, if missing) until the block ends.
    Processes that share a cache (test workers, two servers) take turns; the kernel drops the
    lock when its holder dies, so a killed holder never leaves the next one waiting."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)            # released when the file closes
        yield
