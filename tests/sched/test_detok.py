"""Incremental detokenization and sliding-window stop strings against the tokenizer's full decode."""
import itertools
import random

import pytest

from tandem.sched.detok import WINDOW, Decoder, IncrementalDetokenizer, TextTracker, TokenBytes
from tests.conftest import hf_whole

EXTRA = ["Tea 🍵 and cake 🎂, family 👨‍👩‍👧‍👦, flags 🇫🇷🇯🇵, skin tones 👋🏽.",
         "中文句子：我们今天去公园散步吧。日本語のテキストも。한국어 문장입니다.",
         "Accents: naïve café, combining e\u0301, math ∑∫√, arrows →⇒, ellipsis…",
         "Mixed: 你好 world 🌍! Привет мир. Γειά σου. مرحبا"]


@pytest.fixture(scope="module")
def tok():
    from tandem.engine.models.loader import load_tokenizer, resolve_model
    from tandem.sched.llm import DEFAULT_CACHE_DIR
    return load_tokenizer(resolve_model("smollm2", DEFAULT_CACHE_DIR))


@pytest.fixture(scope="module")
def replies():
    from tandem.bench.workloads import iter_sharegpt
    texts = [p.reply for p in itertools.islice(iter_sharegpt(), 300)] + EXTRA
    assert any(ord(c) > 0x3000 for t in texts for c in t), "the sample must hold CJK text"
    assert any(ord(c) > 0x1F000 for t in texts for c in t), "the sample must hold emoji"
    return texts


def fast_decode(tok, decode=None):
    """What the server decodes with (the Rust tokenizer), as sched.llm.LLM does (or ``decode``)."""
    return Decoder(decode or (lambda ids: tok._tokenizer.decode(ids, skip_special_tokens=True)), TokenBytes(tok))


def stream(decode, ids, chunks):
    d = IncrementalDetokenizer(decode)
    out, i = [], 0
    for n in chunks:
        out.append(d.push(ids[i:i + n]))
        i += n
    out.append(d.flush())
    return out


def test_deltas_join_to_the_full_decode(tok, replies):
    rng = random.Random(0)
    decode = fast_decode(tok)
    for text in replies:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        full = tok.decode(ids, skip_special_tokens=True)       # the reference: HF's own decode
        one = stream(decode, ids, [1] * len(ids))
        assert "".join(one) == full
        assert all("\ufffd" not in d for d in one[:-1]) or "\ufffd" in full
        sizes = []
        while sum(sizes) < len(ids):
            sizes.append(rng.randint(1, 4))
        assert "".join(stream(decode, ids, sizes)) == full
        cut = ids[:rng.randrange(1, len(ids) + 1)]          # max_tokens may end the ids anywhere
        assert "".join(stream(decode, cut, [1] * len(cut))) == decode.whole(cut) == hf_whole(tok, cut)


def test_random_ids_split_characters_and_still_match(tok):
    """Arbitrary byte-level ids (half characters, special tokens) decode the same incrementally,
    less a character they leave incomplete at the end."""
    rng = random.Random(1)
    decode = fast_decode(tok)
    vocab = len(tok)
    for _ in range(300):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        assert "".join(stream(decode, ids, [1] * len(ids))) == hf_whole(tok, ids)


@pytest.mark.parametrize("text, cut, want", [
    (" 😁", 1, " "),                      # the space before a cut emoji stays
    ("猫", 2, ""), ("ab猫", 3, "ab"),
    (" 😁 😁", None, " 😁 😁"),
    ("ok \ufffd", None, "ok \ufffd"),       # a U+FFFD generated as a character stays
    ("\ufffd猫", 2, "\ufffd"),
])
def test_a_character_the_ids_cut_off_is_left_out(tok, text, cut, want):
    ids = tok(text, add_special_tokens=False)["input_ids"]
    ids = ids[:cut] if cut is not None else ids
    assert any("\ufffd" in tok.decode([t]) for t in ids) or "\ufffd" in text
    decode = fast_decode(tok)
    assert decode.whole(ids) == want == hf_whole(tok, ids)
    assert "".join(stream(decode, ids, [1] * len(ids))) == want
    tr = TextTracker(decode, ["never"])
    assert "".join([tr.push([t]) for t in ids] + [tr.finish()]) == want == tr.text()


def test_each_push_decodes_a_short_window(tok, replies):
    """O(new tokens) per token: the decoded windows stay short however long the output gets."""
    seen = []
    base = fast_decode(tok)

    def count(ids):
        seen.append(len(ids))
        return base(ids)
    counting = fast_decode(tok, count)
    ids = tok(" ".join(replies[:40]), add_special_tokens=False)["input_ids"]
    assert len(ids) > 2000
    stream(counting, ids, [1] * len(ids))
    assert max(seen) <= 2 * WINDOW + 2


def test_would_add_is_what_a_push_would_release(tok):
    """Each candidate's text, none pushed: what the whole decode with it adds to the text released
    so far, or None while that decode ends inside a character (the text is held back)."""
    rng = random.Random(3)
    decode = fast_decode(tok)
    ids = tok(EXTRA[0] + EXTRA[3], add_special_tokens=False)["input_ids"]
    d, released = IncrementalDetokenizer(decode), ""
    for i, t in enumerate(ids):
        others = [rng.randrange(len(tok)) for _ in range(4)] + [t]
        for o, got in zip(others, d.would_add(others)):
            full = tok.decode(ids[:i] + [o], skip_special_tokens=True)
            assert got == (None if full.endswith("\ufffd") else full[len(released):]), (i, o)
        released += d.push([t])


def reference_cut(full: str, stops: list[str], include: bool = False) -> str:
    hits = [(full.find(s), s) for s in stops if s and full.find(s) >= 0]
    if not hits:
        return full
    at, s = min(hits)
    return full[:at + (len(s) if include else 0)]


def test_stop_strings_match_a_search_of_the_whole_text(tok, replies):
    rng = random.Random(2)
    decode = fast_decode(tok)
    checked = 0
    for text in replies:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        full = tok.decode(ids, skip_special_tokens=True)
        if len(full) < 10:
            continue
        a = rng.randrange(len(full) - 3)
        stops = [full[a:a + rng.randint(1, 12)], "never-in-the-text-\u2603"]
        include = rng.random() < 0.5          # the stop string kept at the text's end
        tr = TextTracker(decode, stops, include)
        out = [tr.push([t]) for t in ids]
        out.append(tr.finish())
        expect = reference_cut(full, stops, include)
        assert "".join(out) == expect == tr.text()
        assert tr.stopped == (stops[0] if stops[0] in full else None)
        checked += 1
    assert checked > 100


def test_held_back_text_never_leaks_a_stop_string(tok):
    decode = fast_decode(tok)
    ids = tok("The answer is 42. END of story, more text after END", add_special_tokens=False)["input_ids"]
    tr = TextTracker(decode, ["END"])
    streamed = ""
    for t in ids:
        streamed += tr.push([t])
        assert "END" not in streamed
    streamed += tr.finish()
    assert streamed == "The answer is 42. " and tr.stopped == "END"
