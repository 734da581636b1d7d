"""python -m bench same-tokens: does a greedy reply depend on what runs beside it?

Held-out ShareGPT prompts, greedy, on SmolLM2: every prompt in one ``generate`` call (they
share steps), then each prompt alone. A reply that differs between the two runs changed with
the batch. Then, with prefix caching on, each prompt alone twice: the second run finds its
prompt's full blocks in the cache and computes only the rest, so a reply that differs changed
with what was cached. In float32 every product takes one path whatever the step's size; in
bfloat16 a step of at most ``engine.linear.thin_rows()`` rows multiplies over the GGUF blocks
(summing in float32) and a larger one over the bfloat16 weights, which round differently.
"""
from __future__ import annotations

import statistics


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The index of the first token where ``a`` and ``b`` differ (the shorter one's length when
    one is a prefix of the other); None when they are equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def compare(dtype: str, prompts: list[str], max_tokens: int) -> dict:
    from tandem import LLM, SamplingParams
    sp = SamplingParams(max_tokens=max_tokens, temperature=0)
    chats = [[{"role": "user", "content": p}] for p in prompts]
    with LLM("smollm2", "cpu:1", dtype=dtype, enable_prefix_caching=False, threads_per_worker=1) as llm:
        together = [o.token_ids for o in llm.generate(chats, sp)]
        alone = [llm.generate([c], sp)[0].token_ids for c in chats]
    with LLM("smollm2", "cpu:1", dtype=dtype, threads_per_worker=1) as llm:
        twice = [[llm.generate([c], sp)[0] for _ in range(2)] for c in chats]
    firsts = [d for a, b in zip(together, alone) if (d := first_difference(a, b)) is not None]
    cached = [d for a, b in twice if (d := first_difference(a.token_ids, b.token_ids)) is not None]
    return {"dtype": dtype, "replies": len(prompts), "differ": len(firsts), "first_difference": firsts,
            "differ_cached": len(cached), "first_difference_cached": cached,
            "cached_tokens": [b.num_cached_tokens for _, b in twice]}


def run(args) -> dict:
    from tandem.bench.output import save_json
    from tandem.bench.workloads import sharegpt_prompts
    from tandem.predictor.data import length_tokenizer
    prompts = [p.prompt for p in sharegpt_prompts(args.num_prompts, length_tokenizer(),
                                                  max_prompt_tokens=args.max_prompt, held_out=True)]
    rows = [compare(d, prompts, args.max_tokens) for d in args.dtypes]
    print(f"{len(prompts)} held-out ShareGPT prompts, greedy, {args.max_tokens} tokens, SmolLM2 on cpu:1: "
          "all together against each alone; each alone against itself again with its prompt's blocks cached\n\n"
          "| dtype | compared | replies that differ | first different token (median, range) |\n|---|---|---|---|")
    for r in rows:
        for what, n, f in (("together / alone", r["differ"], r["first_difference"]),
                           ("computed / cached prompt", r["differ_cached"], r["first_difference_cached"])):
            where = f"{statistics.median(f):.0f} ({min(f)}-{max(f)})" if f else "-"
            print(f"| {r['dtype']} | {what} | {n} of {r['replies']} | {where} |")
    print(f"\nprompt tokens found cached in the second runs: {sum(rows[0]['cached_tokens'])} "
          f"(median {statistics.median(rows[0]['cached_tokens']):.0f} per prompt)")
    res = {"max_tokens": args.max_tokens, "rows": rows}
    save_json(args.out, res)
    return res
