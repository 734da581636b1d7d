"""Compiled CPU kernels, built once per machine with torch.utils.cpp_extension.

``cpu_ops()`` returns the module, or None when no compiler is available (the
torch reference path in engine.attention is then used; it is slower, not
different).
"""
from __future__ import annotations

import functools
import hashlib
import logging
from pathlib import Path

from tandem.paths import cache_dir

log = logging.getLogger(__name__)
_SRC = Path(__file__).parent / "csrc" / "paged_decode.cpp"


def _build_dir() -> Path:
    """One build directory per source location: two checkouts (or a checkout and an installed
    copy) would otherwise take turns rebuilding a shared one, since ninja sees a new source path."""
    import torch
    key = hashlib.sha256(f"{_SRC.resolve()}|{torch.__version__}".encode()).hexdigest()[:12]
    path = cache_dir() / "kernels" / f"tandem_cpu_ops-{key}"
    path.mkdir(parents=True, exist_ok=True)
    return path


@functools.cache
def cpu_ops():
    try:
        from torch.utils.cpp_extension import load
        return load(name="tandem_cpu_ops", sources=[str(_SRC)],
                    extra_cflags=["-O3", "-march=native", "-fopenmp"],
                    extra_ldflags=["-fopenmp"], build_directory=str(_build_dir()), verbose=False)
    except Exception as e:        # no compiler / ninja: keep serving on the torch path
        log.warning("CPU kernels unavailable, using the torch path: %s", e)
        return None
