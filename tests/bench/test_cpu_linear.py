"""The thin crossover the CPU-linear bench reads off its timings."""
from tandem.bench.cpu_linear import crossover


def test_the_crossover_is_the_last_row_count_before_the_blocks_first_lose():
    """Medians, by hand: the blocks win at 1 and 6 rows (11 < 32, 20.5 < 40.5), lose at 7 (30 >= 29.5:
    the median of [28, 31] against [29, 30]), and a later win at 12 does not count."""
    ms = {"blocks alone": {1: [10, 12], 6: [20, 21], 7: [28, 31], 12: [38, 39]},
          "bf16": {1: [32, 32], 6: [40, 41], 7: [29, 30], 12: [45, 46]}}
    assert crossover(ms, [12, 1, 7, 6]).startswith("the blocks alone beat dense bfloat16 up to 6 of the rows")
    assert "up to 0 of the rows" in crossover({"blocks alone": {4: [9]}, "bf16": {4: [9]}}, [4])
