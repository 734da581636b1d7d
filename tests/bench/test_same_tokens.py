"""Where two token lists part, as ``bench same-tokens`` counts it, against hand-worked cases."""
import pytest

from tandem.bench.same_tokens import first_difference


@pytest.mark.parametrize("a, b, want", [
    ([1, 2, 3], [1, 2, 3], None), ([], [], None),
    ([1, 2, 3], [1, 5, 3], 1), ([7], [8], 0),
    ([1, 2], [1, 2, 3], 2), ([1, 2, 3, 4], [1, 2], 2),     # one ended sooner (end of sequence)
])
def test_first_difference(a, b, want):
    assert first_difference(a, b) == want
    assert first_difference(b, a) == want
