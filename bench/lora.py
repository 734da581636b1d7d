"""python -m bench lora: what serving requests through LoRA adapters costs per decode step.

SmolLM2 (its GGUF weights, float32, one CPU worker) decodes the same ``--requests`` requests
with no adapter, all on one adapter, and spread over ``--adapters`` adapters (as evenly as
they go), each adapter of rank ``--rank`` on every projection (Q, K, V, O, gate, up, down;
random, written in PEFT's file format). The prompts are generated once first, so the timed
runs find them in the prefix cache and their time is decode steps: the table gives the mean
step against the base model's (wall clock, the serving loop included), those steps' time as
the scheduler measured them (from a step's plan to its results: what its cost model learns
from), and the cost model's price of them, fitted on every step the three runs measured, as a
server's refits would be (its price of one adapter in a step), and without that term.
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


def main(args) -> None:
    from tandem import LLM, LoRARequest
    from tandem.sched.cost_model import CostModel
    n = args.requests
    prompts = [[(7 * i + j) % 40000 + 3 for j in range(args.context)] for i in range(n)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp, \
            LLM("smollm2", "cpu", dtype="float32", threads_per_worker=1, policy="fcfs", max_num_seqs=n) as llm:
        refs = [LoRARequest(f"a{k}", k + 1, str(write_adapter(Path(tmp) / f"a{k}", llm.spec, args.rank, k)))
                for k in range(max(1, args.adapters))]
        cases = [("base model", None), ("one adapter", [refs[0]] * n),
                 (f"{len(refs)} adapters", [refs[i % len(refs)] for i in range(n)])]
        llm.scheduler.step_log = steps = []
        for name, lora in cases:
            ms = decode_step_ms(llm, prompts, args.steps, lora_request=lora)
            rows.append({"case": name, "step_ms": ms})
            print(f"{name}: {ms:.1f} ms per decode step", flush=True)
    model = CostModel.fit(steps)
    blind = CostModel.fit([(replace(shape, adapters=0), t) for shape, t in steps])     # as if adapters were free
    decoding = [(shape, t) for shape, t in steps if shape.decode_tokens == n and not shape.prefill_tokens]
    for r, adapters in zip(rows, (0, 1, len(refs))):
        mine = [(shape, t) for shape, t in decoding if shape.adapters == adapters]
        r["measured_ms"] = 1e3 * sum(t for _, t in mine) / max(1, len(mine))
        r["predicted_ms"] = 1e3 * sum(model.predict(shape) for shape, _ in mine) / max(1, len(mine))
        r["blind_ms"] = 1e3 * sum(blind.predict(replace(shape, adapters=0)) for shape, _ in mine) / max(1, len(mine))
    base = rows[0]["step_ms"]
    print(f"\n{n} requests of {args.context} prompt tokens, SmolLM2 float32, one worker, rank {args.rank} "
          "on every projection\n")
    print("| requests run with | decode step ms | vs the base model | the scheduler's step ms "
          "| the cost model's price ms | without its adapter term |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['step_ms']:.1f} | {r['step_ms'] / base:.2f}x | {r['measured_ms']:.1f} "
              f"| {r['predicted_ms']:.1f} | {r['blind_ms']:.1f} |")
    print(f"\n(the last three: the mean of the same decode steps as the scheduler measured them, and as the cost model "
          f"fitted on all {len(steps)} steps of the three runs prices them, {1e3 * model.per_adapter:.1f} ms per "
          "adapter in a step, and without that term)")
    save_json(args.out, {"requests": n, "context": args.context, "rank": args.rank, "adapters": args.adapters,
                         "steps": args.steps, "rows": rows, "per_adapter_ms": 1e3 * model.per_adapter})
