"""python -m server: start the OpenAI-compatible server."""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import re
import sys
import tempfile
import threading
import time
from pathlib import Path

from tandem.engine.worker import serving_wait_policy
from tandem.sched.rebalancer import PLACEMENTS
from tandem.sched.scheduler import POLICIES, SchedConfig, cache_type_of
from tandem.sched.tandem import MECHANISMS
from tandem.server.config import ServerConfig
from tandem.server.connections import Limits
from tandem.server.cors import Cors
from tandem.server.tls import Tls, cert_reqs


# vLLM's serve flags a ported command line may carry, and what to do here instead (None: nothing
# to do, it is how this server always works; a flag not listed gets argparse's own error)
VLLM_FLAGS = {
    "--gpu-memory-utilization": "size each device's KV pool with --kv-cache-bytes",
    "--scheduling-policy": "choose the scheduler with --policy (tandem, fcfs, rr, bros, aptserve, alise)",
    "--tensor-parallel-size": "tensor parallelism is not supported; --devices cuda:0,1 runs one model per GPU",
    "-tp": "tensor parallelism is not supported; --devices cuda:0,1 runs one model per GPU",
    "--pipeline-parallel-size": "pipeline parallelism is not supported",
    "--data-parallel-size": "--devices runs one model per device named (data parallel)",
    "--enable-chunked-prefill": None, "--no-enable-chunked-prefill": "prompts are always chunked here",
    "--enable-auto-tool-choice": None, "--tool-call-parser": None,
    "--disable-log-requests": None, "--enable-log-requests": "requests are not logged (nor their prompts)",
    "--uvicorn-log-level": "the log has warnings, and the server's own events at info",
    "--trust-remote-code": None,          # harmless: only this server's own code ever runs (as LLM takes it)
    "--download-dir": "nothing is downloaded: give --model a local checkpoint dir or a .gguf file",
    "--load-format": "--model takes a HF checkpoint dir (safetensors) or a .gguf file",
    "--block-size": "blocks are 16 tokens on the server (LLM(block_size=...) offline)",
    "--enforce-eager": None, "--max-logprobs": "at most 20 log probabilities per token, as vLLM's default",
    "--tokenizer": "the tokenizer is the --model directory's (or the .gguf's); copy its tokenizer files there",
    "--seed": "there is no server-wide seed; a request's own seed makes its sampling repeatable",
    "--max-lora-rank": None, "--max-loras": None, "--max-cpu-loras": None,   # adapters of any rank, any number
    "--fully-sharded-loras": None,
    "--quantization": "weights run as the checkpoint stores them (a GGUF's Q4_1 and Q8_0 blocks are kept on the "
                      "CPU); --kv-cache-dtype int8 compresses the KV cache",
}
VALUE_FLAGS = {"--gpu-memory-utilization", "--scheduling-policy", "--tensor-parallel-size", "-tp",
               "--pipeline-parallel-size", "--data-parallel-size", "--tool-call-parser", "--uvicorn-log-level",
               "--download-dir", "--load-format", "--block-size", "--max-logprobs", "--tokenizer", "--seed",
               "--quantization", "--max-lora-rank", "--max-loras", "--max-cpu-loras"}


def _appendable(flag: str, path: str) -> None:
    """ValueError naming ``flag`` unless ``path`` can be opened to append to (created if missing)."""
    try:
        with open(path, "a", encoding="utf-8"):
            pass
    except OSError as e:
        raise ValueError(f"{flag}: cannot write {path}: {e.strerror}") from None


def _writable_dir(flag: str, path: str) -> None:
    """ValueError naming ``flag`` unless ``path`` is a directory this process can write in
    (created if missing)."""
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise ValueError(f"{flag}: cannot write in {path}: {e.strerror or e}") from None


def _vllm_flags(unknown: list[str]) -> tuple[list[str], list[str]]:
    """``unknown`` arguments split into (notes on vLLM flags taken or refused, the rest)."""
    notes, rest, i = [], [], 0
    while i < len(unknown):
        flag = unknown[i].split("=", 1)[0]
        if flag not in VLLM_FLAGS:
            rest.append(unknown[i])
            i += 1
            continue
        i += 2 if flag in VALUE_FLAGS and "=" not in unknown[i] else 1      # the flag, and its value
        if VLLM_FLAGS[flag] is not None:
            notes.append(f"{flag} is vLLM's: {VLLM_FLAGS[flag]}")
    return notes, rest


def _listed(values: list[str]) -> tuple[str, ...]:
    """A list flag's values, vLLM's one-JSON-list form ('["a", "b"]') read as its items."""
    if len(values) == 1 and values[0].lstrip().startswith("["):
        try:
            items = json.loads(values[0])
        except ValueError:
            raise ValueError(f"not a JSON list: {values[0]}") from None
        if not (isinstance(items, list) and all(isinstance(x, str) for x in items)):
            raise ValueError(f"not a JSON list of strings: {values[0]}")
        return tuple(items)
    return tuple(values)


def lora_modules(values: list[str], cfg: ServerConfig, model: str) -> tuple[tuple[str, str], ...]:
    """--lora-modules: (name, directory) pairs from name=path or vLLM's JSON objects
    ({"name", "path", "base_model_name"}); each name once, none a served model's name, each
    directory an adapter this server computes, and one for ``model`` where that is a checkpoint
    directory (ValueError else; a GGUF model's adapters are checked against it once it is
    converted and loaded)."""
    from tandem.engine.lora import adapter_files, read_adapter
    from tandem.engine.messages import LoraRef
    from tandem.engine.models.loader import load_spec
    from tandem.server.adapters import check_name
    spec = load_spec(Path(model).expanduser()) if Path(model).expanduser().is_dir() else None
    out: dict[str, str] = {}
    for v in values:
        if v.lstrip().startswith("{"):
            try:
                obj = json.loads(v)
            except ValueError:
                raise ValueError(f"lora-modules: not JSON: {v}") from None
            if not (isinstance(obj, dict) and isinstance(obj.get("name"), str) and isinstance(obj.get("path"), str)):
                raise ValueError(f"lora-modules: a JSON module needs string 'name' and 'path': {v}")
            name, path = obj["name"], obj["path"]
        else:
            name, sep, path = v.partition("=")
            if not sep:
                raise ValueError(f"lora-modules: {v!r} is not name=path")
        if not name or not path or name in out:
            raise ValueError(f"lora-modules: {v!r}: " + ("a name given twice" if name in out else "empty name or path"))
        check_name(name, cfg)
        where = os.path.abspath(os.path.expanduser(path))
        try:
            adapter_files(where) if spec is None else read_adapter(LoraRef(name, where), spec)
        except ValueError as e:
            raise ValueError(f"lora-modules: {name}: {e}") from None
        out[name] = path
    return tuple(out.items())


def human_int(value: str) -> int:
    """vLLM's human-readable sizes: 4k = 4,000, 4K = 4,096 (m/M, g/G likewise)."""
    m = re.fullmatch(r"(-?)(\d+(?:\.\d+)?)([kKmMgG]?)", value.strip())
    if m is None:
        raise argparse.ArgumentTypeError(f"not an integer: {value!r}")
    sign, number, suffix = m.groups()
    if sign:
        raise argparse.ArgumentTypeError(f"must be positive, got {value!r}")
    if suffix in ("", *"KMG") and "." in number:
        raise argparse.ArgumentTypeError(f"not an integer: {value!r}")
    scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}[suffix]
    return int(float(number) * scale) if suffix.islower() else int(number) * scale


def port_number(value: str) -> int:
    port = int(value)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be 0-65535, got {port}")
    return port


def parse_args(argv=None, prog: str = "python -m server") -> ServerConfig:
    d = ServerConfig()
    ap = argparse.ArgumentParser(prog=prog, description="Tandem LLM server", allow_abbrev=False)
    ap.add_argument("model_tag", nargs="?", default=None, help="the model, as --model (vLLM's positional)")
    ap.add_argument("--model", default=None, help="'smollm2', a HF checkpoint dir, a .gguf file, or "
                    "'opt13b-random' / 'llama8b-random' / 'smollm2-random' (random weights at the real shapes, "
                    "for GPU benchmarks) (default: smollm2)")
    ap.add_argument("--served-model-name", nargs="+", default=None,
                    help="names clients use; the first is the one responses carry (default: smollm2 or the "
                         "dir name; the --model path as given is taken too)")
    ap.add_argument("--devices", default=d.devices, help="cpu:N (N worker processes on the CPU) or cuda:0,1,... "
                    "(one per GPU named) (default: %(default)s)")
    ap.add_argument("--host", default=d.host, help="address to listen on (default: %(default)s, this machine only; "
                    "0.0.0.0 for every interface, as vLLM's default)")
    ap.add_argument("--port", type=port_number, default=d.port,
                    help="0: any free port (the log names it) (default: %(default)s)")
    env_key = os.environ.get("TANDEM_API_KEY") or os.environ.get("VLLM_API_KEY")
    ap.add_argument("--api-key", nargs="+", default=[env_key] if env_key else [],
                    help="bearer keys, any of which a request may give (default: $TANDEM_API_KEY, else "
                         "$VLLM_API_KEY; none = open)")
    ap.add_argument("--data-dir", default=d.data_dir,
                    help="batch files, their database, learned output lengths and kept start-up profiles "
                         "(default: the XDG data dir)")
    ap.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs,
                    help="requests running at once on each device (default: %(default)s)")
    ap.add_argument("--max-num-batched-tokens", type=human_int, default=d.max_num_batched_tokens,
                    help="new tokens per iteration (smaller: shorter decode stalls behind prefills) "
                         "(default: %(default)s)")
    ap.add_argument("--max-model-len", type=human_int, default=d.max_model_len,
                    help="longest context, prompt plus output, in tokens (default: the model's; "
                         "a larger value is cut to it)")
    ap.add_argument("--policy", default=d.policy, choices=list(POLICIES),
                    help="tandem (default): all four mechanisms together: RT iterations sized by SLO slack "
                         "with BE packed into what is left, shortest predicted remaining time first inside each "
                         "class with aging, hidden caches where they save memory, swapping by estimated wait "
                         "(profiles a few seconds at start); "
                         "fcfs: one queue (vLLM-like); rr: alternate RT and BE iterations; "
                         "bros: RT by SLO slack, BE packed into what is left (profiles a few seconds at start); "
                         "aptserve: a knapsack over pending time picks requests and a KV or hidden cache "
                         "for each (Apt-Serve); alise: shortest predicted remaining time first, with aging "
                         "(ALISE; needs `python -m predictor train` once)")
    ap.add_argument("--startup-profile", default=d.startup_profile, choices=["cached", "fresh"],
                    help="cached (default): the start-up profile (the steps a policy or placement that prices "
                         "iterations measures) is kept in DATA_DIR/profiles and read back by a later start on the "
                         "same machine with the same model files, software and settings that shape a step (seconds "
                         "saved); fresh: measure it again and keep the new one")
    ap.add_argument("--step-log", default=None, metavar="FILE",
                    help="append one JSON line per model step to FILE: the tokens it computed for RT and BE "
                         "requests, its time and what the cost model priced it at (`python -m bench steps FILE` "
                         "tells where the time went)")
    ap.add_argument("--length-predictor", default=None,
                    help="with --policy tandem or alise: a predictor directory, or max_tokens (each request's max_tokens "
                         "as its length). Default: DATA_DIR/predictor, started from the trained predictor and "
                         "taught every finished request's real length (saved at shutdown)")
    ap.add_argument("--length-learned-max", type=int, default=None, metavar="N",
                    help="the predictor keeps the N newest real lengths it learned, beyond its trained ones; "
                         "each later one replaces the oldest, so memory stays bounded (0: learn nothing; "
                         "default 100,000, about 200 MB)")
    ap.add_argument("--no-length-cap", action="store_true",
                    help="predicted lengths may exceed a request's max_tokens (for benchmarks that fix each reply's "
                         "length through max_tokens, where capping would hand the predictor the answer)")
    ap.add_argument("--preemption-mode", default=d.preemption_mode, choices=["swap", "recompute"],
                    help="what a preempted request's cache does: swap to host memory and come back, or be "
                         "recomputed from its tokens (default: swap under tandem and alise, recompute elsewhere)")
    ap.add_argument("--swap-space", type=float, default=d.swap_space_gib,
                    help="GiB of host memory for swapped caches, per device (default: %(default)s)")
    ap.add_argument("--swap-dtype", default=d.swap_dtype, choices=["int8", "auto"],
                    help="swapped caches: int8 (channel-wise per block, about 40%% of fp32) or auto "
                         "(as the resident cache: swapped requests generate exactly the same tokens)")
    ap.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype, choices=["auto", "int8"],
                    help="the resident cache: auto (the model's dtype) or int8 (each full block compressed "
                         "channel-wise, the block being filled kept exact: about 2.7x the tokens of fp32 in "
                         "the same memory; perplexity +0.03%% on held-out ShareGPT replies)")
    ap.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                    help="reuse the K/V blocks of a prompt's start that an earlier request computed (a shared "
                         "system prompt, a chat's earlier turns) instead of computing them again; the same "
                         "outputs either way in float32, up to rounding in bfloat16 (default: on; not with "
                         "--bidirectional-blocks)")
    ap.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                    help="LoRA adapters to serve, each as name=path (a directory PEFT's save_pretrained wrote) "
                         "or vLLM's JSON '{\"name\": ..., \"path\": ...}': a request whose model is the name "
                         "runs with the adapter, in the same steps as requests on the base model")
    ap.add_argument("--enable-lora", action="store_true",
                    help="vLLM's: adapters are always served here; it takes the flag")
    ap.add_argument("--allow-runtime-lora-updating", action="store_true",
                    default=os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true"),
                    help="clients may load adapters from directories on this machine and unload them "
                         "(POST /v1/load_lora_adapter, /v1/unload_lora_adapter) (default: "
                         "$VLLM_ALLOW_RUNTIME_LORA_UPDATING)")
    ap.add_argument("--prefix-aware-routing", action=argparse.BooleanOptionalAction, default=d.prefix_routing,
                    help="several devices with prefix caching: send a request to the device whose cache holds "
                         "the most of its prompt's start (a chat's earlier turns), while that device holds at "
                         "most two requests (or half the least-loaded device's count) more than the least-loaded "
                         "one (default: on; --placement mell and bf place by size alone)")
    ap.add_argument("--kv-only", action="store_true",
                    help="with --policy tandem or aptserve: never a hidden cache (ablation)")
    ap.add_argument("--tandem-off", nargs="+", default=[], choices=list(MECHANISMS), metavar="MECHANISM",
                    help="with --policy tandem, switch mechanisms off (ablation): slo (iterations not bounded "
                         "by RT deadlines), lengths (no remaining-time order, no look-ahead admission), hidden "
                         "(KV caches only), late (look-ahead admission keeps a chat out however long it waited), "
                         "overdue (a chat that missed its TTFT stays behind the others until its first token)")
    ap.add_argument("--aptserve-fcfs", action="store_true",
                    help="with --policy aptserve: FCFS order, hidden caches only for requests that do not "
                         "fit otherwise (ablation)")
    ap.add_argument("--aptserve-mixed", action="store_true",
                    help="with --policy aptserve: prefills and decodes in the same iteration (Apt-Serve-S, "
                         "chunked prefill) instead of choosing one kind per iteration")
    ap.add_argument("--slo-decay", type=float, default=None,
                    help="with --policy aptserve: requests past their SLO keep this fraction of their value")
    ap.add_argument("--bidirectional-blocks", action="store_true", default=d.bidirectional_blocks,
                    help="with --policy tandem or bros: RT and BE share KV blocks from both ends; BE slots an RT request "
                         "overwrites are checkpointed to the CPU and swapped back in (BROS)")
    ap.add_argument("--cache-type", default=d.cache_type, choices=["kv", "hidden"],
                    help="hidden: keep each layer's input instead of K and V and recompute them at every "
                         "step: half the memory of KV with multi-head attention, more with grouped-query attention "
                         "(SmolLM2: 1.5x), for measurements")
    ap.add_argument("--placement", default=d.placement, choices=list(PLACEMENTS),
                    help="with several devices: lb: the device with the most free memory, and migrations "
                         "that even out memory use; static: each request stays on the least-loaded device at "
                         "its arrival; mell: pack requests onto as few devices as their growing caches allow, "
                         "migrating as needed (devices left empty are idle); bf / wf: best / worst fit, "
                         "moving a request only when its device overflows: its newest requests restart on "
                         "another device, counted as token migrations (default: %(default)s)")
    ap.add_argument("--rebalance-interval", type=float, default=d.rebalance_interval_s,
                    help="seconds between the rebalancer's epochs (placements other than static; "
                         "default: %(default)s)")
    ap.add_argument("--slo-ttft-ms", type=float, default=d.slo_ttft_ms,
                    help="a chat's time-to-first-token target, where its request names none (default: %(default)g)")
    ap.add_argument("--slo-tbt-ms", type=float, default=d.slo_tbt_ms,
                    help="a chat's target for the time between its tokens, where its request names none "
                         "(default: %(default)g)")
    ap.add_argument("--slo-tbt-mean", action="store_true",
                    help="with --policy tandem: the TBT target bounds each RT request's mean time per output "
                         "token (TPOT) instead of every gap; a gap may then take up to twice the target where "
                         "earlier tokens came early (more BE work and longer prompt chunks fit)")
    ap.add_argument("--max-waiting", type=int, default=d.max_waiting,
                    help="waiting requests before 429 (default: %(default)s)")
    ap.add_argument("--shed-chats-after", type=float, default=d.shed_chats_after, metavar="TARGETS",
                    help="new chats get 429 while every device holds a chat that has waited more than this many "
                         "of its TTFT targets for its first token: past its capacity for chats, the server says "
                         "so at once instead of queueing without bound (0: never; batch work is never refused)")
    ap.add_argument("--max-upload-mb", type=float, default=d.max_upload_bytes / 2**20,
                    help="largest file upload (413 beyond) (default: %(default)g)")
    ap.add_argument("--chat-control-tokens", action="store_true",
                    help="let chat message text act as template tokens such as <|im_end|> (default: "
                         "such text is tokenized as plain text, so a user cannot forge a turn)")
    ap.add_argument("--allowed-origins", nargs="+", default=[], metavar="ORIGIN",
                    help="origins whose browser pages may call the API (CORS), or * for any (default: none, "
                         "unlike vLLM's *: any page a user opens could otherwise read this server's answers); "
                         "vLLM's JSON list form ('[\"*\"]') is taken too")
    ap.add_argument("--allowed-methods", nargs="+", default=["*"], help="CORS: methods allowed (default: *)")
    ap.add_argument("--allowed-headers", nargs="+", default=["*"], help="CORS: request headers allowed (default: *)")
    ap.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials (cookies)")
    ap.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this certificate (PEM; the chain "
                    "after it), its key in --ssl-keyfile or in the same file")
    ap.add_argument("--ssl-keyfile", default=None, help="the certificate's private key (PEM)")
    ap.add_argument("--ssl-ca-certs", default=None, help="CA certificates (PEM) that client certificates are "
                    "checked against, with --ssl-cert-reqs")
    ap.add_argument("--ssl-cert-reqs", default="0", help="client certificates: 0 not asked for (default), "
                    "1 checked when shown, 2 required (mutual TLS); or none, optional, required")
    ap.add_argument("--ssl-ciphers", default=None, help="OpenSSL cipher list for TLS 1.2 (TLS 1.3's are fixed)")
    ap.add_argument("--root-path", default="", help="the path prefix a proxy in front serves this server under "
                    "(it strips the prefix before passing requests on); /openapi.json names it as the server URL")
    ap.add_argument("--enable-request-id-headers", action="store_true",
                    help="every response carries X-Request-Id: the request's own header, else a new id. A "
                         "request's X-Request-Id (or its request_id field) names its completion either way: "
                         "chatcmpl-<id>, cmpl-<id>")
    ap.add_argument("--disable-access-log", "--disable-uvicorn-access-log", action="store_true",
                    help="no line per request in the log (by default: client, method, path, status, seconds)")
    ap.add_argument("--disable-access-log-for-endpoints", default="", metavar="PATHS",
                    help="comma-separated paths left out of the access log, e.g. /health,/metrics,/ping")
    ap.add_argument("--disable-log-stats", action="store_true",
                    help="no throughput line in the log (by default one every 10 s while there is work: "
                         "prompt and generation tokens/s, requests running and waiting, KV cache use, "
                         "prefix-cache hit rate, as vLLM logs them)")
    ap.add_argument("--generation-config", default="auto", choices=["auto", "vllm"],
                    help="auto: requests take the model's sampling defaults (generation_config.json: "
                         "temperature, top_p, top_k, min_p, penalties; its max_new_tokens caps max_tokens) for "
                         "what they leave out, as vLLM's default; vllm: neutral defaults (temperature 1)")
    ap.add_argument("--chat-template", default=None,
                    help="a Jinja chat template, or the path of a file holding one, used instead of the "
                         "model's (vLLM's flag)")
    ap.add_argument("--trust-request-chat-template", action="store_true",
                    help="let a chat request carry its own chat_template (default: refused with 400; "
                         "the server renders it in Jinja's sandbox either way)")
    ap.add_argument("--max-body-mb", type=float, default=d.max_body_bytes / 2**20,
                    help="largest JSON request body (413 beyond, refused before it is read) (default: %(default)g)")
    ap.add_argument("--max-connections", type=int, default=d.limits.max_connections,
                    help="open connections at most; beyond, the oldest idle one is closed, or the new one "
                         "gets a 503 when all are serving requests (default: half the open-file limit, <= 4096)")
    ap.add_argument("--header-timeout", type=float, default=d.limits.head_timeout_s,
                    help="seconds an idle connection has to send a complete request head (then it is closed) "
                         "(default: %(default)g)")
    ap.add_argument("--body-timeout", type=float, default=d.limits.body_timeout_s,
                    help="seconds a request's body has to arrive after its head (then a 408) (default: %(default)g)")
    ap.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16"],
                    help="auto: bfloat16 where the CPU has AVX-512 BF16 or AMX (or the GPU supports it), else float32")
    ap.add_argument("--no-weight-blocks", action="store_true",
                    help="keep a GGUF model's weights dense instead of its own 4- and 8-bit blocks (by "
                         "default, on the CPU in float32, the products read the blocks: the same tokens in a "
                         "fifth of the memory, decode steps of 1-4 requests 1.5-2x faster; in bfloat16 the "
                         "blocks stay beside the weights for products of up to six rows with AMX, 64 with "
                         "AVX-512 BF16 alone, twelve otherwise)")
    ap.add_argument("--kv-cache-bytes", type=human_int, default=None,
                    help="each device's KV pool in bytes (default: 2 GiB, as vLLM's CPU backend)")
    ap.add_argument("--threads-per-worker", type=int, default=None,
                    help="torch threads in each worker process (default: the cores divided among the CPU workers)")
    ap.add_argument("--watch-parent", type=int, default=None, help=argparse.SUPPRESS)
    # vLLM's flags go first, with their values: argparse would take a value for the model positional
    notes, argv = _vllm_flags(list(sys.argv[1:] if argv is None else argv))
    a, unknown = ap.parse_known_args(argv)
    if unknown:
        ap.error(f"unrecognized arguments: {' '.join(unknown)}")
    if notes:
        ap.error("; ".join(notes))
    if a.model_tag is not None and a.model is not None and a.model_tag != a.model:
        ap.error(f"the model is given twice: {a.model_tag} and --model {a.model}")
    a.model = a.model_tag or a.model or d.model
    if a.enable_prefix_caching and a.bidirectional_blocks:
        ap.error("--enable-prefix-caching: not with --bidirectional-blocks, whose pool shares no blocks")
    if a.enable_prefix_caching is None:        # on by default where the pool can share blocks
        a.enable_prefix_caching = d.prefix_caching and not a.bidirectional_blocks
    try:                    # the scheduler's own check, before anything loads
        SchedConfig(a.max_num_seqs, a.max_num_batched_tokens, True, a.policy, None, a.bidirectional_blocks,
                    cache_type_of(a.cache_type), hybrid_cache=not a.kv_only, adaptive=not a.aptserve_fcfs,
                    slo_decay=a.slo_decay, mixed_batches=a.aptserve_mixed, preemption_mode=a.preemption_mode,
                    swap_space_bytes=int(a.swap_space * 2**30) if a.swap_space >= 0 else -1,
                    swap_dtype=a.swap_dtype, kv_cache_dtype=a.kv_cache_dtype, tandem_off=tuple(a.tandem_off),
                    mean_tbt=a.slo_tbt_mean, prefix_caching=a.enable_prefix_caching).check()
        if a.rebalance_interval <= 0:
            raise ValueError("rebalance-interval: must be positive")
        from tandem.sched.llm import check_devices, parse_devices
        check_devices(parse_devices(a.devices))
        for flag, v in (("threads-per-worker", a.threads_per_worker), ("kv-cache-bytes", a.kv_cache_bytes),
                        ("max-waiting", a.max_waiting), ("max-model-len", a.max_model_len)):
            if v is not None and v < 1:
                raise ValueError(f"{flag}: must be a positive integer, got {v}")
        if a.shed_chats_after < 0:
            raise ValueError(f"shed-chats-after: must be 0 (never) or more, got {a.shed_chats_after}")
        if a.length_learned_max is not None and a.length_learned_max < 0:
            raise ValueError(f"length-learned-max: must be 0 or more, got {a.length_learned_max}")
        from tandem.predictor.model import is_saved
        from tandem.sched.lengths import MAX_TOKENS
        if a.length_predictor not in (None, MAX_TOKENS) and not is_saved(a.length_predictor):
            raise ValueError(f"length-predictor: no length predictor in {a.length_predictor} (nor {MAX_TOKENS})")
        from tandem.engine.models.loader import check_model
        check_model(a.model)
        if a.chat_template is not None:
            from tandem.sched.llm import template_text
            a.chat_template = template_text(a.chat_template)
        if a.max_connections < 1 or a.header_timeout <= 0 or a.body_timeout <= 0:
            raise ValueError("max-connections, header-timeout and body-timeout must be positive")
        cors = Cors(_listed(a.allowed_origins), _listed(a.allowed_methods), _listed(a.allowed_headers),
                    a.allow_credentials)
        tls = Tls(a.ssl_certfile, a.ssl_keyfile, a.ssl_ca_certs, cert_reqs(a.ssl_cert_reqs), a.ssl_ciphers)
        tls.check()
        if a.root_path and not a.root_path.startswith("/"):
            raise ValueError(f"root-path: a path beginning with /, got {a.root_path!r}")
        if a.step_log:
            _appendable("step-log", a.step_log)
        if not all(0 < mb < math.inf and int(mb * 2**20) >= 1 for mb in (a.max_body_mb, a.max_upload_mb)):
            raise ValueError("max-body-mb and max-upload-mb must be positive and finite")
        if not 0 < a.slo_ttft_ms < math.inf or not 0 < a.slo_tbt_ms < math.inf:
            raise ValueError(f"slo-ttft-ms and slo-tbt-ms must be positive and finite, got {a.slo_ttft_ms:g} and "
                             f"{a.slo_tbt_ms:g}")
        if any(not k for k in a.api_key):
            raise ValueError("api-key: a key must not be empty (an empty one would let any request in)")
        _writable_dir("data-dir", a.data_dir)         # last: it creates the directory
    except ValueError as e:
        ap.error(str(e))
    names = a.served_model_name or [a.model if a.model == "smollm2" else os.path.basename(a.model.rstrip("/"))]
    # vLLM's default name is the --model string: taken too where no name was given
    aliases = tuple(dict.fromkeys(n for n in (*names[1:], *([] if a.served_model_name else [a.model]))
                                  if n != names[0]))
    named = ServerConfig(served_model_name=names[0], model_aliases=aliases)
    try:
        loras = lora_modules(a.lora_modules, named, a.model)
    except ValueError as e:
        ap.error(str(e))
    return ServerConfig(model=a.model, served_model_name=names[0], model_aliases=aliases,
                        listed_names=tuple(dict.fromkeys(names)), devices=a.devices,
                        lora_modules=loras, runtime_lora=a.allow_runtime_lora_updating,
                        host=a.host, port=a.port, api_keys=tuple(a.api_key), data_dir=a.data_dir,
                        max_num_seqs=a.max_num_seqs,
                        max_num_batched_tokens=a.max_num_batched_tokens, max_model_len=a.max_model_len,
                        policy=a.policy, tandem_off=tuple(a.tandem_off), slo_tbt_mean=a.slo_tbt_mean,
                        startup_profile=a.startup_profile, step_log=a.step_log,
                        bidirectional_blocks=a.bidirectional_blocks, cache_type=a.cache_type,
                        hybrid_cache=not a.kv_only, adaptive=not a.aptserve_fcfs, slo_decay=a.slo_decay,
                        mixed_batches=a.aptserve_mixed, placement=a.placement,
                        rebalance_interval_s=a.rebalance_interval, length_predictor=a.length_predictor,
                        length_cap=not a.no_length_cap, length_learned_max=a.length_learned_max,
                        preemption_mode=a.preemption_mode, swap_space_gib=a.swap_space, swap_dtype=a.swap_dtype,
                        kv_cache_dtype=a.kv_cache_dtype, prefix_caching=a.enable_prefix_caching,
                        prefix_routing=a.prefix_aware_routing,
                        slo_ttft_ms=a.slo_ttft_ms, slo_tbt_ms=a.slo_tbt_ms,
                        max_waiting=a.max_waiting, shed_chats_after=a.shed_chats_after,
                        max_upload_bytes=int(a.max_upload_mb * 2**20),
                        max_body_bytes=int(a.max_body_mb * 2**20), chat_control_tokens=a.chat_control_tokens,
                        chat_template=a.chat_template, trust_request_chat_template=a.trust_request_chat_template,
                        generation_config=a.generation_config, log_stats=not a.disable_log_stats,
                        cors=cors, tls=tls, root_path=a.root_path.rstrip("/"),
                        access_log=not a.disable_access_log, request_id_headers=a.enable_request_id_headers,
                        access_log_quiet=tuple(p.strip() for p in a.disable_access_log_for_endpoints.split(",")
                                               if p.strip()),
                        dtype=a.dtype, kv_cache_bytes=a.kv_cache_bytes,
                        weight_blocks=not a.no_weight_blocks,
                        watch_parent=a.watch_parent, threads_per_worker=a.threads_per_worker,
                        limits=Limits(a.max_connections, a.header_timeout, a.body_timeout),
                        # the server shares the cores with its workers: their OpenMP threads spin
                        # briefly for the next op, then sleep (an idle server uses no CPU), unless
                        # the user exported a policy
                        omp_wait_policy=serving_wait_policy(os.environ))


def _length_source(cfg: ServerConfig):
    """The data dir's own predictor once it has saved one, else the trained one (None). One
    that cannot be loaded (a damaged disk, a file written by hand) is moved aside with a
    warning: what it learned is lost, and the server starts from the trained one."""
    if cfg.length_predictor is not None or cfg.policy not in ("alise", "tandem"):
        return cfg.length_predictor
    from tandem.predictor import LengthPredictor
    from tandem.predictor.model import CURRENT, is_saved
    own = Path(cfg.data_dir) / "predictor"
    try:
        if not is_saved(own):
            if (own / CURRENT).is_file():  # it names no complete save
                raise ValueError(f"{own / CURRENT} names no saved predictor")
            return None
        return LengthPredictor.load(own, cfg.length_learned_max)
    except Exception as e:                 # noqa: BLE001 -- any damage: start without it
        aside = own.with_name(f"predictor.unreadable-{int(time.time())}")
        os.replace(own, aside)
        logging.getLogger("tandem.server").warning(
            "the data dir's length predictor could not be loaded (%s: %s); moved to %s, starting "
            "from the trained one", type(e).__name__, e, aside)
        return None


async def _watch_parent(pid: int) -> None:
    """Tests pass their pid: the server stops itself if that process goes away."""
    import signal

    async def watch():
        while True:
            await asyncio.sleep(1)
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                os.kill(os.getpid(), signal.SIGTERM)
                return
    asyncio.get_running_loop().create_task(watch())


def main(argv=None, prog: str = "python -m server") -> None:
    cfg = parse_args(argv, prog)
    import logging
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("tandem").setLevel(logging.INFO)    # the runtime's own events (migrations, restarts)
    from tandem.sched.async_engine import AsyncEngine
    from tandem.sched.llm import LLM
    from tandem.server.app import STATE, create_app
    from tandem.server.routes_batch import RUNNER
    from tandem.server.store import StoreError
    from tandem.server.connections import Listen, serve
    try:        # not under HTTPS: uvloop's start_tls stalls other connections while handshakes wait
        import uvloop
        if not cfg.tls.on:
            uvloop.install()
    except ImportError:
        pass

    def build_engine() -> AsyncEngine:
        llm = LLM(cfg.model, cfg.devices, dtype=cfg.dtype, max_num_seqs=cfg.max_num_seqs,
                  max_num_batched_tokens=cfg.max_num_batched_tokens, max_model_len=cfg.max_model_len,
                  kv_cache_bytes=cfg.kv_cache_bytes, policy=cfg.policy,
                  rt_budget_s=cfg.slo_tbt_ms / 1000, bidirectional_blocks=cfg.bidirectional_blocks,
                  cache_type=cfg.cache_type, hybrid_cache=cfg.hybrid_cache, adaptive=cfg.adaptive,
                  slo_decay=cfg.slo_decay, mixed_batches=cfg.mixed_batches,
                  omp_wait_policy=cfg.omp_wait_policy, threads_per_worker=cfg.threads_per_worker,
                  chat_control_tokens=cfg.chat_control_tokens, placement=cfg.placement,
                  rebalance_interval_s=cfg.rebalance_interval_s, slo_tbt_s=cfg.slo_tbt_ms / 1000,
                  length_predictor=_length_source(cfg), length_cap=cfg.length_cap,
                  length_learned_max=cfg.length_learned_max, preemption_mode=cfg.preemption_mode,
                  generation_config=cfg.generation_config,
                  swap_space=cfg.swap_space_gib, swap_dtype=cfg.swap_dtype,
                  kv_cache_dtype=cfg.kv_cache_dtype, tandem_off=cfg.tandem_off,
                  slo_tbt_mean=cfg.slo_tbt_mean, weight_blocks=cfg.weight_blocks,
                  enable_prefix_caching=cfg.prefix_caching, prefix_aware_routing=cfg.prefix_routing,
                  chat_template=cfg.chat_template, profile_cache=Path(cfg.data_dir) / "profiles",
                  reprofile=cfg.startup_profile == "fresh")
        try:
            for name, path in cfg.lora_modules:
                llm.load_lora(name, path)
            if cfg.step_log:
                llm.log_steps(cfg.step_log)
        except (ValueError, OSError):
            llm.shutdown()
            raise
        return AsyncEngine(llm)

    try:
        app = create_app(cfg, build_engine)
    except StoreError as e:
        print(f"tandem: {e}", file=sys.stderr)
        sys.exit(1)
    if cfg.watch_parent:
        app.on_startup.append(lambda app_: _watch_parent(cfg.watch_parent))
    t0 = time.monotonic()

    def listening(url: str) -> None:
        print(f"tandem: listening on {url} (model {cfg.model!r} loading; /health is 503 until ready)", flush=True)
    def stopping(signal_name: str) -> None:
        st = app[STATE]
        if st.engine is None:
            print(f"tandem: {signal_name}: stopping while the model loads", file=sys.stderr, flush=True)
            return
        lines, n = app[RUNNER].running, st.engine.num_requests()
        print(f"tandem: {signal_name}: stopping; new connections are refused; " + (
              f"requests in flight: {n}, of which clients' finish first (30 s at most) and batch lines' "
              f"({lines} lines) stop, to run again at the next start" if n else "no requests in flight"),
              file=sys.stderr, flush=True)
    try:
        listen = Listen(cfg.host, cfg.port, cfg.tls.context(), cfg.access_log, cfg.access_log_quiet)
        asyncio.run(serve(app, listen, cfg.limits, shutdown_timeout=30, listening=listening, stopping=stopping))
    except OSError as e:
        print(f"tandem: cannot listen on {cfg.host}:{cfg.port}: {e.strerror or e}", file=sys.stderr)
        sys.exit(1)
    print(f"tandem: stopped after {time.monotonic() - t0:.0f} s", file=sys.stderr)
    code = 1 if app[STATE].load_error is not None else 0
    _leave_a_load(code)
    sys.exit(code)


def _leave_a_load(code: int) -> None:
    """Stopped while the model still loads: the load's thread (a daemon) goes on in native code
    (torch, starting workers, shutting down what it built), and an interpreter that finalizes
    around it can abort the process ("terminate called without an active exception", status
    134, seen once in a few stops at that moment). So the workers started so far are stopped and
    the process ends at once, with ``code``."""
    loader = next((t for t in threading.enumerate() if t.name == "tandem-load"), None)
    if loader is None or not loader.is_alive():
        return
    import multiprocessing
    children = multiprocessing.active_children()
    for p in children:
        p.terminate()
    for p in children:
        p.join(5)
        if p.is_alive():
            p.kill()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main(prog=f"python -m {__spec__.parent}")        # server, or tandem.server when installed
