"""Compiled CPU kernels, built once per machine with torch.utils.cpp_extension.

``cpu_ops()`` returns the module (paged decode attention, engine/csrc/paged_decode.cpp; the
projections over packed panels, engine/csrc/linear.cpp, over a GGUF's blocks,
engine/csrc/qlinear.cpp, and, where the CPU has AVX-512 BF16, of bfloat16 rows over the blocks,
engine/csrc/qlinear_bf16.cpp: ``q4_1_bf16_linear`` and ``q8_0_bf16_linear``, absent elsewhere), or
None when no compiler is
available (torch's paths are then used: engine.attention's reference attention, and oneDNN
for the projections; slower, not different).

The kernels include only the ATen headers they use, and the binding file torch's pybind layer,
not ``torch/extension.h`` (the whole C++ frontend): a first build takes about 30 s of CPU
instead of about 100 s (its header alone took 25 s a file).
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
from pathlib import Path

from tandem.paths import cache_dir, exclusive

log = logging.getLogger(__name__)
_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [_CSRC / "ops.cpp", _CSRC / "paged_decode.cpp", _CSRC / "linear.cpp", _CSRC / "qlinear.cpp",
            _CSRC / "qlinear_bf16.cpp"]


def _build_dir() -> Path:
    """One build directory per source location: two checkouts (or a checkout and an installed
    copy) would otherwise take turns rebuilding a shared one, since ninja sees a new source path."""
    import torch
    key = hashlib.sha256(f"{_CSRC.resolve()}|{torch.__version__}".encode()).hexdigest()[:12]
    path = cache_dir() / "kernels" / f"tandem_cpu_ops-{key}"
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def _sole_loader(build: Path):
    """Hold the build directory alone while loading, and clear a lock a dead loader left.

    torch's build lock is a file (``lock``) that every load takes, even with nothing to build
    (ninja checks the sources each time). A process killed while loading -- a worker killed at
    start-up, a server stopped with SIGKILL -- leaves it behind, and every later load then waits
    for it for ever: the server never starts again. An flock on a file beside it is dropped by
    the kernel when its holder dies, so while this process holds it no other load of ours is
    under way, and a ``lock`` file found then is stale."""
    with exclusive(build / "load.flock"):
        stale = build / "lock"
        if stale.exists():
            log.warning("removing the lock a killed kernel load left in %s", build)
            stale.unlink(missing_ok=True)
        yield


@functools.cache
def cpu_ops():
    try:
        from torch.utils.cpp_extension import load
        build = _build_dir()
        with _sole_loader(build):
            return load(name="tandem_cpu_ops", sources=[str(p) for p in _SOURCES],
                        extra_cflags=["-O3", "-march=native", "-fopenmp"],
                        extra_ldflags=["-fopenmp"], build_directory=str(build), verbose=False)
    except Exception as e:        # no compiler / ninja: keep serving on the torch path
        log.warning("CPU kernels unavailable, using the torch path: %s", e)
        return None
