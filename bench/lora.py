"""python -m bench lora: what serving requests through LoRA adapters costs a step.

SmolLM2 (its GGUF weights, float32, one CPU worker) decodes the same ``--requests`` requests
with no adapter, all on one adapter, and spread over ``--adapters`` adapters (as evenly as
they go), each adapter of rank ``--rank`` on every projection (Q, K, V, O, gate, up, down;
random, written in PEFT's file format). The prompts are generated once first, so the timed
runs find them in the prefix cache and their time is decode steps: the table gives the mean
step against the base model's (wall clock, the serving loop included), those steps' time as
the scheduler measured them (from a step's plan to its results: what its cost model learns
from), and the cost model's price of them, fitted on every step the runs measured, as a
server's refits would be (its price of one adapter in a step), and without that term. Then
one prompt of each of ``--prompt-tokens`` lengths is computed alone (``--repeats`` prompts
each, never seen before) on the base model and on one adapter: their steps' time, priced by
the same fit (an adapter's own part and a part per row run with it), by a fit that prices
adapters alone (their rows left out), and by one without either term.
"""
from __future__ import annotations

import json
import tempfile
from dataclasses import replace
from pathlib import Path

from tandem.bench.output import save_json
from tandem.bench.sliding_window import decode_step_ms

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(out: Path, spec, rank: int, seed: int) -> Path:
    """A random LoRA adapter on every projection, as PEFT's save_pretrained lays it out."""
    import torch
    from safetensors.torch import save_file
    from tandem.engine.lora import lora_targets
    targets = lora_targets(spec)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(spec.num_layers):
        for m in MODULES:
            t = targets[m]
            key = f"base_model.model.model.layers.{layer}.{'mlp' if m in MODULES[4:] else 'self_attn'}.{m}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, t.in_features, generator=g) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(t.hi - t.lo, rank, generator=g) * 0.02
    out.mkdir(parents=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                         "target_modules": list(MODULES), "bias": "none"}))
    return out


def _prompt_steps(llm, lengths, repeats: int, lora) -> None:
    """Each length's ``repeats`` prompts, one at a time, each in one step with its first token."""
    from tandem import SamplingParams
    for k, n in enumerate(lengths):
        for i in range(repeats):
            seed = 1 + 1000 * k + i + (500 if lora else 0)
            prompt = [(seed * 7919 + 31 * j) % 40000 + 3 for j in range(n)]
            llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0), lora_request=lora)


def _mean_ms(steps, price=lambda shape, t: t) -> float:
    return 1e3 * sum(price(shape, t) for shape, t in steps) / max(1, len(steps))


def main(args) -> None:
    from tandem import LLM, LoRARequest
    from tandem.sched.cost_model import CostModel
    n = args.requests
    prompts = [[(7 * i + j) % 40000 + 3 for j in range(args.context)] for i in range(n)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp, \
            LLM("smollm2", "cpu", dtype="float32", threads_per_worker=1, policy="fcfs", max_num_seqs=n,
                max_num_batched_tokens=max(2048, *args.prompt_tokens)) as llm:
        refs = [LoRARequest(f"a{k}", k + 1, str(write_adapter(Path(tmp) / f"a{k}", llm.spec, args.rank, k)))
                for k in range(max(1, args.adapters))]
        cases = [("base model", None), ("one adapter", [refs[0]] * n),
                 (f"{len(refs)} adapters", [refs[i % len(refs)] for i in range(n)])]
        llm.scheduler.step_log = steps = []
        for name, lora in cases:
            ms = decode_step_ms(llm, prompts, args.steps, lora_request=lora)
            rows.append({"case": name, "step_ms": ms})
            print(f"{name}: {ms:.1f} ms per decode step", flush=True)
        first = len(steps)                              # the prompts' steps alone come after
        for lora in (None, refs[0]):
            _prompt_steps(llm, args.prompt_tokens, args.repeats, lora)
    model = CostModel.fit(steps)
    fits = {"with rows": (model, lambda shape: shape),      # and as if rows, then adapters, were free:
            "per adapter alone": (CostModel.fit([(replace(shape, adapter_rows=0), t) for shape, t in steps]),
                                  lambda shape: replace(shape, adapter_rows=0)),
            "without adapter terms": (CostModel.fit([(replace(shape, adapters=0, adapter_rows=0), t)
                                                     for shape, t in steps]),
                                      lambda shape: replace(shape, adapters=0, adapter_rows=0))}
    decoding = [(shape, t) for shape, t in steps if shape.decode_tokens == n and not shape.prefill_tokens]
    blind, unseen = fits["without adapter terms"]
    for r, adapters in zip(rows, (0, 1, len(refs))):
        mine = [(shape, t) for shape, t in decoding if shape.adapters == adapters]
        r["measured_ms"] = _mean_ms(mine)
        r["predicted_ms"] = _mean_ms(mine, lambda shape, t: model.predict(shape))
        r["blind_ms"] = _mean_ms(mine, lambda shape, t: blind.predict(unseen(shape)))
    prompts_alone = [(shape, t) for shape, t in steps[first:] if not shape.decode_tokens]
    prompt_rows = [_prompt_row(tokens, [(s, t) for s, t in prompts_alone if s.prefill_tokens == tokens], fits)
                   for tokens in args.prompt_tokens]
    kinds = {"decode steps": decoding, "prompts on the base model": [x for x in prompts_alone if not x[0].adapters],
             "prompts on an adapter": [x for x in prompts_alone if x[0].adapters]}
    errors = {kind: {name: _errors(m, z, mine) for name, (m, z) in fits.items()} for kind, mine in kinds.items()}
    _print(rows, prompt_rows, errors, args, n, len(steps), model, fits["per adapter alone"][0])
    save_json(args.out, {"requests": n, "context": args.context, "rank": args.rank, "adapters": args.adapters,
                         "steps": args.steps, "rows": rows, "prompt_rows": prompt_rows, "errors": errors,
                         "per_adapter_ms": 1e3 * model.per_adapter, "per_adapter_row_ms": 1e3 * model.per_adapter_row,
                         "per_adapter_alone_ms": 1e3 * fits["per adapter alone"][0].per_adapter})


def _prompt_row(tokens: int, alone, fits) -> dict:
    """A prompt length's steps alone: measured on the base model and on an adapter, and the
    adapter's part (the difference) as measured and as each fit prices it."""
    base = [(shape, t) for shape, t in alone if not shape.adapters]
    mine = [(shape, t) for shape, t in alone if shape.adapters]
    row = {"prompt_tokens": tokens, "base_ms": _mean_ms(base), "adapter_ms": _mean_ms(mine)}
    row["part_ms"] = row["adapter_ms"] - row["base_ms"]
    for name, (m, z) in fits.items():
        shape = mine[0][0] if mine else None
        row[f"part_{name}_ms"] = 1e3 * (m.predict(z(shape)) - m.predict(z(replace(shape, adapters=0, adapter_rows=0)))
                                        ) if shape else 0.0
    return row


def _errors(model, unseen, steps) -> dict:
    """Mean (price - measured) / measured over ``steps``, signed and absolute, in %."""
    e = [(model.predict(unseen(shape)) - t) / t for shape, t in steps]
    return {"mean": 100 * sum(e) / max(1, len(e)), "abs": 100 * sum(map(abs, e)) / max(1, len(e)), "steps": len(e)}


def _print(rows, prompt_rows, errors, args, n, fitted, model, per_adapter) -> None:
    base = rows[0]["step_ms"]
    print(f"\n{n} requests of {args.context} prompt tokens, SmolLM2 float32, one worker, rank {args.rank} "
          "on every projection\n")
    print("| requests run with | decode step ms | vs the base model | the scheduler's step ms "
          "| the cost model's price ms | without its adapter terms |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['step_ms']:.1f} | {r['step_ms'] / base:.2f}x | {r['measured_ms']:.1f} "
              f"| {r['predicted_ms']:.1f} | {r['blind_ms']:.1f} |")
    print(f"\n(the last three: the mean of the same decode steps as the scheduler measured them, and as the cost model "
          f"fitted on all {fitted} steps of the runs prices them, {1e3 * model.per_adapter:.1f} ms per adapter in a "
          f"step and {1e3 * model.per_adapter_row:.3f} ms per row run with one, and without those terms)\n")
    print(f"A prompt alone ({args.repeats} each), the scheduler's step ms, and the adapter's part of it as measured "
          "and as each fit prices it:\n")
    print("| prompt tokens | base model | on one adapter | the adapter's part | priced with rows "
          "| priced per adapter alone |")
    print("|---|---|---|---|---|---|")
    for r in prompt_rows:
        print(f"| {r['prompt_tokens']} | {r['base_ms']:.1f} | {r['adapter_ms']:.1f} | {r['part_ms']:.1f} "
              f"| {r['part_with rows_ms']:.1f} | {r['part_per adapter alone_ms']:.1f} |")
    print(f"\n(per adapter alone: a fit that leaves the rows out, {1e3 * per_adapter.per_adapter:.1f} ms per adapter)\n")
    print("Each fit's price of the steps against their measured time, mean error / mean |error|:\n")
    names = list(next(iter(errors.values())))
    print("| steps | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for kind, by_fit in errors.items():
        print(f"| {kind} ({next(iter(by_fit.values()))['steps']}) | "
              + " | ".join(f"{e['mean']:+.1f}% / {e['abs']:.1f}%" for e in by_fit.values()) + " |")
