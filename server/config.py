"""Server configuration, composed in server/__main__.py (the only place reading the environment)."""
from __future__ import annotations

from dataclasses import dataclass, field

from tandem.paths import data_dir
from tandem.server.connections import Limits
from tandem.server.cors import Cors
from tandem.server.tls import Tls


@dataclass(frozen=True, slots=True)
class ServerConfig:
    model: str = "smollm2"
    served_model_name: str = "smollm2"
    model_aliases: tuple[str, ...] = ()     # other names requests may give (answered as served_model_name)
    lora_modules: tuple[tuple[str, str], ...] = ()   # LoRA adapters served from the start: (name, directory)
    runtime_lora: bool = False              # clients may load and unload adapters (vLLM's runtime LoRA routes)
    listed_names: tuple[str, ...] = ()      # what /v1/models lists: --served-model-name's names (default: the first)
    devices: str = "cpu:1"
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[str, ...] = ()          # bearer keys any of which is accepted (none: open)
    generation_config: str = "auto"         # auto: the model's sampling defaults; vllm: neutral ones
    log_stats: bool = True                  # a throughput line in the log every 10 s while there is work
    cors: Cors = field(default_factory=Cors)    # origins whose pages may call the API (none by default)
    tls: Tls = field(default_factory=Tls)      # HTTPS where it has a certificate
    access_log: bool = True            # a line per request answered
    access_log_quiet: tuple[str, ...] = ()     # paths left out of it
    request_id_headers: bool = False   # every response carries X-Request-Id (the request's, else a new one)
    root_path: str = ""                # the path prefix of a proxy in front (published in /openapi.json)
    data_dir: str = field(default_factory=lambda: str(data_dir()))   # XDG data dir, outside any checkout
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None   # prompt + output tokens (None: the model's context)
    policy: str = "tandem"             # every mechanism together (see sched/tandem.py)
    tandem_off: tuple[str, ...] = ()   # tandem: mechanisms switched off (ablations)
    startup_profile: str = "cached"    # cached: kept in the data dir and read back; fresh: measured again
    step_log: str | None = None        # a file each model step is appended to, a JSON line each
    slo_tbt_mean: bool = False         # tandem: the TBT target bounds the mean gap (TPOT), not each gap
    bidirectional_blocks: bool = False  # BROS shared RT/BE blocks with lazy checkpointing
    cache_type: str = "kv"             # kv, or hidden: every request keeps layer inputs (Apt-Serve)
    hybrid_cache: bool = True          # tandem, aptserve: offer hidden caches (False: the KV-only ablation)
    adaptive: bool = True              # aptserve: knapsack order (False: the FCFS ablation)
    slo_decay: float | None = None     # aptserve: value factor past the SLO (None: near zero)
    mixed_batches: bool = False        # aptserve: prefill and decode in one iteration (Apt-Serve-S)
    placement: str = "lb"              # several devices: lb, static, mell, bf, wf
    rebalance_interval_s: float = 1.0  # seconds between the rebalancer's epochs
    length_predictor: str | None = None  # tandem, alise: a predictor directory or "max_tokens" (None: the data dir's)
    length_cap: bool = True            # predictions capped by each request's max_tokens
    length_learned_max: int | None = None  # real lengths learned kept at most (None: the predictor's default)
    preemption_mode: str | None = None  # swap or recompute (None: swap under tandem and alise, else recompute)
    swap_space_gib: float = 4.0        # host memory for swapped caches, per device
    swap_dtype: str = "int8"           # swapped caches: int8 (compressed) or auto (as resident)
    kv_cache_dtype: str = "auto"       # resident cache: auto (the model's dtype) or int8 (full blocks compressed)
    prefix_caching: bool = True        # reuse the K/V blocks of equal prompt starts (whole-block pools)
    prefix_routing: bool = True        # several devices: an arrival goes where its prompt's start is cached
    slo_ttft_ms: float = 1000.0        # default RT time-to-first-token target
    slo_tbt_ms: float = 200.0          # default RT time-between-tokens target
    max_waiting: int = 1024            # waiting requests before 429
    shed_chats_after: float = 0.0      # TTFT targets a chat waits on every device before new chats get 429 (0: never)
    max_upload_bytes: int = 200 << 20  # largest file upload
    chat_control_tokens: bool = False  # message text may spell template tokens (<|im_end|>, ...)
    chat_template: str | None = None   # a Jinja chat template used instead of the model's
    trust_request_chat_template: bool = False   # a chat request may carry its own template
    max_body_bytes: int = 8 << 20      # largest JSON request body (413 beyond, before reading it)
    limits: Limits = field(default_factory=Limits)   # open connections, head and body deadlines
    dtype: str = "auto"                # bfloat16 where the hardware has native bf16, else float32
    weight_blocks: bool = True         # a GGUF model's weights stay in its 4/8-bit blocks (CPU, float32)
    kv_cache_bytes: int | None = None
    watch_parent: int | None = None    # stop when this pid is gone (tests)
    omp_wait_policy: str = "BRIEF"     # the workers' OpenMP wait between ops (engine.worker._wait_policy)
    threads_per_worker: int | None = None  # torch threads per worker (None: cores / CPU workers)
