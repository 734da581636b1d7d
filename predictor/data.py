"""ShareGPT prompts with their real reply lengths in the served model's tokens (SmolLM2).

Records before ``HELD_OUT_FROM`` train and tune; records from it on only evaluate.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class Examples:
    prompts: list[str]
    lengths: np.ndarray          # reply tokens
    prompt_tokens: np.ndarray    # prompt tokens (the baselines' input)
    records: np.ndarray          # ShareGPT record index of each

    def __len__(self) -> int:
        return len(self.prompts)

    def take(self, mask) -> "Examples":
        idx = np.flatnonzero(mask)
        return Examples([self.prompts[i] for i in idx], self.lengths[idx], self.prompt_tokens[idx],
                        self.records[idx])


def length_tokenizer():
    """SmolLM2's tokenizer: lengths are counted in the tokens the default model generates."""
    from tandem.engine.models.loader import load_tokenizer, resolve_model
    from tandem.sched.llm import DEFAULT_CACHE_DIR
    return load_tokenizer(resolve_model("smollm2", DEFAULT_CACHE_DIR))


def sharegpt(held_out: bool, limit: int | None = None, tokenizer=None) -> Examples:
    """The training records (before HELD_OUT_FROM) or the held-out ones, at most ``limit``."""
    from tandem.bench.workloads import HELD_OUT_FROM, iter_sharegpt
    tok = tokenizer or length_tokenizer()
    pairs = []
    for pair in iter_sharegpt():
        if (pair.index >= HELD_OUT_FROM) != held_out:
            if held_out:
                continue
            break
        pairs.append(pair)
        if limit is not None and len(pairs) >= limit:
            break

    def count(texts):
        return np.array([len(x) for x in tok(texts, add_special_tokens=False)["input_ids"]], np.int64)
    prompts = [p.prompt for p in pairs]
    return Examples(prompts, count([p.reply for p in pairs]), count(prompts),
                    np.array([p.index for p in pairs], np.int64))
