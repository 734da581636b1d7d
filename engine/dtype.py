"""Which floating-point type a device computes in: ``dtype="auto"`` picks bfloat16 where the
hardware has native bf16 matrix instructions and float32 elsewhere."""
from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")     # /proc/cpuinfo flags of native bf16 dot products


def _cpuinfo(field: str, path: str) -> str | None:
    """The first ``field : value`` line's value in /proc/cpuinfo (None: no such line or file)."""
    try:
        with open(path) as f:
            for line in f:
                name, sep, value = line.partition(":")
                if sep and name.strip() == field:
                    return value.strip()
    except OSError:
        pass
    return None


def cpu_flags(path: str = "/proc/cpuinfo") -> set[str]:
    return set((_cpuinfo("flags", path) or "").split())


def cpu_model(path: str = "/proc/cpuinfo") -> str:
    """The CPU's model name ("" where /proc/cpuinfo does not say)."""
    return _cpuinfo("model name", path) or ""


def resolve_dtype(dtype: str, device: str, flags: set[str] | None = None) -> tuple[str, str]:
    """(dtype name, why). ``auto``: bfloat16 on a CUDA device that supports it and on a CPU with
    AVX-512 BF16 or AMX, float32 otherwise (bf16 emulated in AVX2 is slower than fp32)."""
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ValueError(f"dtype: {dtype!r} is not 'auto' or one of {sorted(DTYPES)}")
        return dtype, "as asked"
    if device.startswith("cuda"):
        if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
            return "bfloat16", f"auto: {device} supports bfloat16"
        return "float32", f"auto: {device} does not support bfloat16"
    have = sorted((cpu_flags() if flags is None else flags) & set(CPU_BF16_FLAGS))
    if have:
        return "bfloat16", f"auto: the CPU has {' and '.join(have)}"
    return "float32", "auto: the CPU has neither AVX-512 BF16 nor AMX, where bfloat16 is slower than float32"
