"""python -m bench int8-accuracy: what int8 KV costs SmolLM2 in accuracy, against HF transformers.

200 held-out ShareGPT prompt/reply pairs (records the predictor and every tuning never saw),
each scored teacher-forced on its real reply with HF transformers in fp32 twice:

  full   one forward over prompt + reply, the cache in fp32
  int8   the same tokens block by block (16 tokens, aligned to positions as the pool's blocks
         are): each block attends to the earlier blocks' K and V compressed to int8 channel-wise
         (engine.kvquant, the compression swapped caches get) and to its own tokens in full
         precision, and is compressed once full -- the open block stays in full precision

Reported: perplexity of the replies under each, its relative change, and greedy-token agreement
(the fraction of reply positions where both pick the same next token).
"""
from __future__ import annotations

import math
import time

import torch

from tandem.bench.output import save_json
from tandem.engine.kvquant import dequantize, quantize

BLOCK = 16


def _compress_block(cache, start: int) -> None:
    """Replace tokens [start, start + BLOCK) of every layer's K and V by their int8 round trip."""
    for layer in cache.layers:
        for name in ("keys", "values"):
            t = getattr(layer, name)                       # [1, kv_heads, T, head_dim]
            blk = t[0, :, start:start + BLOCK][None]       # [1, H, BLOCK, D] as [layers, heads, rows, dim]
            t[0, :, start:start + BLOCK] = dequantize(quantize(blk, 1, BLOCK))[0]


@torch.inference_mode()
def score(model, ids: list[int], reply_from: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(NLL full, NLL int8, argmax full, argmax int8) at the positions predicting reply tokens."""
    from transformers import DynamicCache
    x = torch.tensor([ids])
    full = model(x).logits[0, :-1].float()
    cache, parts = DynamicCache(), []
    for s in range(0, len(ids), BLOCK):
        out = model(x[:, s:s + BLOCK], past_key_values=cache, use_cache=True)
        parts.append(out.logits[0].float())
        if s + BLOCK <= len(ids):
            _compress_block(cache, s)
    q = torch.cat(parts)[:-1]
    tgt = x[0, 1:]
    sl = slice(reply_from - 1, None)
    nll = lambda logits: torch.nn.functional.cross_entropy(logits[sl], tgt[sl], reduction="none")  # noqa: E731
    return nll(full), nll(q), full[sl].argmax(-1), q[sl].argmax(-1)


def run(args) -> dict:
    from transformers import AutoModelForCausalLM

    from tandem.bench.workloads import chat_ids, sharegpt_prompts
    from tandem.engine.models.loader import resolve_model
    from tandem.predictor.data import length_tokenizer
    from tandem.sched.llm import DEFAULT_CACHE_DIR
    torch.set_num_threads(args.threads)
    tok = length_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(resolve_model("smollm2", DEFAULT_CACHE_DIR),
                                                 dtype=torch.float32).eval()
    pairs = sharegpt_prompts(args.num_pairs, tok, max_prompt_tokens=args.max_prompt, held_out=True)
    nll_f, nll_q, agree, n = 0.0, 0.0, 0, 0
    t0 = time.perf_counter()
    for p in pairs:
        prompt = chat_ids(tok, p.prompt)
        reply = tok(p.reply, add_special_tokens=False)["input_ids"][:args.max_reply]
        if not reply:
            continue
        f, q, af, aq = score(model, prompt + reply, len(prompt))
        nll_f += f.sum().item()
        nll_q += q.sum().item()
        agree += (af == aq).sum().item()
        n += len(reply)
    ppl_f, ppl_q = math.exp(nll_f / n), math.exp(nll_q / n)
    res = {"pairs": len(pairs), "reply_tokens": n, "block": BLOCK, "ppl_full": ppl_f, "ppl_int8": ppl_q,
           "ppl_change": ppl_q / ppl_f - 1, "greedy_agreement": agree / n, "seconds": time.perf_counter() - t0}
    print(f"{len(pairs)} held-out ShareGPT replies, {n} tokens, SmolLM2 fp32 (HF transformers)\n\n"
          f"| KV | perplexity | greedy agreement with full |\n|---|---|---|\n"
          f"| full precision | {ppl_f:.3f} | 100% |\n"
          f"| int8 (channel-wise per {BLOCK}-token block, open block full) | {ppl_q:.3f} ({ppl_q / ppl_f - 1:+.2%}) "
          f"| {agree / n:.2%} |")
    save_json(args.out, res)
    return res
