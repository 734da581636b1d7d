"""dtype="auto": bfloat16 only where the CPU computes it natively."""
import pytest

from tandem.engine.dtype import cpu_flags, cpu_model, resolve_dtype


@pytest.mark.parametrize("flags, expect", [
    ({"avx2", "fma", "avx512f", "avx512_bf16"}, "bfloat16"),     # e.g. AMD EPYC Genoa, Intel Cooper Lake
    ({"avx2", "avx512f", "amx_bf16", "amx_tile"}, "bfloat16"),    # Intel Sapphire Rapids
    ({"avx2", "avx512f", "avx512_vnni"}, "float32"),              # AVX-512 without bf16 dot products
    ({"avx2", "fma", "f16c"}, "float32"),
    (set(), "float32"),
])
def test_auto_picks_bf16_only_with_native_bf16(flags, expect):
    dtype, why = resolve_dtype("auto", "cpu", flags)
    assert dtype == expect and why.startswith("auto:")


def test_explicit_dtypes_pass_and_unknown_ones_fail():
    assert resolve_dtype("float32", "cpu", {"avx512_bf16"}) == ("float32", "as asked")
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("int8", "cpu")


def test_cpu_flags_and_model_come_from_their_lines(tmp_path):
    f = tmp_path / "cpuinfo"
    f.write_text("processor\t: 0\nmodel name\t: X\nflags\t\t: fpu avx2 avx512_bf16\n\nprocessor\t: 1\n")
    assert cpu_flags(str(f)) == {"fpu", "avx2", "avx512_bf16"}
    assert cpu_flags(str(tmp_path / "missing")) == set()
    assert cpu_model(str(f)) == "X" and cpu_model(str(tmp_path / "missing")) == ""
