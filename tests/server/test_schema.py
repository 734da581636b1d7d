"""The request validator's arrays of token ids: read in one pass, they must be judged exactly as
item by item through the schema (the same first wrong item, the same words)."""
import pytest

from tandem.server.schema import PROMPT, SAMPLING, TOKEN_IDS, problem


def item_by_item(schema: dict, v: list):
    """The reference: each item through ``problem`` in turn, the first that breaks the items' schema."""
    for i, x in enumerate(v):
        if (p := problem(schema["items"], x)) is not None:
            return [i, *p[0]], p[1]
    return None


@pytest.mark.parametrize("wrong", [-1, True, 2.0, "7", None, 2 ** 63, [3]])
@pytest.mark.parametrize("at", [0, 12_345, 99_999])
def test_a_wrong_token_id_is_found_where_item_by_item_finds_it(wrong, at):
    ids = list(range(100_000))
    ids[at] = wrong
    found = problem(TOKEN_IDS, ids)
    assert found is not None and found == item_by_item(TOKEN_IDS, ids)
    assert found[0] == [at]


def test_token_ids_in_bounds_pass_and_nested_prompts_are_judged_per_prompt():
    assert problem(TOKEN_IDS, [0, 5, 2 ** 63 - 1] * 1000) is None
    assert problem(PROMPT, [[1, 2], [3, 4]]) is None
    assert problem(PROMPT, [[1, 2], [3, -4]]) is not None
    assert problem(SAMPLING["stop_token_ids"], [7] * 4097) == ([], "must have at most 4096 items")


@pytest.mark.parametrize("rid, ok", [("mine-1", True), ("two words", True), ("café", True), ("a\nb", False),
                                     ("\r\nX-Injected: 1", False), ("x\x00", False), ("x\x7f", False),
                                     (" ", False), ("\t", False)])
def test_a_request_id_is_refused_where_no_header_could_carry_it(rid, ok):
    assert (problem(SAMPLING["request_id"], rid) is None) is ok
    # the length before the pattern: a long id is not searched through (a backtracking pattern took
    # seconds on megabytes that the body's limit lets in)
    assert problem(SAMPLING["request_id"], "a" * 100_000 + "\n") == ([], "must have at most 256 characters")
