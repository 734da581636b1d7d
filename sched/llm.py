"""Offline API, as vLLM users know it: ``LLM(model=...).generate(prompts, params)``."""
from __future__ import annotations

import copy
import functools
import hashlib
import itertools
import logging
import os
import platform
import random
import threading
import time
import weakref
from dataclasses import asdict, dataclass, field, replace
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Sequence

import tandem.engine as engine_package
from tandem.engine.dtype import cpu_flags, resolve_dtype
from tandem.engine.grammar import Vocabulary, compile_grammar
from tandem.engine.lora import Adapter, LoraError, files_version, read_adapter
from tandem.engine.messages import DeviceError, LoraRef, TokenLogprobs
from tandem.engine.models.loader import load_spec, load_tokenizer, resolve_model, sampling_defaults
from tandem.engine.params import SamplingParams, int_list
from tandem.engine.worker import (WorkerConfig, WorkerHandle, available_memory, cpu_worker_bytes, prestart,
                                  sized_pool, total_memory, wait_all)
from tandem.sched.actor import Update
from tandem.sched.isolated import TEMPLATE_SECONDS, IsolatedTemplates
from tandem.sched.beam import BeamSearch, BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from tandem.sched.lengths import LengthSource, prediction_text
from tandem.sched.cost_model import OnlineCostModel
from tandem.sched.detok import Decoder, TokenBytes, decoded_token
from tandem.sched.placement import Placement
from tandem.sched.profile_store import Profile, ProfileStore
import tandem.sched.profiling as profiling_module
from tandem.sched.profiling import PLAN, SHORT_PLAN, fitted, measure
from tandem.sched.rebalancer import PLACEMENTS, Budgets, Rebalancer
from tandem.sched.request import FinishReason, Request, RequestState
from tandem.sched.runtime import Runtime
from tandem.sched.scheduler import PRICED, SchedConfig, Scheduler, cache_type_of
from tandem.sched.steplog import StepLog
from tandem.paths import cache_dir as user_cache_dir

DEFAULT_CACHE_DIR = user_cache_dir()
DEFAULT_KV_CACHE_BYTES = 2 << 30      # per device, when no budget is given (vLLM CPU's usual 2 GiB)

# vLLM's LLM arguments a ported script may pass, and what to do here instead (None: nothing to do,
# it is how this engine always works); a value in TAKEN asks for nothing this engine lacks either
VLLM_OPTIONS = {
    "gpu_memory_utilization": "size each device's KV pool with kv_cache_bytes or kv_cache_fraction",
    "tensor_parallel_size": "tensor parallelism is not supported; devices='cuda:0,1' runs one model per GPU",
    "pipeline_parallel_size": "pipeline parallelism is not supported",
    "quantization": "a .gguf model's 4- and 8-bit weights are used as they are (weight_blocks); no other "
                    "quantization is supported",
    "download_dir": "nothing is downloaded: give model a local checkpoint dir or a .gguf file",
    "tokenizer": "the checkpoint's own tokenizer is used",
    "enable_lora": None, "max_lora_rank": None, "max_loras": None, "max_cpu_loras": None,   # adapters: lora_request
    "speculative_config": "speculative decoding is not supported",
    "trust_remote_code": None, "enforce_eager": None, "disable_log_stats": None,
    "disable_custom_all_reduce": None, "max_seq_len_to_capture": None,
}
TAKEN = {"tensor_parallel_size": 1, "pipeline_parallel_size": 1, "quantization": None,
         "tokenizer": None, "download_dir": None, "speculative_config": None}


@dataclass(slots=True)
class RequestOutput:
    req_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]           # generated ids (EOS / stop id included when it ended the request)
    text: str                      # generated text, special tokens skipped, stop string cut (or kept:
                                   # SamplingParams.include_stop_str_in_output)
    finish_reason: str             # "stop" | "length" | "abort" | "error"
    logprobs: list | None = None   # with SamplingParams.logprobs: a PositionLogprobs per id of token_ids
    prompt_logprobs: list | None = None   # with SamplingParams.prompt_logprobs: per prompt id, None first
    num_cached_tokens: int = 0     # prompt tokens whose cache an earlier request had computed (prefix caching)
    stop_reason: str | int | None = None   # vLLM's: the stop string or stop token id that ended it (None: EOS)
    index: int = 0                 # which of the prompt's n choices this is
    choices: list["RequestOutput"] | None = None   # with SamplingParams.n > 1: all n, this one's fields the first's
    lora_request: "LoRARequest | None" = None     # the adapter it ran with, as given

    @property
    def request_id(self) -> str:
        """vLLM's name for ``req_id``."""
        return self.req_id

    @property
    def outputs(self) -> list["CompletionOutput"]:
        """vLLM's shape: the prompt's n completions, so ``out.outputs[0].text`` works as with vLLM."""
        return [CompletionOutput(c.index, c.text, c.token_ids, c.cumulative_logprob, c.logprobs, c.finish_reason,
                                 c.stop_reason, c.lora_request)
                for c in (self.choices if self.choices is not None else [self])]

    @property
    def cumulative_logprob(self) -> float | None:
        """vLLM's: the sum of the output tokens' log probabilities, where they were asked for."""
        return None if self.logprobs is None else sum(lp.logprob for lp in self.logprobs)

    @property
    def finished(self) -> bool:
        return True                # generate returns finished requests only

    # vLLM's fields of what this server has none of: no encoder, KV transfer or per-request
    # stats (vLLM gives None too without them)
    encoder_prompt = encoder_prompt_token_ids = kv_transfer_params = metrics = None

    @property
    def multi_modal_placeholders(self) -> dict:
        """vLLM's: where a prompt's images and audio sit (text prompts only here: none)."""
        return {}


@dataclass(frozen=True, slots=True)
class CompletionOutput:
    """vLLM's: one of a prompt's completions (``RequestOutput.outputs``)."""
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list | None
    finish_reason: str
    stop_reason: str | int | None
    lora_request: "LoRARequest | None" = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """vLLM's: a LoRA adapter to generate with (``generate(..., lora_request=...)``): its name,
    vLLM's integer id for it (kept, unused: the name identifies it here) and the directory PEFT's
    ``save_pretrained`` wrote it to."""
    lora_name: str
    lora_int_id: int = 1
    lora_path: str = ""


@dataclass(slots=True)
class Logprob:
    """vLLM's: a token's log probability, its rank in the vocabulary (1: the likeliest) and its
    text (None where the request asked for no text)."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class PositionLogprobs(dict):
    """One position's log probabilities as vLLM gives them offline: token id -> ``Logprob``, for
    the token there and the likeliest ones the request asked for. It reads as a TokenLogprobs
    too (the token there's ``logprob`` and ``rank``; ``top_ids`` and ``top_logprobs``)."""
    __slots__ = ("logprob", "rank", "top_ids", "top_logprobs")

    @classmethod
    def of(cls, token_id: int, lp: TokenLogprobs, text: Callable[[int], str | None]) -> PositionLogprobs:
        out = cls({token_id: Logprob(lp.logprob, lp.rank, text(token_id))})
        for k, (tid, value) in enumerate(zip(lp.top_ids, lp.top_logprobs)):
            if tid not in out:
                out[tid] = Logprob(value, k + 1, text(tid))
        out.logprob, out.rank, out.top_ids, out.top_logprobs = lp.logprob, lp.rank, lp.top_ids, lp.top_logprobs
        return out


log = logging.getLogger(__name__)


class PromptTooLong(ValueError):
    """A prompt longer than the model's context (found before tokenizing it)."""


@dataclass(frozen=True, slots=True)
class ChatTemplate:
    """How chat messages become a prompt (vLLM's chat options): followed by the assistant's
    turn opened (``add_generation_prompt``, the default), or with the last message, an
    assistant's, left open so that the reply continues it (``continue_final_message``: a reply
    begun for the model, "prefilled"). ``kwargs``: vLLM's chat_template_kwargs, more variables
    for the template (Qwen3's ``enable_thinking``, say); a template that does not read one
    ignores it. ``source``: a Jinja template used instead of the model's (vLLM's per-request
    chat_template); ``documents``: vLLM's documents, for a template that reads them (RAG);
    ``tools``: the tools the template lists (vLLM's offline chat gives them to it);
    ``isolated``: ``source`` came with a request, so it is rendered in a child process within a
    time limit (sched.isolated), not in this one."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    kwargs: dict = field(default_factory=dict)
    source: str | None = None
    documents: tuple[dict, ...] | None = None
    tools: tuple[dict, ...] | None = None
    isolated: bool = False

    def check(self, messages: list[dict]) -> None:
        """ValueError naming the option these messages cannot be rendered with."""
        for k in self.kwargs:
            if not (isinstance(k, str) and k.isidentifier()) or k in RENDER_ARGUMENTS:
                raise ValueError(f"chat_template_kwargs: {k!r} is not a template variable it may set "
                                 f"({', '.join(sorted(RENDER_ARGUMENTS))} are set otherwise)")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message: cannot be true with add_generation_prompt (set it false)")
        if self.continue_final_message and messages[-1].get("role") != "assistant":
            raise ValueError("continue_final_message: the last message must be the assistant's")

    def render(self, tokenizer, messages: list[dict]) -> str:
        """The prompt text; ValueError where the model has no template and none was given, or
        where the template fails on these messages (naming ``chat_template`` for one given here)."""
        if self.source is None and not getattr(tokenizer, "chat_template", None):
            raise ValueError("messages: this model has no chat template: give one (the server's --chat-template, "
                             "LLM(chat_template=...)) or send a completion")
        given = ({} if self.documents is None else {"documents": list(self.documents)}) | \
            ({} if self.tools is None else {"tools": list(self.tools)})
        from jinja2 import TemplateError
        try:
            return tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=self.add_generation_prompt,
                continue_final_message=self.continue_final_message, chat_template=self.source, **given, **self.kwargs)
        # the sandbox raises OverflowError for a range too big, a template's own code the others
        except (TemplateError, ArithmeticError, TypeError, LookupError) as e:
            if self.source is not None:
                raise ValueError(f"chat_template: does not render these messages: {e}") from None
            raise ValueError(f"messages: the model's chat template rejects them: {e}") from None


def template_text(given: str) -> str:
    """vLLM's --chat-template: the path of a file holding a Jinja template, or the template."""
    if not isinstance(given, str):
        raise ValueError(f"chat_template: a Jinja template or the path of a file holding one, got {given!r}")
    if os.path.isfile(given):
        with open(given, encoding="utf-8") as f:
            return f.read()
    if not any(c in given for c in "{}%"):
        raise ValueError(f"chat_template: {given!r} is neither a file nor a Jinja template")
    return given


CHAT = ChatTemplate()
# apply_chat_template's own arguments and the variables it fills in: not for chat_template_kwargs
RENDER_ARGUMENTS = frozenset({"messages", "conversation", "tools", "documents", "chat_template", "tokenize",
                              "add_generation_prompt", "continue_final_message", "return_dict", "return_tensors",
                              "padding", "truncation", "max_length", "tokenizer_kwargs",
                              "return_assistant_tokens_mask", "bos_token", "eos_token", "raise_exception"})


def parse_devices(devices: str) -> list[str]:
    """'cpu', 'cpu:N' (N CPU workers) or 'cuda:0,1' -> per-worker device strings."""
    if not isinstance(devices, str):
        raise ValueError("devices: must be a string like 'cpu:2' or 'cuda:0,1'")
    kind, _, rest = devices.partition(":")
    if kind == "cpu":
        n = int(rest) if _digits(rest) else (1 if devices == "cpu" else 0)
        if n < 1:
            raise ValueError(f"devices: {devices!r}: use 'cpu:N' with N >= 1")
        return ["cpu"] * n
    if kind == "cuda" and rest:
        ids = rest.split(",")        # a GPU named twice runs two workers, each with its own pool
        if not all(_digits(i) for i in ids):
            raise ValueError(f"devices: {devices!r}: use 'cuda:0,1,...'")
        return [f"cuda:{i}" for i in ids]
    raise ValueError(f"devices: {devices!r} is not 'cpu:N' or 'cuda:i,j,...'")


def _digits(text: str) -> bool:
    """ASCII digits only ('²' is a digit to str.isdigit, and no int)."""
    return text.isascii() and text.isdigit()


def check_devices(names: list[str]) -> None:
    """ValueError naming a CUDA device this machine does not have (a worker would fail to start on
    it, after the model had loaded); a warning where CPU workers outnumber the cores."""
    cuda = sorted({int(d.split(":")[1]) for d in names if d.startswith("cuda")})
    if cuda:
        import torch
        have = torch.cuda.device_count()
        if cuda[-1] >= have:
            there = "no CUDA device is visible here" if have == 0 else f"this machine has cuda:0 to cuda:{have - 1}"
            raise ValueError(f"devices: cuda:{cuda[-1]} does not exist ({there}); use 'cpu:N' on the CPU")
    ncpu, cores = names.count("cpu"), os.cpu_count() or 1
    if ncpu > cores:
        log.warning("devices: %d CPU workers on %d cores: each gets a share of a core, and together they "
                    "are slower than %d", ncpu, cores, cores)


def warn_if_memory_short(cpu_workers: list[WorkerConfig], available: int | None = None) -> bool:
    """Log a warning when the CPU workers, loaded, would take more memory than the machine has
    available (the kernel then kills one: a restart loop rather than a server); True if so.
    ValueError naming kv_cache_bytes where they would take more than all its memory and swap: the
    workers' pools could not all be allocated (the last failed with a traceback from its worker)."""
    available = available_memory() if available is None else available
    if not cpu_workers:
        return False
    each = cpu_worker_bytes(cpu_workers[0])
    total = total_memory()
    if total is not None and each * len(cpu_workers) > total:
        raise ValueError(f"kv_cache_bytes: {len(cpu_workers)} CPU worker(s) would need about "
                         f"{each * len(cpu_workers) / 2**30:.1f} GiB (weights, KV pool and process each), more "
                         f"than this machine's {total / 2**30:.1f} GiB of memory and swap: use a smaller "
                         "kv_cache_bytes or fewer devices")
    if available is None:
        return False
    if each * len(cpu_workers) <= available:
        return False
    log.warning("%d CPU worker(s) need about %.1f GiB (%.1f GiB each: weights, KV pool and process), more "
                "than the %.1f GiB available: the kernel may kill them; use fewer devices, a smaller "
                "kv_cache_bytes or a smaller model", len(cpu_workers), each * len(cpu_workers) / 2**30,
                each / 2**30, available / 2**30)
    return True


def _triton_choice(asked: bool | None, devices: list[str], head_dim: int) -> bool:
    """Whether the workers attend with the Triton kernels (LLM's triton_attention)."""
    from tandem.engine.triton_paging import supports_head_dim, triton_available
    if asked is None:
        if not all(d.startswith("cuda") for d in devices):
            return False
        why = ("Triton is not installed" if not triton_available() else
               None if supports_head_dim(head_dim) else f"head_dim {head_dim} is not a power of two >= 32")
        if why:
            log.warning("attention on CUDA takes torch's path, not the Triton kernels: %s", why)
        return why is None
    if asked and not triton_available():
        raise ValueError("triton_attention: Triton is not installed, or there is no CUDA device "
                         "(on the CPU it runs only under TRITON_INTERPRET=1)")
    if asked and not supports_head_dim(head_dim):
        raise ValueError(f"triton_attention: head_dim {head_dim} is not a power of two >= 32")
    return bool(asked)


def _code_digest() -> str:
    """A hash of the engine's sources (Python and C++) and of the profiling plans' module: a
    checkout where either changed measures its start-up profile again, where the version number
    stays the same."""
    root = Path(engine_package.__file__).parent
    files = [f for f in sorted(root.rglob("*")) if f.suffix in (".py", ".cpp", ".h") and "__pycache__" not in f.parts]
    h = hashlib.sha256()
    for f in files + [Path(profiling_module.__file__)]:
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


class LLM:
    """Load a model onto worker processes and generate offline.

    model: "smollm2", a HF checkpoint directory or a .gguf path.
    devices: "cpu:N" (N worker processes) or "cuda:0,1".
    length_predictor: where predicted output lengths come from (policy "alise" needs them):
    None (the trained predictor, ``python -m predictor train``), a predictor directory, a
    ``predictor.LengthPredictor``, or "max_tokens" (each request's max_tokens: an oracle
    when max_tokens is the length to generate). length_cap: predictions are capped by each
    request's max_tokens (False for benchmarks that fix reply lengths through max_tokens).
    length_learned_max: a predictor loaded from a directory (or the trained one) keeps that many
    of the real lengths it learns, the newest, beyond its trained ones (None: its default).
    preemption_mode: "swap" (a preempted request's cache goes to host memory and comes back),
    "recompute", or None (swap under alise, recompute elsewhere); swap_space: GiB of host memory
    for swapped caches per device; swap_dtype: "int8" (compressed, channel-wise per block) or
    "auto" (as the resident cache, so a swapped request's tokens stay exactly the same).
    kv_cache_dtype: "auto" (the resident cache at the model's dtype) or "int8" (every full block
    compressed channel-wise, the open one kept at the model's dtype: about 2.7x the tokens of an
    fp32 pool per block, at a small accuracy cost; the budget first reserves max_num_seqs
    requests' open blocks at full precision).
    policy: "tandem" (the default: SLO-sized iterations with RT and BE classes, remaining-time order
    with aging, hidden caches where they save memory, swapping by estimated wait; see
    sched/tandem.py), or one mechanism alone: "fcfs", "rr", "bros", "aptserve", "alise"
    (ablations and baselines); tandem_off: tandem's mechanisms to switch off ("slo", "lengths",
    "hidden", "late"); slo_tbt_mean: under tandem, an RT request's TBT target bounds its mean time per
    output token (TPOT) instead of each gap.
    weight_blocks: on the CPU in float32 with the compiled kernels, weights that are exactly a
    GGUF's 4- or 8-bit blocks (SmolLM2's: Q4_1, its embedding Q8_0) stay in them, a fifth of the
    memory, and the products read them directly: the same tokens, decode steps of 1-4 requests
    1.5-2x faster on a 2-core AVX2 EPYC (engine.blocks). In bfloat16 the blocks stay beside the
    bfloat16 weights for products of up to six rows with AMX, 64 with AVX-512 BF16 alone
    (engine.linear.Thin): decode steps of 1-4 requests 1.4-1.7x faster on a 2-core Xeon with AMX,
    of 1-32 requests 1.2-3.5x faster on a 2-core Zen 4 EPYC. False: dense weights throughout.
    enable_prefix_caching: a request whose tokens begin with a whole block (block_size tokens) or
    more that an earlier request computed reuses that earlier request's K/V blocks instead of
    computing them again (a shared system prompt, the earlier turns of a chat); blocks nobody
    holds stay cached until the pool needs them. Outputs are the same either way. Whole-block
    KV pools only (not with bidirectional blocks or hidden caches). Default (None): on, but
    with bidirectional blocks.
    prefix_aware_routing: on several devices with prefix caching, a new request goes to the
    device whose cache holds the most of its prompt's start (a chat's earlier turns, a system
    prompt computed there), while that device holds at most two requests (or half the
    least-loaded device's count) more than the least-loaded one and, under lb and wf, stays
    within the balancer's memory gap; False: placement by load alone. mell and bf place by size
    alone either way.
    triton_attention: attention by the Triton kernels (engine.triton_attention); None: on CUDA
    devices whenever Triton is installed. On the CPU it needs TRITON_INTERPRET=1 (tests only:
    the interpreter is hundreds of times slower than the compiled CPU kernel).
    seed: vLLM's: each request whose SamplingParams give no seed draws one from a generator
    seeded with it, in the order generate is called, so a script run again samples the same.
    generation_config: "auto" (vLLM's default): ``generate`` without sampling_params, and the
    server's requests for each field they leave out, take the model's generation_config.json
    sampling defaults (temperature, top_p, top_k, min_p, the penalties, and max_new_tokens as a
    cap on max_tokens); "vllm": neutral defaults (temperature 1, no cap).
    profile_cache: a directory where the start-up profile a policy that prices its iterations
    measures (seconds; sched.profiling) is kept, and read back by a later LLM on the same machine
    with the same model files, software and step-shaping settings (sched.profile_store); None:
    measured at every start. reprofile: measure even where one is kept, and keep the new one.
    vLLM's own arguments (VLLM_OPTIONS): those that ask for nothing this engine lacks are taken
    (tensor_parallel_size=1, enforce_eager, ...); the others raise ValueError saying what to use.
    """

    def __init__(self, model: str = "smollm2", devices: str = "cpu:1", *, dtype: str = "auto",
                 block_size: int = 16, kv_cache_bytes: int | None = None,
                 kv_cache_fraction: float | None = None, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 2048, enable_chunked_prefill: bool = True,
                 max_model_len: int | None = None, threads_per_worker: int | None = None,
                 cache_dir: str | os.PathLike | None = None, compile: bool = False,
                 cpu_kernels: bool = True, omp_wait_policy: str | None = None,
                 chat_control_tokens: bool = False,
                 policy: str = "tandem", rt_budget_s: float | None = None,
                 bidirectional_blocks: bool = False, cache_type: str = "kv",
                 hybrid_cache: bool = True, adaptive: bool = True, slo_decay: float | None = None,
                 mixed_batches: bool = False, placement: str = "lb",
                 rebalance_interval_s: float = 1.0, slo_tbt_s: float = 0.2,
                 length_predictor: Any = None, preemption_mode: str | None = None,
                 swap_space: float = 4.0, swap_dtype: str = "int8", kv_cache_dtype: str = "auto",
                 triton_attention: bool | None = None, tandem_off: Sequence[str] = (),
                 slo_tbt_mean: bool = False, length_cap: bool = True, weight_blocks: bool = True,
                 enable_prefix_caching: bool | None = None, prefix_aware_routing: bool = True,
                 length_learned_max: int | None = None, chat_template: str | None = None,
                 seed: int | None = None, generation_config: str = "auto",
                 profile_cache: str | os.PathLike | None = None, reprofile: bool = False,
                 **vllm_options: Any):
        self._workers: list[WorkerHandle] = []
        self._prefix_routing = bool(prefix_aware_routing)
        self.runtime: Runtime | None = None
        self.rebalancer: Rebalancer | None = None
        self._sinks: dict[str, Callable[[list[Update]], None]] = {}
        # every argument is checked before anything loads (the length predictor included)
        _check_vllm_options(vllm_options)
        names = parse_devices(devices)
        check_devices(names)
        _positive("block_size", block_size)
        if block_size > MAX_BLOCK_SIZE:
            raise ValueError(f"block_size: at most {MAX_BLOCK_SIZE} tokens a block (vLLM's sizes are 1-256), "
                             f"got {block_size!r}")
        for name, v in (("max_model_len", max_model_len), ("threads_per_worker", threads_per_worker)):
            if v is not None:
                _positive(name, v)
        if not isinstance(swap_space, (int, float)) or isinstance(swap_space, bool) or swap_space < 0:
            raise ValueError(f"swap_space: must be a non-negative number of GiB, got {swap_space!r}")
        if length_learned_max is not None and (not isinstance(length_learned_max, int) or length_learned_max < 0):
            raise ValueError(f"length_learned_max: must be 0 or more, got {length_learned_max!r}")
        if generation_config not in ("auto", "vllm"):
            raise ValueError(f"generation_config: must be 'auto' (the model's sampling defaults) or 'vllm' "
                             f"(neutral ones), got {generation_config!r}")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise ValueError(f"seed: must be None or an integer, got {seed!r}")
        # vLLM's seed: requests that give none draw theirs from it, so a script's run is repeatable
        self._seeds = None if seed is None else random.Random(seed)
        if isinstance(tandem_off, str):
            tandem_off = (tandem_off,)
        if not (isinstance(tandem_off, (list, tuple, set, frozenset)) and all(isinstance(m, str) for m in tandem_off)):
            raise ValueError(f"tandem_off: a mechanism's name or a list of them, got {tandem_off!r}")
        final = SchedConfig(max_num_seqs, max_num_batched_tokens, enable_chunked_prefill, policy, rt_budget_s,
                            bidirectional_blocks, cache_type_of(cache_type), hybrid_cache=hybrid_cache,
                            adaptive=adaptive, slo_decay=slo_decay, mixed_batches=mixed_batches,
                            preemption_mode=preemption_mode, swap_space_bytes=int(swap_space * 2**30),
                            swap_dtype=swap_dtype, kv_cache_dtype=kv_cache_dtype,
                            tandem_off=tuple(tandem_off), mean_tbt=slo_tbt_mean,
                            prefix_caching=_prefix_caching(enable_prefix_caching, bidirectional_blocks)).check()
        if placement not in PLACEMENTS:
            raise ValueError(f"placement: {placement!r} is not one of {list(PLACEMENTS)}")
        for name, v in (("rebalance_interval_s", rebalance_interval_s), ("slo_tbt_s", slo_tbt_s)):
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
                raise ValueError(f"{name}: must be a positive number of seconds, got {v!r}")
        if kv_cache_bytes is not None:
            _positive("kv_cache_bytes", kv_cache_bytes)
            if kv_cache_fraction is not None:
                raise ValueError("kv_cache_bytes, kv_cache_fraction: give one of them, not both")
        if kv_cache_fraction is not None and (not isinstance(kv_cache_fraction, (int, float))
                                              or isinstance(kv_cache_fraction, bool)
                                              or not 0 < kv_cache_fraction <= 1):
            raise ValueError(f"kv_cache_fraction: must be a number in (0, 1], got {kv_cache_fraction!r}")
        if omp_wait_policy not in (None, "ACTIVE", "PASSIVE", "BRIEF"):
            raise ValueError(f"omp_wait_policy: {omp_wait_policy!r} is not ACTIVE, PASSIVE or BRIEF")
        template = None if chat_template is None else template_text(chat_template)
        if "cpu" in names:              # the CPU workers' fork server loads torch while this process loads
            prestart("cpu", omp_wait_policy)
        self.lengths = self._lengths(policy, length_predictor, length_cap, length_learned_max)
        dtype, why = resolve_dtype(dtype, names[0])
        log.info("dtype %s: %s", dtype, why)
        self.dtype = dtype
        self.kv_cache_dtype = kv_cache_dtype
        t_load = time.monotonic()
        hf_dir = resolve_model(model, cache_dir or DEFAULT_CACHE_DIR)
        self.spec = load_spec(hf_dir)
        self.adapters: dict[str, Adapter] = {}     # LoRA adapters by name, as load_lora read them
        # what a request that sets no sampling field of its own takes (vLLM's generation_config)
        self.sampling_defaults = sampling_defaults(hf_dir) if generation_config == "auto" else {}
        if self.sampling_defaults:
            log.info("the model's sampling defaults (generation_config.json): %s", self.sampling_defaults)
        self.max_model_len = min(self.spec.max_model_len, max_model_len or self.spec.max_model_len)
        if max_model_len is not None and max_model_len > self.spec.max_model_len:
            log.warning("max_model_len %d is past the model's %d positions: using %d", max_model_len,
                        self.spec.max_model_len, self.max_model_len)
        if not enable_chunked_prefill and max_num_batched_tokens < self.max_model_len:
            raise ValueError("max_num_batched_tokens: must be >= max_model_len without chunked prefill")
        self.tokenizer = load_tokenizer(hf_dir)
        self._waits: set[threading.Event] = set()     # the calls waiting for their requests (``_run``)
        self._isolated = IsolatedTemplates(hf_dir, TEMPLATE_SECONDS)   # request templates (its child: lazily)
        if template is not None:
            self._use_template(template)
        self.chat_control_tokens = chat_control_tokens   # may message text act as template tokens?
        if self.tokenizer is not None:    # the Rust tokenizer directly: the Python wrapper costs 3x
            fast = getattr(self.tokenizer, "_tokenizer", None)
            self._decode = fast.decode if fast is not None else self.tokenizer.decode
            own = TokenBytes(self.tokenizer)
            self._decoders = {skip: Decoder(functools.partial(self._decode, skip_special_tokens=skip), own)
                              for skip in (True, False)}
        self._texts: dict[int, str] = {}    # token id -> its text alone (log probabilities' decoded_token)
        ncpu = sum(n == "cpu" for n in names)
        threads = threads_per_worker or max(1, (os.cpu_count() or 1) // max(1, ncpu))
        if kv_cache_bytes is None and kv_cache_fraction is None:
            kv_cache_bytes = DEFAULT_KV_CACHE_BYTES
        if ncpu and cpu_kernels:
            from tandem.engine.kernels import cpu_ops
            cpu_kernels = cpu_ops() is not None      # build once here, before the workers load it
        use_triton = _triton_choice(triton_attention, names, self.spec.head_dim)
        tokenizer_file = self._tokenizer_file(cache_dir or DEFAULT_CACHE_DIR)    # hashed and written once
        configs = [WorkerConfig(str(hf_dir), self.spec, dtype, dev, block_size, kv_cache_bytes, kv_cache_fraction,
                                ncpu, threads, compile, cpu_kernels, omp_wait_policy, kv_cache_dtype, max_num_seqs,
                                use_triton, weight_blocks=weight_blocks, tokenizer_file=tokenizer_file)
                   for dev in names]
        for wc in configs:          # a budget too small for a pool is refused before any worker loads
            if wc.device == "cpu" or kv_cache_bytes is not None:    # (a GPU's free memory: read in its worker)
                sized_pool(wc)
        warn_if_memory_short([wc for wc in configs if wc.device == "cpu"])
        for i, (dev, wc) in enumerate(zip(names, configs)):
            shared = dev == "cpu" or names.count(dev) > 1
            self._workers.append(WorkerHandle(f"{dev}#{i}" if shared else dev, wc))
        try:
            self._warm_vocabulary()
            wait_all(self._workers)
        except BaseException:
            self.shutdown()
            raise
        log.info("model %s loaded on %s in %.1f s", hf_dir.name, ", ".join(w.name for w in self._workers),
                 time.monotonic() - t_load)
        self._profiles = (None if profile_cache is None
                          else ProfileStore(profile_cache, self._profile_key(hf_dir, configs, final)))
        self._reprofile = bool(reprofile)
        detok = self.decoder if self.tokenizer is not None else None
        try:
            # FCFS over plain pools while profiling; then the configuration asked for
            self.scheduler = Scheduler(replace(final, policy="fcfs", bidirectional=False, hybrid_cache=True,
                                               adaptive=True, slo_decay=None, mixed_batches=False,
                                               tandem_off=(), mean_tbt=False),
                                       self._workers, self.spec.eos_token_ids, self.max_model_len, detok)
            if policy == "tandem":          # the knapsack's ρ where hidden caches pay, and the cost model
                options, cost = self._aptserve_options(hybrid_cache and not bidirectional_blocks, warn=False)
                if cost is None:
                    cost, _, how = self._profiled(PLAN)
                    log.info("policy tandem: start-up profile (iteration cost model) %s", how)
                self.scheduler.use_config(replace(final, **options), cost)
            elif policy in PRICED:          # policies that price iterations: profile first (seconds)
                # alise ranks requests by remaining time, where the short profile's rates suffice
                cost, _, how = self._profiled(SHORT_PLAN if policy == "alise" else PLAN)
                log.info("policy %s: start-up profile (iteration cost model) %s", policy, how)
                self.scheduler.use_config(final, cost)
            elif policy == "aptserve":
                options, cost = self._aptserve_options(hybrid_cache)
                self.scheduler.use_config(replace(final, **options), cost)
            else:
                self.scheduler.use_config(final)
            self.rebalancer = self._rebalancer(placement, rebalance_interval_s, slo_tbt_s, max_num_batched_tokens)
        except BaseException:
            self.shutdown()
            raise
        self._say_what_cannot_run(hf_dir)
        self._ids = itertools.count()

    def _lengths(self, policy: str, source: Any, cap: bool, max_learned: int | None) -> LengthSource | None:
        """Predicted output lengths: alise needs them (default: the trained predictor); tandem uses
        them when there is a predictor, and without one orders by prompt cost and aging alone."""
        if policy not in ("alise", "tandem") and source is None:
            return None
        try:
            src = LengthSource(source, cap, max_learned)
        except ValueError as e:
            if policy != "tandem" or source is not None:
                raise
            # the message, not the error: a kept log record would hold its traceback, and with it
            # this LLM (and its workers) for as long as the record lives
            log.warning("policy tandem without output-length predictions (%s): requests are ordered by "
                        "their prompts' cost and by aging only", str(e))
            return None
        log.info("output lengths: %s", src.name if src.predictor is None else "the length predictor")
        return src

    def _rebalancer(self, placement: str, epoch_s: float, tbt_s: float, max_tokens: int) -> Rebalancer | None:
        """The placement's books and migration budgets (several devices only; on one device every
        placement is the same). Budgets: the link from a copy probe, the re-prefill room from the
        iteration cost model (the policy's, else profiled now: seconds)."""
        n = len(self.scheduler.actors)
        if placement == "static" and n > 1:
            log.info("placement static over %d devices: each request stays on the one it arrives at", n)
        if placement == "static" or n < 2:
            return None
        from tandem.engine.runner import copy_bandwidth
        cost = self.scheduler.cost
        if cost is None and placement in ("mell", "lb"):
            cost, _, how = self._profiled(SHORT_PLAN)
            log.info("placement %s: start-up profile (iteration cost model) %s", placement, how)
        bw = copy_bandwidth()
        # Mell's devices are all of one capacity: packing to the smallest pool never overfills one
        capacity = self.scheduler.smallest_pool().num_blocks
        block_bytes = self._workers[0].pool_info.block_bytes
        log.info("placement %s over %d devices of %d blocks (the smallest pool): epoch %.2f s, link %.2f GB/s "
                 "(copy probe), TBT %.3f s", placement, n, capacity, epoch_s, bw / 1e9, tbt_s)
        return Rebalancer(Placement(placement), n, capacity, block_bytes,
                          Budgets(bw, epoch_s, cost, tbt_s, max_tokens))

    def _use_template(self, template: str) -> None:
        """Chats are rendered with ``template`` instead of the model's; it must render a turn."""
        if self.tokenizer is None:
            raise ValueError("chat_template: this model has no tokenizer to render chats for")
        ChatTemplate(source=template).render(self.tokenizer, [{"role": "user", "content": "Hi"}])
        self.tokenizer.chat_template = template
        log.info("chat template: the one given (%d characters), not the model's", len(template))

    # ---- prompts -------------------------------------------------------------
    def _profiled(self, plan: list, with_rho: bool = False) -> tuple[OnlineCostModel, Profile, str]:
        """The start-up profile of ``plan`` (with ρ's paired runs: ``with_rho``), the cost model
        fitted on it, and how it was had, for the log: read back where one is kept for this machine,
        model and setup (unless ``reprofile``), else measured now (seconds) and kept."""
        store = self._profiles
        kept = None if store is None or self._reprofile else store.load(plan, with_rho)
        if kept is not None:
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(kept.measured_at))
            how = (f"read from {store.path(plan, with_rho)} (measured {when} in {kept.seconds:.1f} s; "
                   f"--startup-profile fresh measures again)")
            return fitted(kept.samples, self.scheduler), kept, how
        profile = measure(self.scheduler, self.spec.vocab_size, plan, with_rho)
        where = None if store is None else store.save(plan, profile, with_rho)
        how = f"took {profile.seconds:.1f} s" + ("" if where is None else f" (kept in {where})")
        return fitted(profile.samples, self.scheduler), profile, how

    def _profile_key(self, hf_dir: Path, configs: list[WorkerConfig], sched: SchedConfig) -> dict[str, Any]:
        """What a start-up profile's steps depend on: the hardware, the model's files, the software
        and every setting that shapes a step (never the policy's own, which orders the steps)."""
        files = {f.name: [st.st_size, st.st_mtime_ns] for f in sorted(hf_dir.iterdir()) if f.is_file()
                 for st in [f.stat()]}
        workers = [{k: v for k, v in asdict(wc).items() if k not in ("spec", "tokenizer_file", "num_blocks")}
                   for wc in configs]
        software = {name: metadata.version(name) for name in ("tandem", "torch")} | {"code": _code_digest()}
        return {"model": {"dir": str(hf_dir.resolve()), "files": files},
                "workers": workers, "pools": [asdict(w.pool_info) for w in self._workers],
                "steps": {"max_num_seqs": sched.max_num_seqs, "max_num_batched_tokens": sched.max_num_batched_tokens,
                          "chunked_prefill": sched.chunked_prefill, "cache_type": sched.cache_type.value,
                          "prefix_caching": sched.prefix_caching, "max_model_len": self.max_model_len},
                "software": software | {"python": platform.python_version()},
                "machine": {"cores": len(os.sched_getaffinity(0)),
                            "cpu_flags": hashlib.sha256(" ".join(sorted(cpu_flags())).encode()).hexdigest()[:16]}}

    def _aptserve_options(self, hybrid: bool, warn: bool = True):
        """Apt-Serve's options and its online cost model (None with KV caches only); ρ is profiled
        when a hidden cache saves memory on this model, then refined from measured steps."""
        g = self.scheduler.queues[0].pool.geometry
        if hybrid and g.hidden_ratio >= 1:
            (log.warning if warn else log.info)("a hidden cache takes %.2fx the memory of a KV cache for this "
                                                "model (grouped-query attention); offering KV caches only",
                                                g.hidden_ratio)
            hybrid = False
        rho, cost = 0.0, None
        if hybrid:
            cost, profile, how = self._profiled(PLAN, with_rho=True)
            rho = profile.rho
            log.info("start-up profile (iteration cost model, hidden-cache rho) %s", how)
            log.info("hidden cache at %.2fx of KV, rho = %.3g s per KV block (paired runs), "
                     "%.3g in the joint cost model, refined online", g.hidden_ratio, rho,
                     cost.model.per_hidden_block)
        self.rho = rho
        return {"rho": rho, "hybrid_cache": hybrid}, cost

    def decoder(self, skip_special_tokens: bool = True) -> Decoder:
        """How generated ids become text: special tokens skipped, or kept."""
        return self._decoders[skip_special_tokens]

    def detokenize(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Generated ids to text, special tokens skipped unless asked for; a character the ids
        leave incomplete at the end is left out (``Decoder.whole``)."""
        return self._decoders[skip_special_tokens].whole(ids)

    def decode_prompt(self, ids: list[int]) -> str:
        """Prompt ids to text with special tokens kept (a chat template stays recognisable)."""
        return self._decode(ids, skip_special_tokens=False)

    def prediction_text(self, prompt: Any, sp: SamplingParams | None = None,
                        encoded: tuple[list[int], str | None] | None = None) -> str:
        """What the length predictor reads of a prompt (text, token ids or chat messages); token
        ids of a model without a tokenizer read as no text. A prompt ``sp`` truncated is read as
        what it kept (``encoded``: encode_prompt's ids and text)."""
        if sp is not None and sp.truncate_prompt_tokens is not None:
            prompt = encoded[0] if encoded[1] is None else encoded[1]
        return prediction_text(prompt, self.decode_prompt if self.tokenizer is not None else None)

    def check_ids(self, ids: Sequence[int], field: str) -> None:
        """ValueError naming ``field`` unless every id is a token id of the model."""
        if not ids or 0 <= min(ids) and max(ids) < self.spec.vocab_size:       # one pass in C, not one in Python
            return
        bad = [t for t in ids if not 0 <= t < self.spec.vocab_size]
        if bad:
            raise ValueError(f"{field}: {bad[0]} is not a token id of this model "
                             f"(0 to {self.spec.vocab_size - 1})")

    def ids_to_text(self, ids: list[int]) -> str:
        """Token ids to text, special tokens kept (/detokenize); ValueError for ids outside the
        vocabulary or a model without a tokenizer."""
        self.check_ids(ids, "tokens")
        if self.tokenizer is None:
            raise ValueError("tokens: this model has no tokenizer")
        return self.decode_prompt(ids)

    def check_sampling(self, sp: SamplingParams) -> None:
        """ValueError unless every stop token id (and every biased one) is one the model can
        produce, stop strings have text to match (a model without a tokenizer has none: they
        would never stop it), and a structured output's constraint compiles for this vocabulary."""
        self.check_ids(sp.stop_token_ids, "stop_token_ids")
        self.check_ids(list(sp.logit_bias or {}), "logit_bias")
        if sp.stop and self.tokenizer is None:
            raise ValueError("stop: this model has no tokenizer, so its output has no text to match; "
                             "use stop_token_ids")
        if sp.allowed_token_ids is not None:
            self.check_ids(sp.allowed_token_ids, "allowed_token_ids")
            stops = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(self.spec.eos_token_ids))
            if sp.min_tokens and stops >= set(sp.allowed_token_ids):
                raise ValueError("min_tokens: allowed_token_ids allows only stop tokens, which min_tokens holds back")
            if sp.structured_outputs is not None:     # the grammar says which tokens may come
                raise ValueError("allowed_token_ids: not with structured outputs, whose grammar decides "
                                 "which tokens may come next")
        if sp.bad_words and self.tokenizer is None:
            raise ValueError("bad_words: this model has no tokenizer to spell them in tokens")
        k = sp.truncate_prompt_tokens
        if k is not None and k > self.max_model_len:
            raise ValueError(f"truncate_prompt_tokens: {k} is more than the model context of {self.max_model_len}")
        if sp.structured_outputs is not None:
            if self._tokenizer_json is None:
                raise ValueError("structured_outputs: this model has no (fast) tokenizer to read its "
                                 "tokens' text by")
            self._vocabulary.check(compile_grammar(sp.structured_outputs), sp.structured_outputs.kind() != "grammar")

    def bad_words_ids(self, sp: SamplingParams) -> tuple[tuple[int, ...], ...]:
        """``sp.bad_words`` as the token id sequences the sampler bans: each word as it would be
        spelled at the start of the text and after a space (its leading spaces dropped first),
        the distinct ones."""
        seqs = {}
        for word in sp.bad_words:
            for text in (word.lstrip(), " " + word.lstrip()):
                seqs.setdefault(tuple(self.tokenizer(text, add_special_tokens=False)["input_ids"]), None)
        if sp.allowed_token_ids is not None:        # no token left to sample would give token 0
            banned = {s[0] for s in seqs if len(s) == 1}
            if banned >= set(sp.allowed_token_ids):
                raise ValueError("bad_words: they ban every token of allowed_token_ids")
        return tuple(seqs)

    @functools.cached_property
    def _tokenizer_json(self) -> str | None:
        """The HF tokenizer as JSON (padding and truncation off), which structured outputs read
        token texts from in every worker; None without a fast tokenizer."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:
            return None
        backend = copy.copy(backend)
        backend.no_padding()
        backend.no_truncation()
        return backend.to_str()

    def _say_what_cannot_run(self, hf_dir: Path) -> None:
        """Warn at start of what the setup refuses later: text where the checkpoint ships no
        tokenizer, contexts past what the (smallest) pool holds."""
        if self.tokenizer is None:
            log.warning("%s has no tokenizer (tokenizer.json, tokenizer_config.json, vocab.json or "
                        "tokenizer.model): only prompts of token ids can be served", hf_dir)
        holds = self.scheduler.pool_tokens()
        if holds < self.max_model_len:
            log.warning("the KV pool holds %d tokens of one request's context, fewer than max_model_len %d: "
                        "longer requests are refused; a larger kv_cache_bytes (or a smaller max_model_len) "
                        "makes them agree", holds, self.max_model_len)

    def _tokenizer_file(self, cache: str | os.PathLike) -> str | None:
        """The tokenizer's JSON in a file the workers read, under the cache dir and named by its
        hash (written once, whole or not at all); None without a fast tokenizer."""
        text = self._tokenizer_json
        if text is None:
            return None
        path = Path(cache) / "tokenizers" / f"{hashlib.sha256(text.encode()).hexdigest()[:24]}.json"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, path)
        return str(path)

    def _warm_vocabulary(self) -> None:
        """Read the vocabulary as structured outputs check grammars against it (0.2 s for
        SmolLM2's) while the workers load, instead of inside the first constrained request."""
        if self._tokenizer_json is not None:
            self._vocabulary

    @functools.cached_property
    def _vocabulary(self) -> Vocabulary:
        return Vocabulary(self._tokenizer_json, self.spec.vocab_size, self.spec.eos_token_ids)

    def encode_prompt(self, prompt: Any, template: ChatTemplate = CHAT, truncate: int | None = None,
                      max_tokens: int | None = None) -> tuple[list[int], str | None]:
        """A string, a token id list, or chat messages (rendered as ``template`` says) -> (token
        ids, text or None). ``truncate`` (vLLM's truncate_prompt_tokens): only the last this many
        ids are kept, and the text is theirs; -1: as many as leave the context room for
        ``max_tokens`` (None: for one token). vLLM's -1 keeps the whole context's worth, which
        leaves no room to generate."""
        room = min(max_tokens or 1, self.max_model_len - 1)
        keep = None if truncate is None else self.max_model_len - room if truncate == -1 else truncate
        ids, text = self._encode(prompt, template, check_chars=keep is None)
        if not ids:                    # a chat template may render a chat as nothing
            field_name = "chat_template" if template.source is not None else "prompt"
            raise ValueError(f"{field_name}: the prompt is empty after rendering and tokenization")
        if keep is None or len(ids) <= keep:
            return ids, text
        ids = ids[len(ids) - keep:]
        return ids, self.decode_prompt(ids) if text is not None else None

    def _encode(self, prompt: Any, template: ChatTemplate, check_chars: bool) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; pass token id lists")
            if check_chars:
                self._check_chars(len(prompt))
            return list(self.tokenizer(prompt)["input_ids"]), prompt
        if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer for chat messages")
            prompt = [m | {"content": message_text(m)} for m in prompt]
            if not all(isinstance(m.get("role"), str) and isinstance(m["content"], str) for m in prompt):
                raise ValueError("prompt: chat messages need a string 'role' and a 'content' that is a string or "
                                 "a list of text parts (or, in an assistant's turn of tool calls, null)")
            if check_chars:
                self._check_chars(sum(len(m["content"]) for m in prompt))
            template.check(prompt)
            text = self._render(template, prompt, check_chars)
            if not self.chat_control_tokens and self._holds_control_text(prompt):
                return self._encode_chat_literally(prompt, template), text
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]), text
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            self.check_ids(prompt, "prompt")
            return list(prompt), None
        raise ValueError("prompt: must be a non-empty string, token id list or chat message list")

    @functools.cached_property
    def _control_texts(self) -> tuple[str, ...]:
        """The spellings of the tokenizer's special tokens (<|im_start|>, <|im_end|>, ...)."""
        added = getattr(self.tokenizer, "added_tokens_decoder", {}) or {}
        return tuple(t.content for t in added.values() if t.special and t.content)

    def _render(self, template: ChatTemplate, messages: list[dict], check_chars: bool = False) -> str:
        """``template`` over ``messages``: a request's own in a child process (``isolated``),
        another here. With ``check_chars``, a given template's text past what the context can
        hold is refused before it is tokenized (PromptTooLong)."""
        chars = self._longest_token_chars
        bound = chars * self.max_model_len if chars else None     # the characters the context can hold
        check = check_chars and template.source is not None and bound is not None
        if not template.isolated:
            text = template.render(self.tokenizer, messages)
        else:       # past the bound (16 times it for a truncated prompt or the placeholders' rendering): its length
            most = None if bound is None else (bound if check else 16 * bound) - 1
            text = self._isolated.render(template, messages, most)
            if isinstance(text, int) and not check:
                raise ValueError(f"chat_template: its text of {text} characters is far more than the model "
                                 f"context of {self.max_model_len} tokens can hold")
        if check:
            self._check_chars(text if isinstance(text, int) else len(text))
        return text

    def _holds_control_text(self, messages: list[dict]) -> bool:
        return any(c in m["content"] for m in messages for c in self._control_texts)

    def _encode_chat_literally(self, messages: list[dict], template: ChatTemplate) -> list[int]:
        """Chat ids where message text is only text: the template is rendered around placeholders
        and tokenized as usual, each message's content with its special-token spellings split into
        ordinary tokens, so a user cannot end their turn or open a system turn by typing one."""
        tok = self.tokenizer
        marks = [f"\x00tandem-message-{i}\x00" for i in range(len(messages))]
        rendered = self._render(template, [dict(m, content=k) for m, k in zip(messages, marks)])
        ids, pos = [], 0
        for m, mark in zip(messages, marks):
            at = rendered.find(mark, pos)
            if at < 0:
                raise ValueError("prompt: a message holds a control token and the chat template "
                                 "does not place its content verbatim")
            ids += tok(rendered[pos:at], add_special_tokens=False)["input_ids"]
            ids += tok(m["content"], add_special_tokens=False, split_special_tokens=True)["input_ids"]
            pos = at + len(mark)
        return ids + tok(rendered[pos:], add_special_tokens=False)["input_ids"]

    def _check_chars(self, chars: int) -> None:
        """Refuse, before tokenizing, a text that must exceed the context: a token stands for at most
        as many characters as its longest vocabulary entry has (byte-level and sentencepiece
        vocabularies spell each token out), so ``chars`` characters are at least chars / longest
        tokens. A tokenizer that normalizes its input (and may drop characters) is not bounded."""
        longest = self._longest_token_chars
        if longest and chars >= longest * self.max_model_len:
            raise PromptTooLong(f"prompt: {chars} characters are more than the model context of "
                             f"{self.max_model_len} tokens can hold")

    @functools.cached_property
    def _longest_token_chars(self) -> int | None:
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None or backend.normalizer is not None:
            return None
        return max(map(len, self.tokenizer.get_vocab()), default=0) or None

    def output_room(self, prompt_tokens: int) -> int:
        """What a request that sets no max_tokens may generate: the rest of the context, or of
        what one request can hold in the KV pool where that is less (a pool smaller than the
        context would otherwise refuse every such request)."""
        room = min(self.max_model_len, self.scheduler.pool_tokens()) - prompt_tokens
        return room if room > 0 else self.max_model_len - prompt_tokens

    def _check_length(self, ids: list[int]) -> None:
        """ValueError for a prompt that fills the context (an empty one: encode_prompt refuses it)."""
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt: {len(ids)} tokens leave no room to generate in the model "
                             f"context of {self.max_model_len}")

    # ---- generation ------------------------------------------------------------
    def start_runtime(self) -> Runtime:
        """Start the device actors (once): from here on every step runs on an actor's thread."""
        if getattr(self, "_closed", False):
            raise RuntimeError("LLM: it was shut down; make a new one")
        if self.runtime is None:
            self.runtime = Runtime(self.scheduler, _weakly(self._route), self.rebalancer,
                                   self._prefix_routing and self.scheduler.cfg.prefix_caching)
        return self.runtime

    def subscribe(self, req_ids: list[str], sink: Callable[[list[Update]], None]) -> None:
        """``sink`` gets these requests' updates: one call per device step, on that actor's thread."""
        for rid in req_ids:
            self._sinks[rid] = sink

    def unsubscribe(self, req_ids: list[str]) -> None:
        for rid in req_ids:
            self._sinks.pop(rid, None)

    def _route(self, updates: list[Update]) -> None:
        if self.lengths is not None:
            self.lengths.observe(updates)
        groups: dict[int, tuple[Callable, list[Update]]] = {}
        for u in updates:
            sink = self._sinks.get(u.req_id)
            if sink is not None:
                groups.setdefault(id(sink), (sink, []))[1].append(u)
        for sink, ups in groups.values():
            sink(ups)

    def load_lora(self, name: str, path: str | os.PathLike) -> Adapter:
        """Read the LoRA adapter PEFT saved at ``path``, check that it fits this model (ValueError
        saying why not) and serve it as ``name``; a name given again takes the new directory (or
        the files saved again in the same one). Workers get its matrices from here."""
        if not isinstance(name, str) or not name:
            raise ValueError("lora_name: must be a non-empty string")
        if not os.fspath(path):
            raise ValueError(f"lora_path: give adapter {name!r}'s directory")
        where = os.path.abspath(os.path.expanduser(os.fspath(path)))
        ref = LoraRef(name, where, files_version(where))
        if name not in self.adapters or self.adapters[name].ref != ref:
            try:
                self.adapters[name] = read_adapter(ref, self.spec)
            except LoraError as e:
                raise ValueError(f"LoRA adapter {name!r}: {e}") from None
            log.info("LoRA adapter %r served, from %s", name, where)
        return self.adapters[name]

    def unload_lora(self, name: str) -> bool:
        """Serve ``name`` no more (requests already running on it finish); False if unknown."""
        if self.adapters.pop(name, None) is None:
            return False
        log.info("LoRA adapter %r no longer served", name)
        return True

    def _adapter_refs(self, given: list[LoRARequest | None]) -> list[Adapter | None]:
        """Each prompt's adapter, read and served (load_lora)."""
        return [None if lr is None else self.load_lora(lr.lora_name, lr.lora_path) for lr in given]

    def generate(self, prompts: Any, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, use_tqdm: bool = False, chat_template: ChatTemplate = CHAT,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Generate for each prompt; outputs in prompt order. Validates everything before queueing.

        A prompt is a string, a list of token ids, a chat's messages (rendered as
        ``chat_template`` says), or a dict: ``{"prompt": text}`` or ``{"prompt_token_ids": ids}``,
        with ``"cache_salt"`` to share cached blocks only among the prompts that give the same
        salt. ``lora_request``: the LoRA adapter to generate with (``LoRARequest``), for every
        prompt or one per prompt (None: the base model); prompts on different adapters and on
        the base model run in the same steps. An empty list of prompts gives an empty list, as
        vLLM's."""
        plist, salts = _prompts_and_salts(prompts)
        params = sampling_params if sampling_params is not None else SamplingParams(**self.sampling_defaults)
        if isinstance(params, SamplingParams):
            params = [params] * len(plist)
        if len(params) != len(plist):
            raise ValueError(f"sampling_params: {len(params)} given for {len(plist)} prompts")
        if not plist:
            return []
        given = _lora_requests(lora_request, len(plist))
        loras = self._adapter_refs(given)
        for p in params:
            if not isinstance(p, SamplingParams):
                raise ValueError("sampling_params: must be SamplingParams")
            p.validate()
        for p in params:
            self.check_sampling(p)
        encoded = [self.encode_prompt(p, chat_template, sp.truncate_prompt_tokens, sp.max_tokens)
                   for p, sp in zip(plist, params)]
        for ids, _ in encoded:
            self._check_length(ids)
        sized = [sp if sp.max_tokens is not None else replace(sp, max_tokens=self.output_room(len(ids)))
                 for (ids, _), sp in zip(encoded, params)]
        if self._seeds is not None:
            sized = [sp if sp.seed is not None else replace(sp, seed=self._seeds.randrange(2 ** 63)) for sp in sized]
        now = time.monotonic()
        reqs = [Request(f"gen-{next(self._ids)}", ids, _choice(sp, i), arrival_time=now, prompt=text,
                        cache_salt=salt, bad_words_ids=self.bad_words_ids(sp), adapter=lora)
                for (ids, text), sp, salt, lora in zip(encoded, sized, salts, loras) for i in range(sp.n)]
        texts = None if self.lengths is None else [self.prediction_text(p, sp, e)
                                                   for p, sp, e in zip(plist, params, encoded) for _ in range(sp.n)]
        outs = iter(self._output(st) for st in self._serve(reqs, texts, use_tqdm))
        return [_one_output([replace(next(outs), lora_request=lr) for _ in range(sp.n)])
                for sp, lr in zip(params, given)]

    def _serve(self, reqs: list[Request], texts: list[str] | None, use_tqdm: bool = False) -> list[RequestState]:
        """Run the requests to their ends (``texts``: what the length predictor reads of each,
        where it runs; None: their lengths are set already); DeviceError if any failed."""
        states = [self.scheduler.new_state(r) for r in reqs]    # each checks it fits a pool
        if texts is not None:                   # recorded only for requests that will run
            self.lengths.assign(reqs, texts)
        self._run(states, _progress(len(reqs)) if use_tqdm else None)
        failed = [st for st in states if st.finish_reason is FinishReason.ERROR]
        if failed:
            raise DeviceError(f"{len(failed)} request(s) failed: {failed[0].error}")
        return states

    def beam_search(self, prompts: Any, params: BeamSearchParams, *, use_tqdm: bool = False,
                    concurrency_limit: int | None = None, chat_template: ChatTemplate = CHAT,
                    lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[BeamSearchOutput]:
        """vLLM's ``LLM.beam_search``: for each prompt (as ``generate`` takes them), its
        ``params.beam_width`` best sequences (sched/beam.py says how they are found and ranked),
        best first, each with its ``tokens`` (prompt and output, a final end token included),
        ``text`` (theirs, special tokens' text left out unless ``params.skip_special_tokens`` is
        false), ``cum_logprob``, ``logprobs`` (per output token, as ``generate`` gives them), ``finish_reason``
        and ``stop_reason``, as vLLM's offline search gives them. Each step runs one one-token
        request per live beam, every prompt's together (or ``concurrency_limit`` prompts' at a
        time); the prefix cache keeps their earlier tokens. ``lora_request``: as ``generate``'s."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError("params: must be BeamSearchParams")
        params.validate()
        if concurrency_limit is not None and (not isinstance(concurrency_limit, int) or concurrency_limit < 1):
            raise ValueError(f"concurrency_limit: must be None or a positive integer, got {concurrency_limit!r}")
        plist, salts = _prompts_and_salts(prompts)
        if not plist:
            return []
        loras = self._adapter_refs(_lora_requests(lora_request, len(plist)))
        encoded = [self.encode_prompt(p, chat_template)[0] for p in plist]
        for ids in encoded:
            self._check_length(ids)
            self.scheduler.check_fits(len(ids), params.max_tokens)
        searches = [BeamSearch(ids, params, self.spec.eos_token_ids, self.max_model_len - len(ids))
                    for ids in encoded]
        bar = _progress(len(searches)) if use_tqdm else None
        step = concurrency_limit or len(searches)
        for start in range(0, len(searches), step):
            self._search(list(zip(searches, salts, loras))[start:start + step], bar)
        if bar is not None:
            bar.close()
        return [BeamSearchOutput(self._with_text(s.result(), params.skip_special_tokens)) for s in searches]

    def _search(self, group: list[tuple[BeamSearch, str | None, Adapter | None]], bar) -> None:
        """Run these searches to their ends, each step's beams all together."""
        while live := [g for g in group if not g[0].done]:
            reqs = [r for s, salt, lora in live
                    for r in s.step_requests(f"beam-{next(self._ids)}", cache_salt=salt, adapter=lora)]
            states = iter(self._serve(reqs, None))
            for s, _, _ in live:
                got = [next(states) for _ in s.beams]
                s.advance([st.output_logprobs[0] for st in got], [st.output_token_ids[0] for st in got])
            if bar is not None:
                bar.update(sum(s.done for s, _, _ in live))

    def _with_text(self, seqs: list[BeamSearchSequence], skip_special_tokens: bool) -> list[BeamSearchSequence]:
        """The sequences, each with its whole text (none where the model has no tokenizer) and
        its output tokens' log probabilities as vLLM's dicts."""
        for seq in seqs:
            seq.text = "" if self.tokenizer is None else self.detokenize(seq.tokens, skip_special_tokens)
            if seq.logprobs:
                seq.logprobs = self._positions(seq.tokens[-len(seq.logprobs):], seq.logprobs, True, 0)
        return seqs

    def chat(self, messages: Any, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             *, use_tqdm: bool = False, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template_kwargs: dict | None = None,
             chat_template: str | None = None, documents: list[dict] | None = None,
             tools: list[dict] | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """vLLM's ``LLM.chat``: one conversation (a list of ``{"role", "content"}`` messages) or a
        list of them, each rendered by the model's chat template (or ``chat_template``, a Jinja
        template) with the assistant's turn opened (or, ``continue_final_message``, its last
        message, an assistant's, left open for the reply to continue: see ``ChatTemplate``); one
        output per conversation, in order. ``tools`` go to the template, as vLLM gives them (the
        reply is not parsed for calls: the server does that). ``lora_request``: as ``generate``'s."""
        if isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages):
            messages = [messages]
        if not (isinstance(messages, (list, tuple)) and messages
                and all(isinstance(c, list) and c and all(isinstance(m, dict) for m in c) for c in messages)):
            raise ValueError("messages: give a conversation (a list of message dicts) or a list of them")
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise ValueError("tools: must be a list of tool dicts")
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise ValueError("chat_template_kwargs: must be a dict of template variables")
        if documents is not None and not (isinstance(documents, list) and all(isinstance(d, dict) for d in documents)):
            raise ValueError("documents: must be a list of dicts")
        if chat_template is not None and not isinstance(chat_template, str):
            raise ValueError("chat_template: must be a Jinja template (a string)")
        return self.generate(list(messages), sampling_params, use_tqdm=use_tqdm, lora_request=lora_request,
                             chat_template=ChatTemplate(add_generation_prompt, continue_final_message,
                                                        dict(chat_template_kwargs or {}), chat_template,
                                                        None if documents is None else tuple(documents),
                                                        None if tools is None else tuple(tools)))

    def _run(self, states: list[RequestState], bar) -> None:
        """Hand the requests to the actors and wait until every one has ended."""
        runtime = self.start_runtime()
        ids = [st.req_id for st in states]
        left, lock, done = [len(states)], threading.Lock(), threading.Event()

        def sink(ups: list[Update]) -> None:
            ended = sum(u.finish_reason is not None for u in ups)
            if ended:
                with lock:
                    left[0] -= ended
                    if bar is not None:
                        bar.update(ended)
                    if left[0] == 0:
                        done.set()
        self.subscribe(ids, sink)
        self._waits.add(done)
        try:
            if getattr(self, "_closed", False):     # shut down since the runtime was taken: nothing would end them
                raise RuntimeError("LLM: it was shut down")
            for st in states:
                runtime.add(st)
            done.wait()
            if left[0]:
                raise RuntimeError("LLM: it was shut down while these requests ran")
        except BaseException:
            if not getattr(self, "_closed", False):       # (a shut-down runtime holds nothing to abort)
                for rid in ids:
                    runtime.abort(rid)
            raise
        finally:
            self._waits.discard(done)
            self.unsubscribe(ids)
            if bar is not None:
                bar.close()

    def _output(self, st: RequestState) -> RequestOutput:
        sp = st.request.sampling
        text = st.text_result or "" if sp.detokenize else ""
        return RequestOutput(st.req_id, st.request.prompt, st.request.prompt_token_ids,
                             list(st.output_token_ids), text, st.finish_reason.value,
                             self._positions(st.output_token_ids, st.output_logprobs, sp.detokenize, 0)
                             if sp.logprobs is not None else None,
                             self._positions(st.request.prompt_token_ids, st.scored_prompt(), sp.detokenize, 1)
                             if sp.prompt_logprobs is not None else None,
                             st.cached_tokens or 0, st.stop_reason)

    def _positions(self, ids: Sequence[int], lps: Sequence[TokenLogprobs | None], detokenize: bool,
                   first: int) -> list:
        """Each position's log probabilities as vLLM's dicts (None where none were computed), the
        tokens' texts decoded one by one where the request wants text; a token that is part of a
        character shows the character it completes after the tokens from ``first`` to it, or ""
        (``decoded_token``, vLLM's correction)."""
        if not (detokenize and self.tokenizer is not None):
            return [None if lp is None else PositionLogprobs.of(t, lp, _no_text) for t, lp in zip(ids, lps)]

        def text_at(pos: int) -> Callable[[int], str]:
            return lambda tid: decoded_token(tid, ids, pos, first, self.decode_prompt, self._token_text)
        return [None if lp is None else PositionLogprobs.of(t, lp, text_at(i))
                for i, (t, lp) in enumerate(zip(ids, lps))]

    def _token_text(self, token_id: int) -> str:
        """A token decoded alone, special tokens kept (as vLLM's ``decoded_token``)."""
        got = self._texts.get(token_id)
        if got is None:
            got = self._texts[token_id] = self._decode([token_id], skip_special_tokens=False)
        return got

    # ---- lifecycle --------------------------------------------------------------
    def cache_config(self) -> tuple[int, str, int]:
        """(block size, the resident cache's dtype, blocks over all devices)."""
        infos = [w.pool_info for w in self._workers]
        return infos[0].block_size, "int8" if self.kv_cache_dtype == "int8" else self.dtype, \
            sum(i.num_blocks for i in infos)

    def get_tokenizer(self):
        """vLLM's: the model's HF tokenizer (None for a model served without one)."""
        return self.tokenizer

    def worker_pids(self) -> list[int]:
        """The worker processes' ids (a restarted worker has a new one)."""
        return [w.proc.pid for w in self._workers if w.proc is not None and w.proc.pid is not None]

    def log_steps(self, path: str | os.PathLike | None) -> None:
        """Append one JSON line per model step to ``path`` from now on, every device's to the
        one file (sched.steplog: what it computed for which class, its time, and what the cost
        model priced it at; ``python -m bench steps`` reads it); None stops."""
        old = self.scheduler.actors[0].trace
        new = None if path is None else StepLog(path)
        for a in self.scheduler.actors:
            a.trace = new
        if old is not None:
            old.close()

    def shutdown(self) -> None:
        """Stop the actors and the workers; the LLM refuses work from then on, and a call waiting
        for its requests in another thread raises instead of waiting for ever."""
        self._closed = True
        for done in list(getattr(self, "_waits", ())):
            done.set()
        if self.runtime is not None:
            self.runtime.stop()
            self.runtime = None
        for w in self._workers:
            w.shutdown()
        self._workers = []
        if getattr(self, "scheduler", None) is not None:
            self.log_steps(None)
        if getattr(self, "_isolated", None) is not None:
            self._isolated.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    def __del__(self):
        try:
            self.shutdown()
        except Exception:
            pass


def joined_text(content: Any) -> Any:
    """A message's content as text: a string as it is, a list of text parts (``{"type": "text",
    "text": ...}``, or an assistant's ``{"type": "refusal", "refusal": ...}``) joined by newlines,
    as vLLM joins them; anything else as it is."""
    def text(p) -> str | None:
        kind = p.get("type") if isinstance(p, dict) else None
        value = p.get(kind) if kind in ("text", "refusal") else None
        return value if isinstance(value, str) else None
    if isinstance(content, list) and all(text(p) is not None for p in content):
        return "\n".join(map(text, content))
    return content


def _check_vllm_options(given: dict[str, Any]) -> None:
    """vLLM's arguments an LLM takes (VLLM_OPTIONS): TypeError for any other, as Python's own;
    ValueError, saying what to do instead, for one asking what this engine does not do."""
    for name, value in given.items():
        if name not in VLLM_OPTIONS:
            raise TypeError(f"LLM() got an unexpected keyword argument {name!r}")
        if VLLM_OPTIONS[name] is not None and (name not in TAKEN or TAKEN[name] != value):
            raise ValueError(f"{name}: vLLM's; {VLLM_OPTIONS[name]}")


def message_text(m: dict) -> Any:
    """A chat message's content as text (``joined_text``); an assistant's turn of tool calls alone
    (OpenAI's ``content`` null or left out) as empty text, its calls left to the template."""
    content = joined_text(m.get("content"))
    if content is None and m.get("role") == "assistant" and m.get("tool_calls"):
        return ""
    return content


def _weakly(method: Callable) -> Callable:
    """``method``, called only while its object lives: the actor threads hold the LLM's router
    this way, so an LLM its user drops is collected, and shuts its workers down, as vLLM's does."""
    ref = weakref.WeakMethod(method)

    def call(*args) -> None:
        if (m := ref()) is not None:
            m(*args)
    return call


def _prefix_caching(asked: bool | None, bidirectional: bool) -> bool:
    """On unless refused or the pool cannot share blocks (bidirectional blocks); asked for with
    them, a ValueError."""
    if asked and bidirectional:
        raise ValueError("enable_prefix_caching: not with bidirectional_blocks, whose pool shares no blocks")
    return not bidirectional if asked is None else bool(asked)


MAX_BLOCK_SIZE = 1024     # tokens a KV block: past it a block outweighs any request's use of it


def _positive(name: str, v) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ValueError(f"{name}: must be a positive integer, got {v!r}")


PROMPT_KEYS = {"prompt", "prompt_token_ids", "cache_salt"}


def _lora_requests(lora_request: Any, n: int) -> list[LoRARequest | None]:
    """Each of n prompts' LoRARequest (or None): one for all, or a list of them."""
    given = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * n
    if len(given) != n:
        raise ValueError(f"lora_request: {len(given)} given for {n} prompts")
    if any(lr is not None and not isinstance(lr, LoRARequest) for lr in given):
        raise ValueError("lora_request: must be a LoRARequest, a list of them, or None")
    return given


def _choice(sp: SamplingParams, i: int) -> SamplingParams:
    """What choice i of a prompt's n asks: one choice, seeded seed + i (as the server seeds them)."""
    return sp if sp.n == 1 else replace(sp, n=1, seed=None if sp.seed is None else sp.seed + i)


def _no_text(token_id: int) -> None:
    return None


def _one_output(choices: list[RequestOutput]) -> RequestOutput:
    """A prompt's output: its only choice, or the first with all of them, indexed, in ``choices``."""
    if len(choices) == 1:
        return choices[0]
    choices = [replace(c, index=i) for i, c in enumerate(choices)]
    return replace(choices[0], choices=choices)


def _as_prompt_list(prompts: Any) -> list:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, list) and prompts and all(isinstance(x, int) for x in prompts):
        return [prompts]
    if isinstance(prompts, list) and prompts and all(isinstance(x, dict) and "role" in x for x in prompts):
        return [prompts]                    # one chat's messages
    if isinstance(prompts, (list, tuple)):
        return list(prompts)
    raise ValueError("prompts: give a prompt or a list of prompts")


def _prompts_and_salts(prompts: Any) -> tuple[list, list[str | None]]:
    """The prompts as a list, each unwrapped from its dict, and their salts (as ``_unwrap``)."""
    pairs = [_unwrap(p) for p in _as_prompt_list(prompts)]
    return [p for p, _ in pairs], [salt for _, salt in pairs]


def _unwrap(prompt: Any) -> tuple[Any, str | None]:
    """A prompt given as a dict, ``{"prompt": text}`` or ``{"prompt_token_ids": ids}`` with an
    optional ``"cache_salt"`` (prefix caching shares blocks only between requests of the same
    salt), -> (the prompt, its salt); any other prompt has no salt."""
    if not isinstance(prompt, dict):
        return prompt, None
    extra = set(prompt) - PROMPT_KEYS
    if extra:
        raise ValueError(f"prompt: unknown key {sorted(extra)[0]!r} (a prompt dict takes "
                         f"'prompt' or 'prompt_token_ids', and 'cache_salt')")
    if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise ValueError("prompt: a prompt dict needs exactly one of 'prompt' and 'prompt_token_ids'")
    salt = prompt.get("cache_salt")
    if salt is not None and not (isinstance(salt, str) and salt):
        raise ValueError("cache_salt: must be a non-empty string")
    if "prompt" in prompt:
        if not isinstance(prompt["prompt"], str):
            raise ValueError("prompt: 'prompt' must be a string ('prompt_token_ids' takes token ids)")
        return prompt["prompt"], salt
    ids = int_list(prompt["prompt_token_ids"])         # a tuple or a numpy array of ids too
    if not (isinstance(ids, list) and ids and all(isinstance(t, int) and not isinstance(t, bool) for t in ids)):
        raise ValueError("prompt_token_ids: must be a non-empty list of token ids")
    return ids, salt


def _progress(n: int):
    from tqdm import tqdm
    return tqdm(total=n, desc="generate", unit="req")
