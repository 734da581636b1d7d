"""python -m bench prefix-routing: multi-turn chats on two devices, placed by load or by cache.

The workload is held-out ShareGPT conversations replayed turn by turn: turn t's prompt is the
chat-templated conversation up to its t-th user message, with the dataset's own replies as the
earlier assistant turns (so every setting sends the same prompts). Each round sends turn t of
every conversation at once, in a shuffled order (the same in every setting), and waits for all
of them, as users who read a reply before writing the next message; a chat's turn therefore
begins with everything its previous turn computed.

Three settings, each in its own engine on ``cpu:2`` (one thread per worker, the default policy
and placement): prefix caching off; on, with arrivals placed by load alone; on, with
cache-aware routing (the default). Placed by load, a chat's next turn lands on either device,
and where it is not the one that computed its history, that history is computed again.

By default each turn asks for one output token, so a round's wall time is the time until every
chat of the round has its first token: the prompt side, which is what placement changes. The
settings run in turn, ``--repeats`` times (this machine's speed drifts between runs).
"""
from __future__ import annotations

import json
import random
import statistics
import time

from tandem.bench.sim_cli import RESULTS

SETTINGS = (("off", False, False), ("on, placed by load", True, False), ("on, cache-aware routing", True, True))


def templated_len(tokenizer, messages: list[dict]) -> int:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def conversations(tokenizer, num: int, turns: int, max_prompt: int) -> list[list[list[dict]]]:
    """``num`` held-out conversations with at least ``turns`` exchanges whose last turn's
    templated prompt fits ``max_prompt`` tokens: for each, the message lists of its turns."""
    from tandem.bench.workloads import iter_conversations
    out = []
    for _, exchanges in iter_conversations(turns):
        history, prompts = [], []
        for human, reply in exchanges[:turns]:
            prompts.append(history + [{"role": "user", "content": human}])
            history = prompts[-1] + [{"role": "assistant", "content": reply}]
        if templated_len(tokenizer, prompts[-1]) <= max_prompt:
            out.append(prompts)
            if len(out) == num:
                break
    return out


def measure(name: str, caching: bool, routing: bool, chats: list, args) -> dict:
    from tandem import LLM, SamplingParams
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    with LLM("smollm2", "cpu:2", threads_per_worker=1, enable_prefix_caching=caching,
             prefix_aware_routing=routing) as llm:
        walls, cached, prompt_tokens = [], [], []
        t_all = time.perf_counter()
        for t in range(args.turns):
            order = random.Random(t).sample(range(len(chats)), len(chats))   # users answer in any order
            t0 = time.perf_counter()
            outs = llm.generate([chats[i][t] for i in order], sp)
            walls.append(time.perf_counter() - t0)
            cached.append(sum(o.num_cached_tokens for o in outs))
            prompt_tokens.append(sum(len(o.prompt_token_ids) for o in outs))
        total = time.perf_counter() - t_all
        routed = [a.prefix_routed for a in llm.scheduler.actors]
    later = slice(1, None)
    return {"setting": name, "prefix_caching": caching, "prefix_routing": routing, "round_wall_s": walls,
            "total_wall_s": total, "later_rounds_wall_s": sum(walls[later]),
            "prompt_tokens": prompt_tokens, "cached_tokens": cached,
            "later_cached_fraction": sum(cached[later]) / max(1, sum(prompt_tokens[later])),
            "routed_by_cache": routed}


def run(args) -> None:
    from transformers import AutoTokenizer
    from tandem.engine.models.loader import resolve_model
    from tandem.sched.llm import DEFAULT_CACHE_DIR
    tok = AutoTokenizer.from_pretrained(resolve_model("smollm2", DEFAULT_CACHE_DIR))
    chats = conversations(tok, args.num_chats, args.turns, args.max_prompt)
    rows = [measure(name, c, r, chats, args) for _ in range(args.repeats) for name, c, r in SETTINGS]
    mean_last = statistics.mean(templated_len(tok, c[-1]) for c in chats)
    print(f"{len(chats)} held-out ShareGPT chats, {args.turns} turns each (last turn's prompt {mean_last:.0f} tokens "
          f"on average), every chat's turn sent at once per round, {args.max_tokens} output token(s); SmolLM2, "
          f"cpu:2, one thread per worker; {args.repeats} run(s) of each setting, in turn")
    print("| prefix caching | prompt tokens computed, rounds 2+ | found in the cache | rounds 2+ wall s "
          "| all rounds wall s | arrivals routed to their cache |")
    print("|---|---|---|---|---|---|")
    for name, _, _ in SETTINGS:
        runs = [r for r in rows if r["setting"] == name]
        later = [(sum(r["cached_tokens"][1:]), sum(r["prompt_tokens"][1:])) for r in runs]
        computed = " / ".join(f"{n - c:,}" for c, n in later)
        hits = " / ".join(f"{c:,} of {n:,} ({100 * c / max(1, n):.0f}%)" for c, n in later)
        walls = " / ".join(f"{r['later_rounds_wall_s']:.1f}" for r in runs)
        totals = " / ".join(f"{r['total_wall_s']:.1f}" for r in runs)
        routed = " / ".join(str(sum(r["routed_by_cache"])) for r in runs)
        print(f"| {name} | {computed} | {hits} | {walls} | {totals} | {routed} |")
    path = RESULTS / args.out
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    print(f"wrote {path}")
