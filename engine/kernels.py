"""Compiled CPU kernels, built once per machine with torch.utils.cpp_extension.

``cpu_ops()`` returns the module, or None when no compiler is available (the
torch reference path in engine.attention is then used; it is slower, not
different).
"""
from __future__ import annotations

import functools
import logging
from pathlib import Path

log = logging.getLogger(__name__)
_SRC = Path(__file__).parent / "csrc" / "paged_decode.cpp"


@functools.cache
def cpu_ops():
    try:
        from torch.utils.cpp_extension import load
        return load(name="tandem_cpu_ops", sources=[str(_SRC)],
                    extra_cflags=["-O3", "-march=native", "-fopenmp"],
                    extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:        # no compiler / ninja: keep serving on the torch path
        log.warning("CPU kernels unavailable, using the torch path: %s", e)
        return None
