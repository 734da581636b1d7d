"""Request (server/ -> sched/) and the scheduler's own per-request state."""
from __future__ import annotations

import enum
import uuid
from dataclasses import dataclass, field

from tandem.engine.messages import CacheType, LoraRef
from tandem.engine.params import SamplingParams


class ServiceClass(enum.Enum):
    RT = "rt"     # interactive, with latency SLOs
    BE = "be"     # best effort (batch jobs)


class Status(enum.Enum):
    WAITING = "waiting"       # never prefilled, or preempted (cache discarded)
    RUNNING = "running"       # holds blocks on a device
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"             # EOS, a stop token id or a stop string
    LENGTH = "length"         # max_tokens or the model context
    ABORT = "abort"           # cancelled by the client
    ERROR = "error"           # the device or the scheduler failed


class Transfer(enum.Enum):
    """How a request migrates between devices (SPEC §4.4)."""
    KV = "kv"           # its cache is copied into blocks the destination reserved
    TOKEN = "token"     # its prompt and generated tokens are prefilled again at the destination


@dataclass(slots=True)
class Migration:
    """One migration of a request, as it is carried out and measured."""
    kind: Transfer
    src: int
    dst: int
    started: float                     # clock when it left its device
    tokens: int = 0                    # its context length when it left
    cache_bytes: int = 0               # bytes of cache copied (KV moves)
    reason: str = ""
    pause_s: float | None = None       # from leaving to its next token on the destination


@dataclass(slots=True)
class Request:
    """What a client asked for. Immutable by convention once submitted."""
    req_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    service_class: ServiceClass = ServiceClass.RT
    arrival_time: float = 0.0          # seconds, time.monotonic()
    slo_ttft_s: float | None = None    # time-to-first-token target, seconds
    slo_tbt_s: float | None = None     # time-between-tokens target, seconds
    prompt: str | None = None          # original text, when there was one
    stream_text: bool = False          # text wanted as tokens arrive (streams); else once at the end
    predicted_len: int | None = None   # predicted output tokens (length predictor or an oracle)
    predicted_spread: tuple[int, ...] = ()   # equally likely output lengths, ascending (empty: a point)
    cache_salt: str | None = None      # prefix caching: only requests with the same salt share blocks
    bad_words_ids: tuple[tuple[int, ...], ...] = ()   # sampling.bad_words as token ids (LLM.bad_words_ids)
    adapter: object | None = None      # the LoRA adapter it runs with (engine.lora.Adapter; None: the base model)

    @property
    def lora(self) -> LoraRef | None:
        """Which LoRA adapter it runs with (None: the base model)."""
        return None if self.adapter is None else self.adapter.ref

    @property
    def prefix_salt(self) -> str | None:
        """What prefix caching keys its blocks by beside their tokens: its cache salt, and its
        adapter (whose K and V differ from the base model's and from another adapter's)."""
        if self.lora is None:
            return self.cache_salt
        return f"{self.cache_salt or ''}\0lora\0{self.lora.name}\0{self.lora.path}\0{self.lora.version}"


@dataclass(slots=True)
class RequestState:
    """sched/'s mutable view of a request; nothing outside sched/ changes it."""
    request: Request
    seed: int                          # the seed actually used
    device: int = 0                    # index of the device holding it
    status: Status = Status.WAITING
    cache_type: CacheType = CacheType.KV
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list = field(default_factory=list)   # TokenLogprobs per output token, when asked
    prompt_logprobs: list = field(default_factory=list)   # per prompt token (None first), when asked
    num_computed: int = 0              # tokens whose cache is on the device
    sent_to_device: bool = False       # NewRequest already sent
    num_preemptions: int = 0
    cached_tokens: int | None = None   # prompt tokens found in the prefix cache when it first started
    cache_exact: bool = True           # False once back from an int8 swap: its blocks are near, not equal,
                                       # to computed ones, so none is named for other requests' prefixes
    num_crashes: int = 0               # worker deaths it lived through (requeued each time)
    finish_reason: FinishReason | None = None
    text: object | None = None         # its TextTracker while moving between devices
    text_result: str | None = None     # at the end: the generated text (stop string cut off)
    stop_reason: str | int | None = None   # at the end: the stop string or stop token id that ended it
    first_scheduled_time: float | None = None   # for the queue-time metric
    last_token_time: float | None = None        # arrival, then each token: pending time (SPEC §1.1, §2.1)
    stalled_s: float = 0.0      # seconds its past tokens waited beyond one iteration each (ALISE's aging)
    first_token_time: float | None = None       # when its first output token came back
    error: str | None = None
    moving: "Migration | None" = None       # set while it migrates (from leaving its device to its next token)

    @property
    def req_id(self) -> str:
        return self.request.req_id

    @property
    def num_tokens(self) -> int:
        return len(self.request.prompt_token_ids) + len(self.output_token_ids)

    def all_token_ids(self) -> list[int]:
        return self.request.prompt_token_ids + self.output_token_ids

    def scored_prompt(self) -> list:
        """Each prompt token's log probabilities as far as computed (None for the first, which
        nothing scores, and for any not computed yet)."""
        return list(self.prompt_logprobs) or [None] * len(self.request.prompt_token_ids)


def error_id() -> str:
    """An id for one internal failure: the client's error message and the log line both carry it."""
    return "err-" + uuid.uuid4().hex[:12]
