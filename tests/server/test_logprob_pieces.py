"""A completion's logprob tokens are the pieces each token adds to the text (``Pieces``): on a
byte-level vocabulary (SmolLM2's) they come from the tokens' own bytes, checked here against HF's
decode of each prefix, for the sampled tokens and the alternatives in their place."""
import random

import pytest

from tandem.server.logprobs import Pieces, TokenText
from tests.sched.test_detok import EXTRA


@pytest.fixture(scope="module")
def tok():
    from tandem.engine.models.loader import load_tokenizer, resolve_model
    from tandem.sched.llm import DEFAULT_CACHE_DIR
    return load_tokenizer(resolve_model("smollm2", DEFAULT_CACHE_DIR))


def split_ids(tok, rng: random.Random) -> list[int]:
    """Text with multi-byte characters, tokens that hold part of a character, special tokens and
    a U+FFFD written as a character, in a random order of pieces."""
    ids = tok("".join(EXTRA) + " \ufffd end", add_special_tokens=False)["input_ids"]
    partial = [t for t in range(len(tok)) if "\ufffd" in tok.decode([t])][:200]
    for _ in range(30):
        ids.insert(rng.randrange(len(ids) + 1), rng.choice(partial + tok.all_special_ids))
    return ids


@pytest.mark.parametrize("seed", range(4))
def test_byte_level_pieces_are_what_each_token_adds_to_the_decoded_text(tok, seed):
    rng = random.Random(seed)
    text_of = TokenText(tok)
    assert text_of.byte_level, "SmolLM2's vocabulary is byte-level BPE"
    ids = split_ids(tok, rng)
    pieces, released = Pieces(text_of), ""
    for i, t in enumerate(ids):
        others = [rng.randrange(len(tok)) for _ in range(4)]
        got, alts = pieces.add(t, others)
        for o, alt in zip(others, alts):
            full = tok.decode(ids[:i] + [o], skip_special_tokens=False)
            want = f"bytes:{text_of.spelled(o)}" if full.endswith("\ufffd") else full[len(released):]
            assert alt == want, (i, o)
        full = tok.decode(ids[:i + 1], skip_special_tokens=False)
        assert got == ("" if full.endswith("\ufffd") else full[len(released):]), i
        released += got
    released += pieces.end()
    full = tok.decode(ids, skip_special_tokens=False)
    assert released == full or (full.endswith("\ufffd") and released == full[:len(released)])
