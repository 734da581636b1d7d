"""vLLM's controls over which tokens come and how they read, against HF transformers:
allowed_token_ids (HF generate's prefix_allowed_tokens_fn), bad_words (HF generate's
bad_words_ids, the words spelled by HF's tokenizer), truncate_prompt_tokens (HF on the prompt's
last ids) and skip_special_tokens (HF's tokenizer decoding the same ids)."""
import pytest
import torch

from tandem import LLM, SamplingParams
from tests.conftest import assert_pool_free

GREEDY = dict(temperature=0, ignore_eos=True)
PROMPTS = ["Once upon a time", "The capital of France is", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def llm(tiny_chat_model):
    with LLM(str(tiny_chat_model), "cpu:1", dtype="float32", policy="fcfs", max_model_len=64,
             threads_per_worker=1) as llm:
        yield llm


@pytest.fixture(scope="module")
def hf(tiny_chat_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    return (AutoModelForCausalLM.from_pretrained(tiny_chat_model, dtype=torch.float32).eval(),
            AutoTokenizer.from_pretrained(tiny_chat_model))


def hf_generate(hf, prompt_ids: list[int], n: int, **kw) -> list[int]:
    model, _ = hf
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                         pad_token_id=0, **kw)
    return out[0, len(prompt_ids):].tolist()


def test_allowed_token_ids_as_hf_restricting_each_step(llm, hf):
    """Greedy within the allowed set is HF's with the same restriction; a sampled request draws
    only allowed tokens; a request beside them without the field is unrestricted."""
    tok = hf[1]
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    allowed = [7, 300, 1_000, 2_500, 9_999, 31_000, 48_000]
    outs = llm.generate(PROMPTS, [SamplingParams(max_tokens=12, allowed_token_ids=allowed, **GREEDY),
                                  SamplingParams(max_tokens=40, temperature=1.0, seed=5, ignore_eos=True,
                                                 allowed_token_ids=allowed),
                                  SamplingParams(max_tokens=12, **GREEDY)])
    assert outs[0].token_ids == hf_generate(hf, ids[0], 12, prefix_allowed_tokens_fn=lambda b, x: allowed)
    assert set(outs[1].token_ids) <= set(allowed) and len(set(outs[1].token_ids)) > 2
    plain = hf_generate(hf, ids[2], 12)
    assert outs[2].token_ids == plain and not set(plain) <= set(allowed)
    assert_pool_free(llm)


def spellings(tok, word: str) -> list[list[int]]:
    """HF's tokens for a word at the start of a text and after a space."""
    return [tok(w, add_special_tokens=False)["input_ids"] for w in (word.lstrip(), " " + word.lstrip())]


def test_bad_words_as_hf_banning_their_tokens(llm, hf):
    """Words taken from the model's own greedy reply are never completed, each in its own request
    of one batch: one of a single token spelled as at the start of a text, one of two tokens
    spelled after a space (its first token still comes; the second never follows it). Each reply
    is HF's with the word's token sequences banned, and differs from the unbanned one."""
    tok = hf[1]
    ids = tok(PROMPTS[0])["input_ids"]
    plain = hf_generate(hf, ids, 16)

    def word(i, n, spaced):
        text = tok.decode(plain[i:i + n])
        return text if text.startswith(" ") == spaced and spellings(tok, text)[spaced] == plain[i:i + n] else None
    one = next(w for i in range(1, 8) if (w := word(i, 1, False)))
    at, two = next((i, w) for i in range(4, 14) if (w := word(i, 2, True)))
    outs = llm.generate([PROMPTS[0]] * 2, [SamplingParams(max_tokens=16, bad_words=[w], **GREEDY) for w in (one, two)])
    for w, out in zip((one, two), outs):
        banned = spellings(tok, w)
        assert all(s[:-1] != ids[len(ids) - len(s) + 1:] for s in banned if len(s) > 1), \
            "HF also reads the prompt: no word may start in it"
        assert out.token_ids == hf_generate(hf, ids, 16, bad_words_ids=banned) != plain
        assert w.lstrip() not in out.text
    assert outs[1].token_ids[:at + 1] == plain[:at + 1], "the two-token word's first token still comes"


def test_truncate_prompt_tokens_keeps_the_last_ids(llm, hf):
    """The prompt's last k ids, as HF would be given them, even where the whole prompt is past
    the context; -1 keeps a prompt that fits whole, and of a longer one the ids that leave room
    for max_tokens (for one token without it)."""
    tok = hf[1]
    long_ids = [(37 * i) % 40_000 + 100 for i in range(100)]     # past the context of 64
    with pytest.raises(ValueError, match="prompt: 100 tokens"):
        llm.generate([long_ids], SamplingParams(max_tokens=4, **GREEDY))
    text_ids = tok(PROMPTS[1])["input_ids"]
    outs = llm.generate([long_ids, PROMPTS[1], PROMPTS[2]],
                        [SamplingParams(max_tokens=8, truncate_prompt_tokens=10, **GREEDY),
                         SamplingParams(max_tokens=8, truncate_prompt_tokens=3, **GREEDY),
                         SamplingParams(max_tokens=8, truncate_prompt_tokens=-1, **GREEDY)])
    assert outs[0].prompt_token_ids == long_ids[-10:]
    assert outs[1].prompt_token_ids == text_ids[-3:] and outs[1].prompt == tok.decode(text_ids[-3:])
    assert outs[2].prompt_token_ids == tok(PROMPTS[2])["input_ids"] and outs[2].prompt == PROMPTS[2]
    want = [hf_generate(hf, p, 8) for p in (long_ids[-10:], text_ids[-3:], tok(PROMPTS[2])["input_ids"])]
    assert [o.token_ids for o in outs] == want
    outs = llm.generate([long_ids, long_ids], [SamplingParams(max_tokens=8, truncate_prompt_tokens=-1, **GREEDY),
                                               SamplingParams(max_tokens=None, truncate_prompt_tokens=-1, **GREEDY)])
    assert outs[0].prompt_token_ids == long_ids[-(64 - 8):] and outs[1].prompt_token_ids == long_ids[-63:]
    assert outs[0].token_ids == hf_generate(hf, long_ids[-56:], 8)
    assert outs[1].token_ids == hf_generate(hf, long_ids[-63:], 1) and outs[1].finish_reason == "length"
    for bad, why in ((65, "more than the model context"), (0, "must be None, -1"), (-3, "must be None, -1")):
        with pytest.raises(ValueError, match=f"^truncate_prompt_tokens: .*{why}"):
            llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2, truncate_prompt_tokens=bad))


def test_skip_special_tokens_false_keeps_their_text(llm, hf):
    """Special tokens forced into the reply (allowed_token_ids) read as HF's tokenizer spells
    them with skip_special_tokens=False, and are left out by default."""
    tok = hf[1]
    specials = [tok.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<file_sep>")]
    allowed = specials + [tok(" hello", add_special_tokens=False)["input_ids"][0]]
    sp = dict(max_tokens=10, temperature=1.0, seed=2, ignore_eos=True, allowed_token_ids=allowed)
    kept, skipped = llm.generate([PROMPTS[0]] * 2, [SamplingParams(**sp, skip_special_tokens=False),
                                                    SamplingParams(**sp)])
    assert kept.token_ids == skipped.token_ids and set(specials) & set(kept.token_ids)
    assert kept.text == tok.decode(kept.token_ids, skip_special_tokens=False) != skipped.text
    assert skipped.text == tok.decode(kept.token_ids, skip_special_tokens=True)


@pytest.mark.parametrize("kwargs, field", [
    (dict(allowed_token_ids=[]), "allowed_token_ids"), (dict(allowed_token_ids=[-1]), "allowed_token_ids"),
    (dict(allowed_token_ids=(3.5,)), "allowed_token_ids"), (dict(bad_words=[" "]), "bad_words"),
    (dict(bad_words="x"), "bad_words"), (dict(truncate_prompt_tokens=1.5), "truncate_prompt_tokens"),
    (dict(skip_special_tokens=None), "skip_special_tokens")])
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        SamplingParams(**kwargs)


def test_allowed_ids_outside_the_vocabulary_are_refused(llm):
    with pytest.raises(ValueError, match="allowed_token_ids: 49152 is not a token id"):
        llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2, allowed_token_ids=[5, 49152]))


def test_the_length_predictor_reads_what_a_truncated_prompt_kept(tiny_chat_model, hf):
    """Predicted lengths are from the prompt the model sees: a truncated one's kept text (the
    texts handed to the length source recorded; HF's tokenizer decodes the kept ids)."""
    tok = hf[1]
    with LLM(str(tiny_chat_model), "cpu:1", dtype="float32", policy="alise", length_predictor="max_tokens",
             threads_per_worker=1) as llm:
        seen = []
        real = llm.lengths.assign
        llm.lengths.assign = lambda reqs, texts: (seen.extend(texts), real(reqs, texts))
        llm.generate(PROMPTS[:2], [SamplingParams(max_tokens=2, truncate_prompt_tokens=3),
                                   SamplingParams(max_tokens=2)])
    assert seen == [tok.decode(tok(PROMPTS[0])["input_ids"][-3:]), PROMPTS[1]]


def test_controls_that_leave_no_token_to_sample_are_refused(llm, hf):
    """Allowed tokens all banned as words, or all stop tokens while min_tokens holds stops back,
    would leave every logit -inf (token 0 would come, allowed or not): refused, naming the field."""
    tok = hf[1]
    word = tok.decode([tok(" hello", add_special_tokens=False)["input_ids"][0]])
    ids = [tok(w, add_special_tokens=False)["input_ids"][0] for w in (word.lstrip(), word)]
    with pytest.raises(ValueError, match="^bad_words: they ban every token of allowed_token_ids"):
        llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2, allowed_token_ids=ids, bad_words=[word]))
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    with pytest.raises(ValueError, match="^min_tokens: allowed_token_ids allows only stop tokens"):
        llm.generate([PROMPTS[0]], SamplingParams(max_tokens=4, min_tokens=2, allowed_token_ids=[eos, 7],
                                                  stop_token_ids=[7]))
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=4, allowed_token_ids=ids[:1] + [eos],
                                                    bad_words=[word], temperature=0))[0]
    assert set(out.token_ids) == {eos}, "the one token left"
