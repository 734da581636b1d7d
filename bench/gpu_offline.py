"""python -m bench gpu-offline: our engine against HF transformers ``generate`` on one device,
at the shapes of the served models (random weights, so no checkpoint is needed): a batch of
prompts of one length, each generating the same number of tokens (EOS ignored), greedy.

HF runs one static batch (no padding needed: equal lengths) with its own KV cache; ours runs
its scheduler and paged pool with the Triton attention on CUDA. Both in the same dtype on the
same device, one after the other; the first call of each is a warm-up.
"""
from __future__ import annotations

import time

import torch

from tandem.bench.output import save_json


def _prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=g).tolist()


def run_ours(model: str, devices: str, dtype: str, prompts, max_tokens: int) -> dict:
    from tandem import LLM, SamplingParams
    n = len(prompts)
    with LLM(model, devices, dtype=dtype, max_num_seqs=n, max_num_batched_tokens=max(2048, sum(map(len, prompts))),
             kv_cache_fraction=0.5 if devices.startswith("cuda") else None) as llm:
        sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        t = time.perf_counter()
        outs = llm.generate(prompts, sp)
        dt = time.perf_counter() - t
        triton = llm._workers[0].cfg.triton_attention
    tokens = sum(len(o.token_ids) for o in outs)
    return {"system": "tandem" + (" (Triton attention)" if triton else ""), "tokens": tokens, "s": dt}


def run_hf(hf_dir, device: str, dtype: torch.dtype, prompts, max_tokens: int) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.from_pretrained(hf_dir)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    ids = torch.tensor(prompts, device=device)
    kw = dict(do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(ids))
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=4, min_new_tokens=4, **kw)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = model.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, **kw)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        dt = time.perf_counter() - t
    del model
    return {"system": "hf generate (static batch)", "tokens": int((out.shape[1] - ids.shape[1]) * ids.shape[0]),
            "s": dt}


def run(args) -> None:
    from tandem.engine.dtype import DTYPES
    from tandem.engine.models.loader import load_spec, resolve_model
    from tandem.sched.llm import DEFAULT_CACHE_DIR
    device = args.devices.split(",")[0] if args.devices.startswith("cuda") else "cpu"
    rows = []
    for model in args.models:
        hf_dir = resolve_model(model, DEFAULT_CACHE_DIR)
        spec = load_spec(hf_dir)
        prompts = _prompts(args.batch, args.prompt_len, spec.vocab_size, args.seed)
        ours = run_ours(model, args.devices, args.dtype, prompts, args.max_tokens)
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        hf = run_hf(hf_dir, device, DTYPES[args.dtype], prompts, args.max_tokens)
        for r in (ours, hf):
            r |= {"model": model, "tok_s": r["tokens"] / r["s"]}
            rows.append(r)
        ours["vs_hf"] = ours["tok_s"] / hf["tok_s"]
    dev = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    print(f"{dev}, {args.dtype}, batch {args.batch} x {args.prompt_len} prompt tokens -> {args.max_tokens} tokens each")
    print(f"| model | system | tokens | s | tok/s | vs HF |\n|---|---|---|---|---|---|")
    for r in rows:
        ratio = f"{r['vs_hf']:.2f}x" if "vs_hf" in r else ""
        print(f"| {r['model']} | {r['system']} | {r['tokens']} | {r['s']:.2f} | {r['tok_s']:.0f} | {ratio} |")
    save_json(args.out, {"device": dev, "dtype": args.dtype, "batch": args.batch, "prompt_len": args.prompt_len,
                         "max_tokens": args.max_tokens, "rows": rows})
