"""python -m bench prefix-cache: what reusing a shared prompt start saves, SmolLM2 on this CPU.

The workload is document question answering: one long held-out ShareGPT reply is the document,
given in the system message, and held-out ShareGPT questions are asked about it, each in its
own chat. Every chat's prompt begins with the same templated document, as when an assistant
carries a long system prompt or a retrieved text.

Each configuration (prefix caching off, then on) runs in one engine:
1. chats arriving one at a time: time to the first token of each (max_tokens 1);
2. as many other chats at once, as a batch job: wall time and output tokens per second.
Prompt tokens computed and tokens found in the cache are counted by the scheduler.
"""
from __future__ import annotations

import json
import statistics
import threading
import time

from tandem.bench.sim_cli import RESULTS

SYSTEM = "Answer the user's question using the following text.\n\n"


def workload(tokenizer, doc_tokens: tuple[int, int], num_questions: int, max_question_tokens: int):
    """(document, questions): the first held-out reply of the given length, and the held-out
    prompts after it that are short questions."""
    from tandem.bench.workloads import HELD_OUT_FROM, iter_sharegpt
    doc, questions = None, []
    for pair in iter_sharegpt():
        if pair.index < HELD_OUT_FROM:
            continue
        if doc is None:
            if doc_tokens[0] <= len(tokenizer(pair.reply)["input_ids"]) <= doc_tokens[1]:
                doc = pair.reply
            continue
        if len(tokenizer(pair.prompt)["input_ids"]) <= max_question_tokens:
            questions.append(pair.prompt)
            if len(questions) == num_questions:
                break
    return doc, questions


def chats(doc: str, questions: list[str]) -> list[list[dict]]:
    return [[{"role": "system", "content": SYSTEM + doc}, {"role": "user", "content": q}] for q in questions]


def kv_bytes_per_token() -> int:
    from tandem.engine.models.loader import load_spec, resolve_model
    from tandem.sched.llm import DEFAULT_CACHE_DIR
    spec = load_spec(resolve_model("smollm2", DEFAULT_CACHE_DIR))
    return spec.num_layers * 2 * spec.unit * 4          # K and V, float32


def most_running(llm, stop: threading.Event, out: list) -> None:
    """The most requests the device ran at once, sampled every 10 ms until ``stop``."""
    while not stop.wait(0.01):
        out[0] = max(out[0], len(llm.scheduler.actors[0].running))


def measure(caching: bool, prompts: list, batch: list, args) -> dict:
    from tandem import LLM, SamplingParams
    pool = {} if args.kv_cache_tokens is None else {"kv_cache_bytes": args.kv_cache_tokens * kv_bytes_per_token()}
    with LLM("smollm2", "cpu:1", enable_prefix_caching=caching, threads_per_worker=args.threads, **pool) as llm:
        ttft = []
        for p in prompts:
            t0 = time.perf_counter()
            llm.generate([p], SamplingParams(max_tokens=1, temperature=0))
            ttft.append(time.perf_counter() - t0)
        one_by_one = dict(llm.scheduler.counts("prefix_tokens"))
        peak, stop = [0], threading.Event()
        threading.Thread(target=most_running, args=(llm, stop, peak), daemon=True).start()
        t0 = time.perf_counter()
        outs = llm.generate(batch, SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True))
        wall = time.perf_counter() - t0
        stop.set()
        seen = dict(llm.scheduler.counts("prefix_tokens"))
        prompt_tokens = [len(o.prompt_token_ids) for o in outs]
    out_tokens = sum(len(o.token_ids) for o in outs)
    return {"prefix_caching": caching, "prompt_tokens_mean": statistics.mean(prompt_tokens),
            "ttft_mean_s": statistics.mean(ttft), "ttft_p50_s": statistics.median(ttft),
            "ttft_first_s": ttft[0], "ttft_rest_mean_s": statistics.mean(ttft[1:]),
            "batch_wall_s": wall, "batch_output_tok_s": out_tokens / wall, "batch_most_running": peak[0],
            "cached_one_by_one": one_by_one.get("hits", 0),
            "cached_batch": seen.get("hits", 0) - one_by_one.get("hits", 0),
            "queried_batch": seen.get("queried", 0) - one_by_one.get("queried", 0),
            "prompt_tokens": prompt_tokens, "cached_per_request": [o.num_cached_tokens for o in outs]}


def run(args) -> None:
    import torch
    from transformers import AutoTokenizer
    from tandem.engine.models.loader import resolve_model
    from tandem.sched.llm import DEFAULT_CACHE_DIR
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(resolve_model("smollm2", DEFAULT_CACHE_DIR))
    n = args.num_questions
    doc, questions = workload(tok, (args.doc_min, args.doc_max), 2 * n, args.max_question)
    prompts = chats(doc, questions)
    rows = [measure(c, prompts[:n], prompts[n:], args) for c in (False, True)]
    pool = "the default pool" if args.kv_cache_tokens is None else f"a pool of {args.kv_cache_tokens} tokens"
    print(f"document QA: {n} chats one by one, then {n} others at once, with prompts of "
          f"{rows[0]['prompt_tokens_mean']:.0f} tokens on average sharing the document (held-out ShareGPT), "
          f"SmolLM2, cpu:1, {pool}")
    print("| prefix caching | TTFT, first chat | TTFT, later chats (mean) | batch wall s | batch output tok/s "
          "| prompt tokens cached (batch) | batch: most running at once |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        cached = f"{r['cached_batch']} of {r['queried_batch']}" if r["prefix_caching"] else "-"
        print(f"| {'on' if r['prefix_caching'] else 'off'} | {r['ttft_first_s'] * 1000:.0f} ms | "
              f"{r['ttft_rest_mean_s'] * 1000:.0f} ms | {r['batch_wall_s']:.1f} | {r['batch_output_tok_s']:.1f} | "
              f"{cached} | {r['batch_most_running']} |")
    path = RESULTS / args.out
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    print(f"wrote {path}")
