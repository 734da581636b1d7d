"""Typed messages between sched/ and the engine workers.

This module is a leaf: it imports no torch, so sched/ and cache/ can use it
without pulling in tensors. Every message is a plain slotted dataclass; the
worker mirrors request state keyed by id and is updated only from these.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field


class DeviceError(RuntimeError):
    """A device (worker) failed; the requests on it cannot continue."""


class CacheType(enum.Enum):
    """How a request keeps its context: K and V per layer, or the layer input."""
    KV = "kv"
    HIDDEN = "hidden"


class Direction(enum.Enum):
    """Which end of a block an owner fills from (BROS bidirectional blocks)."""
    LEFT = 0    # offsets 0, 1, 2, ... (RT owners, and everything today)
    RIGHT = 1   # offsets B-1, B-2, ... (BE owners sharing a block)


@dataclass(frozen=True, slots=True)
class LoraRef:
    """The LoRA adapter a request runs with: its name (what the request's ``model`` says), the
    directory PEFT saved it to (engine.lora loads it) and its files' version there (an adapter
    saved again in the same place, and loaded again, is another adapter)."""
    name: str
    path: str
    version: str = ""


@dataclass(frozen=True, slots=True)
class AdapterWeights:
    """A LoRA adapter's matrices, fused to the model's projections as engine.lora reads them
    (``weights[(layer, projection)]``: an engine.lora.Update, float32 on the CPU), sent to a worker once,
    before its first request there: workers never read adapter files themselves."""
    ref: LoraRef
    weights: dict


class Phase(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


class Command(enum.Enum):
    """What a message to a worker asks it to do."""
    STEP = "step"
    RESET = "reset"             # forget every request (the scheduler's books were reset)
    SHUTDOWN = "shutdown"
    PRODUCTS = "products"       # time the products a step's token rows take (StepOutput.products)


@dataclass(frozen=True, slots=True)
class PoolInfo:
    """What a worker reports of its block pool once loaded (cache/ builds its geometry from it)."""
    num_blocks: int             # blocks the memory budget bought
    block_size: int             # token slots per block
    hidden_rows: int            # blocks per block_size tokens of a hidden cache (d_model / unit), 0: none
    block_bytes: int = 0        # bytes of one block over all layers, at the pool's dtype
    int8_block_bytes: int = 0   # bytes of one block compressed to int8 (values, scale and offset)
    thin_rows: int = 0          # not the pool's but the engine's: steps of at most this many token rows
                                # multiply over a GGUF's blocks (engine.linear.Thin), 0: none
    device_name: str = ""       # the hardware: a GPU's name, else the CPU's model name


@dataclass(slots=True)
class SamplingSpec:
    """The part of SamplingParams a worker needs to pick the next token."""
    temperature: float          # 0 means greedy
    top_p: float                # in (0, 1]
    top_k: int                  # -1 or 0: off
    seed: int                   # per-request seed; randomness = f(seed, token index)
    min_tokens: int             # stop ids are masked until this many tokens exist
    stop_token_ids: tuple[int, ...]  # ids masked while below min_tokens (EOS included)
    logprobs: int = -1          # -1: none; k >= 0: the sampled token's log probability and the k likeliest
    prompt_logprobs: int = -1   # -1: none; k >= 0: the same for each prompt token after the first
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, added to its logit) before sampling
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0   # over prompt and output; the two above over the output only
    grammar: str = ""           # llguidance grammar the output must follow (engine.grammar); "": none
    min_p: float = 0.0          # tokens below min_p x the likeliest token's probability are dropped
    allowed_token_ids: tuple[int, ...] = ()    # only these may be sampled; (): any
    bad_words: tuple[tuple[int, ...], ...] = ()   # id sequences whose last token is banned after the rest

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """One sampled token's log probability under the model (log-softmax of its raw logits, before
    temperature, top-k/p and stop masking; under a grammar, over the tokens it allows), its rank
    (1: the likeliest; vLLM's: the tokens at least as likely, itself included) and the
    ``len(top_ids)`` likeliest tokens', best first."""
    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()
    rank: int = 1


@dataclass(slots=True)
class NewRequest:
    """Sent once when a request first reaches a worker (or after a migration)."""
    req_id: str
    token_ids: list[int]        # prompt + any tokens already generated
    num_prompt_tokens: int      # how many of token_ids are the prompt
    cache_type: CacheType
    sampling: SamplingSpec
    lora: LoraRef | None = None     # the adapter it runs with (None: the base model)


@dataclass(frozen=True, slots=True)
class SlotCopy:
    """One token's K/V moving between a pool slot and the worker's CPU store (bidirectional
    blocks: a BE token checkpointed before an RT owner overwrites it, or swapped back in).
    Token-block ``block`` is the physical (K, V) block pair (2*block, 2*block + 1)."""
    req_id: str
    token: int                  # index of the token in its request
    block: int                  # token-block
    slot: int                   # physical slot in it, 0..block_size-1


@dataclass(frozen=True, slots=True)
class Offload:
    """A preempted request's cache leaving the pool whole for the worker's host pool (swapping):
    the rows of its first ``num_tokens`` tokens are copied out, compressed to int8 when asked,
    and its blocks are free for others once the copy is done. It comes back with the request
    listed in ``StepInput.uploads``, into the blocks its next ScheduledRequest appends."""
    req_id: str
    num_tokens: int             # tokens whose cache is kept (all it has computed)
    int8: bool                  # compress on the way out (engine.kvquant)


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of an iteration (only the difference since last time)."""
    req_id: str
    phase: Phase
    num_new_tokens: int         # tokens to compute this step (chunk of prompt, or 1)
    new_block_ids: list[int]    # physical blocks appended to its block table, in order
    new_directions: list[Direction]  # one per new block
    sample: bool                # whether this step ends at the last known token
    new_slots: list[tuple[int, int]] | None = None   # bidirectional pools: (token-block, slot) per new token
    num_cached: int = 0         # first step from a cached prefix: its first new blocks already hold
                                # this many tokens' K/V (prefix caching), computed by other requests


@dataclass(frozen=True, slots=True)
class DeviceRows:
    """An exported cache that stays in GPU memory: the source worker's copy as a CUDA IPC handle
    (torch.multiprocessing's pickle of the tensor), opened by the destination worker, which then
    copies it GPU to GPU into its own blocks. The scheduler forwards the bytes and never touches
    the GPU."""
    handle: bytes               # pickled CUDA tensor [layers, kv_heads, g * n, head_dim]
    nbytes: int                 # size of the cache it names


@dataclass(slots=True)
class CacheImport:
    """A migrated request's cache arriving on its new device: the rows the source worker exported
    for its first ``num_tokens`` tokens go into the blocks this device reserved for them, and the
    request continues from there without recomputing. ``rows`` is the exported tensor
    ([layers, kv_heads, g * num_tokens, head_dim], g pool rows per token: K and V, or the m rows of
    a hidden cache), passed in shared memory, or a DeviceRows between GPU workers; typed
    ``object`` so this module imports no torch."""
    req_id: str
    num_tokens: int
    block_ids: list[int]
    directions: list[Direction]
    rows: object


@dataclass(slots=True)
class StepInput:
    """Everything one device does in one iteration, sched/ -> engine/."""
    command: Command
    step_id: int
    new_requests: list[NewRequest] = field(default_factory=list)
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    reset_ids: list[str] = field(default_factory=list)    # preempted: drop cache state, keep tokens
    finished_ids: list[str] = field(default_factory=list)  # drop entirely
    # run before the forward, in this order: copy these slots out to the CPU store, then copy
    # stored tokens into their new slots (a token may be copied out and back in the same step)
    checkpoints: list[SlotCopy] = field(default_factory=list)
    swap_ins: list[SlotCopy] = field(default_factory=list)
    # migration, also before the forward: write imported caches into their reserved blocks (their
    # NewRequest comes in this step), then copy these requests' caches out (StepOutput.exported)
    exports: list[str] = field(default_factory=list)
    imports: list[CacheImport] = field(default_factory=list)
    # swapping, the one transfer queue with the checkpoints above: offloads run first of all
    # (their blocks may be handed out again in this very step); uploads run after the scheduled
    # requests' new blocks are appended, right before the forward
    offloads: list[Offload] = field(default_factory=list)
    uploads: list[str] = field(default_factory=list)
    # LoRA adapters, before anything else: those this step's new requests run with that the
    # worker does not hold yet, and those it may forget
    adapters: list[AdapterWeights] = field(default_factory=list)
    drop_adapters: list[LoraRef] = field(default_factory=list)


@dataclass(slots=True)
class StepOutput:
    """Results of one iteration, engine/ -> sched/."""
    step_id: int
    sampled: dict[str, int]     # req_id -> new token id, for requests with sample=True
    num_tokens: int             # tokens computed in this step (prefill + decode)
    forward_s: float            # seconds spent in the model forward
    sample_s: float             # seconds spent sampling
    error: str | None = None    # set when the step raised; the worker keeps serving
    exported: dict[str, object] = field(default_factory=dict)  # req_id -> its cache rows (CacheImport.rows)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)  # for sampled requests that ask
    # req_id -> (position p, TokenLogprobs of prompt tokens p, p+1, ...) computed in this step
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    # Command.PRODUCTS: (rows, seconds) of the products every token row takes, timed at rows about
    # the thin-product threshold (engine.linear.product_seconds); () where the engine has none
    products: tuple[tuple[int, float], ...] = ()
