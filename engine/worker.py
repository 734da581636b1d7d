"""One worker process per device: weights, block pool, StepInput -> StepOutput.

A CPU worker is forked from a fork server, a process that has torch and this
module loaded already (multiprocessing's 'forkserver'), so a second worker, or
one started again after it died, skips the two seconds of importing torch (the
fork server holds about 150 MB of its own for that); a GPU worker, or one whose
OpenMP wait policy differs from the fork server's, is started fresh ('spawn').
The pool is sized from a memory budget (bytes, or a fraction of the device's
memory) and allocated in the worker's own memory: nothing else maps it (a
migration's rows leave through shared memory of their own), so a container's
small /dev/shm does not bound it, and a start does not copy it there.
"""
from __future__ import annotations

import contextlib
import os
import signal
import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.multiprocessing as mp

from tandem.engine.dtype import DTYPES, cpu_model
from tandem.engine.kvquant import int8_block_bytes
from tandem.engine.linear import packs, thin_blocks, thin_rows_of
from tandem.engine.messages import Command, DeviceError, PoolInfo, StepInput, StepOutput
from tandem.engine.models.spec import ModelSpec

# oneDNN and ideep (torch's layer over it) each keep a cache of the primitives built per
# (weight shape, row count), about 0.6 MB each whatever the shape, up to 1,024 entries by
# default. A server's steps take nearly every row count up to the token budget (decodes plus
# prefill chunks), so those caches grew a worker by 25-40 MiB a minute for a quarter of an
# hour. 64 entries keep the last ~10 row counts of a step's ~6 weight shapes; a step at a new
# count rebuilds its primitives in ~3 ms.
PRIMITIVE_CACHE = 64
START_TIMEOUT_S = 600.0  # a worker not ready by then (loading the model, building kernels) is stopped
STEP_TIMEOUT_S = 600.0   # a worker that answers no step for this long (hung: stopped, deadlocked) is stopped
TRIM_EVERY_S = 30.0     # how often a worker hands freed heap back to the system


def bound_native_memory() -> None:
    """Cap oneDNN's and ideep's primitive caches (each reads its size at first use, so call
    this before any product); a value the user set in the environment wins."""
    for var in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        os.environ.setdefault(var, str(PRIMITIVE_CACHE))


class HeapTrimmer:
    """glibc keeps freed memory inside its heap when live chunks sit between the free ones;
    oneDNN's evicted primitives and a step's activations leave such holes, and the resident
    memory only ever rose. ``malloc_trim`` returns the free pages (about 20 ms per GB freed),
    at most every ``TRIM_EVERY_S`` and after a step's output went out. No-op off glibc."""

    def __init__(self, every_s: float = TRIM_EVERY_S):
        self.every_s = every_s
        self.last = time.monotonic()
        try:
            import ctypes
            self._trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            self._trim = None

    def maybe_trim(self) -> None:
        now = time.monotonic()
        if self._trim is not None and now - self.last >= self.every_s:
            self._trim(0)
            self.last = time.monotonic()


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    hf_dir: str
    spec: ModelSpec                 # parsed by the parent, so workers never import transformers
    dtype: str                      # key of DTYPES
    device: str                     # "cpu" or "cuda:i"
    block_size: int                 # token slots per block
    kv_cache_bytes: int | None      # pool budget in bytes, or
    kv_cache_fraction: float | None  # fraction of device memory (CPU: of RAM / num CPU workers)
    num_cpu_workers: int            # CPU workers sharing this machine's RAM
    threads: int                    # torch intra-op threads in this process
    compile: bool                   # torch.compile the model step
    cpu_kernels: bool = True        # compiled CPU attention and projections (else torch's: reference attention, oneDNN)
    omp_wait_policy: str | None = None  # OpenMP threads between ops: ACTIVE spins, PASSIVE sleeps, BRIEF
                                        # spins briefly, then sleeps (_wait_policy);
                                        # None: the environment's (unset: spin briefly, then sleep)
    kv_cache_dtype: str = "auto"    # "auto": the model's dtype; "int8": full blocks compressed
                                    # (engine.quantpool), open blocks at the model's dtype
    max_num_seqs: int = 64          # requests at once: an int8 pool reserves their open blocks' staging
    triton_attention: bool = False  # attention by the Triton kernels (engine.triton_attention)
    num_blocks: int | None = None   # the pool's size, fixed (a restarted worker's: its books stay valid)
    weight_blocks: bool = True      # with the CPU kernels: weights that are exactly a GGUF's 4- or
                                    # 8-bit blocks stay in them (engine.blocks), else float32
    # the HF tokenizer's JSON, for structured outputs (engine.grammar): a file's path, so that the
    # spawn pipe carries a few KiB (the JSON is MBs: a worker that died before reading it left
    # its parent's write blocked for ever, the pipe's read end open in the parent until it ends)
    tokenizer_file: str | None = None


def pool_blocks(cfg: WorkerConfig, bytes_per_block: int, reserved: int = 0) -> int:
    """Number of blocks the memory budget buys, after ``reserved`` bytes."""
    if cfg.num_blocks is not None:
        return cfg.num_blocks
    if cfg.kv_cache_bytes is not None:
        budget = cfg.kv_cache_bytes
    elif cfg.device.startswith("cuda"):
        free, _total = torch.cuda.mem_get_info(torch.device(cfg.device))
        budget = int(free * (cfg.kv_cache_fraction or 0.9))
    else:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        budget = int(total * (cfg.kv_cache_fraction or 0.1) / max(1, cfg.num_cpu_workers))
    return max(0, budget - reserved) // bytes_per_block


# what a CPU worker holds beside its weights and pool: the interpreter, torch, the compiled
# kernels and a step's activations (about 150-200 MB measured with SmolLM2)
WORKER_OVERHEAD_BYTES = 200 << 20


def cpu_worker_bytes(cfg: WorkerConfig) -> int:
    """About the memory a CPU worker takes once loaded: its weights at its dtype (an
    overestimate where GGUF blocks stand in for them), its pool and the process itself."""
    from tandem.engine.models.loader import weight_bytes
    blocks, per_block, staged = sized_pool(cfg)
    weights = weight_bytes(Path(cfg.hf_dir), cfg.spec, DTYPES[cfg.dtype].itemsize)
    return weights + blocks * per_block + staged * _full_block(cfg) + WORKER_OVERHEAD_BYTES


def _full_block(cfg: WorkerConfig) -> int:
    """Bytes of one block at the model's dtype (every layer's rows of it)."""
    return cfg.spec.num_layers * cfg.block_size * cfg.spec.unit * DTYPES[cfg.dtype].itemsize


def _meminfo() -> dict[str, int]:
    """/proc/meminfo's sizes in bytes by name ({} where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            return {name: int(rest.split()[0]) * 1024 for name, _, rest in (line.partition(":") for line in f)
                    if rest.split()}
    except (OSError, ValueError):
        return {}


def available_memory() -> int | None:
    """Bytes the kernel can give without swapping (MemAvailable), where /proc says."""
    return _meminfo().get("MemAvailable")


def total_memory() -> int | None:
    """Bytes of memory and swap the machine has at all (MemTotal + SwapTotal), where /proc says."""
    info = _meminfo()
    return info["MemTotal"] + info.get("SwapTotal", 0) if "MemTotal" in info else None


def sized_pool(cfg: WorkerConfig) -> tuple[int, int, int]:
    """The pool the budget buys: (blocks, bytes per block, open blocks staged at full precision
    for an int8 pool); ValueError naming ``kv_cache_bytes`` when it buys fewer than two.
    Pure but for the device's memory size, so the front end checks it before any worker loads."""
    spec = cfg.spec
    full_block = _full_block(cfg)
    bytes_per_block, staged = full_block, 0
    if cfg.kv_cache_dtype == "int8":
        bytes_per_block = int8_block_bytes(spec.num_layers, spec.num_kv_heads, spec.head_dim, cfg.block_size)
        # each request's partial token-block stays at full precision: K and V, or a hidden cache's m
        hidden_rows = spec.d_model // spec.unit if spec.d_model % spec.unit == 0 else 0
        staged = cfg.max_num_seqs * max(2, hidden_rows)
    num_blocks = pool_blocks(cfg, bytes_per_block, staged * full_block)
    if num_blocks < 2:
        raise ValueError(f"kv_cache_bytes: the budget buys {num_blocks} blocks of {bytes_per_block} bytes"
                         + (f" after {staged} full-precision open blocks of {full_block} bytes "
                            f"(fewer with a smaller max_num_seqs)" if staged else "")
                         + f"; need >= 2 (blocks of {cfg.block_size} tokens)")
    return num_blocks, bytes_per_block, staged


def _build_runner(cfg: WorkerConfig):
    from tandem.engine.models.loader import build_model, stored_float32
    from tandem.engine.quantpool import QuantPool
    from tandem.engine.runner import ModelRunner
    torch.set_num_threads(cfg.threads)
    dtype = DTYPES[cfg.dtype]
    spec = cfg.spec
    kernel = None
    if cfg.device == "cpu" and cfg.cpu_kernels and not cfg.triton_attention:
        from tandem.engine.kernels import cpu_ops
        kernel = cpu_ops()
    # a bfloat16 model keeps GGUF's blocks for thin products: built in float32, where they are found
    thin = (cfg.weight_blocks and not cfg.compile and thin_blocks(cfg.device, dtype, kernel)
            and stored_float32(Path(cfg.hf_dir)))
    num_blocks, _, staged = sized_pool(cfg)
    model = build_model(Path(cfg.hf_dir), spec, torch.float32 if thin else dtype, cfg.device)
    if cfg.kv_cache_dtype == "int8":
        pool = QuantPool(spec.num_layers, spec.num_kv_heads, num_blocks, cfg.block_size, spec.head_dim,
                         dtype, cfg.device, open_capacity=staged)
    else:
        pool = torch.zeros(spec.num_layers, spec.num_kv_heads, num_blocks * cfg.block_size,
                           spec.head_dim, dtype=dtype, device=cfg.device)
    if cfg.compile:
        from tandem.engine.compiled import compile_model
        model = compile_model(model)
    elif packs(cfg.device, dtype) and not cfg.triton_attention:   # its hidden kernel reads dense weights
        model.pack_weights(kernel, cfg.weight_blocks)   # panels for the compiled kernel, else oneDNN's layout
    elif thin:
        model.pack_weights(kernel, True, dtype)         # dense bfloat16, and the blocks it was rounded from
    return ModelRunner(model, spec, pool, cfg.block_size, kernel, cfg.triton_attention,
                       cfg.tokenizer_file), num_blocks


def pool_info(runner, num_blocks: int) -> PoolInfo:
    dev = torch.device(runner.device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else cpu_model()
    return PoolInfo(num_blocks, runner.block_size, runner.hidden_rows, runner.block_bytes,
                    runner.int8_block_bytes, thin_rows_of(runner.model), name)


def worker_main(conn, cfg: WorkerConfig, env: dict[str, str] | None = None) -> None:
    """Process entry point: load, report ready, then serve steps until SHUTDOWN. Ctrl-C in a
    terminal reaches the whole process group; the worker leaves stopping to its parent (which
    sends SHUTDOWN), instead of dying mid-step with a traceback of its own. ``env``: the
    parent's environment when it started this worker (a forked worker has the fork server's)."""
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    bound_native_memory()
    trimmer = HeapTrimmer()
    try:
        runner, num_blocks = _build_runner(cfg)
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    runner.cuda_ipc = cfg.device.startswith("cuda")   # its exports reach other processes
    conn.send(("ready", pool_info(runner, num_blocks)))
    while True:
        try:
            msg: StepInput = conn.recv()
        except (EOFError, OSError):
            return
        if msg.command is Command.SHUTDOWN:
            return
        try:
            out = runner.step(msg)
        except Exception:
            out = StepOutput(msg.step_id, {}, 0, 0.0, 0.0, error=traceback.format_exc())
        conn.send(out)
        trimmer.maybe_trim()


_forkserver_policy: list = []     # the OpenMP environment the fork server loaded torch with (_wait_policy's)


def _start_context(device: str, wait_policy):
    """How to start a worker: forked from the fork server for a CPU worker whose OpenMP wait
    environment (``_wait_policy``'s key) is the one the server loaded torch with (the first CPU
    worker's, which starts it), else spawned. The fork server only imports (no OpenMP thread exists in it to be forked
    broken), and never touches CUDA."""
    if device != "cpu" or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    if not _forkserver_policy:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", __name__])
        _forkserver_policy.append(wait_policy)
        return ctx
    return mp.get_context("forkserver" if _forkserver_policy[0] == wait_policy else "spawn")


SPIN_COUNT = 30_000     # [measured] "BRIEF": how long a thread spins for the next op before it sleeps


def serving_wait_policy(environ) -> str:
    """A server's workers' wait policy: the one exported in ``environ`` (OMP_WAIT_POLICY), else
    "BRIEF" (see :func:`_wait_policy`)."""
    return (environ.get("OMP_WAIT_POLICY") or "BRIEF").upper()


@contextlib.contextmanager
def _wait_policy(policy: str | None):
    """The environment a process starts with under ``policy`` (None: as it is): libgomp reads it
    when torch loads, in a spawned worker or in the fork server. Yields the values it reads. "ACTIVE" and "PASSIVE" are
    OpenMP's OMP_WAIT_POLICY (spin for ever, sleep at once). "BRIEF" leaves OMP_WAIT_POLICY unset
    and sets libgomp's GOMP_SPINCOUNT to SPIN_COUNT (unless exported): a thread spins that many
    times for the next op, then sleeps, so an idle worker sleeps and a step's ops find their
    threads awake.

    [measured] SmolLM2 in bfloat16, a cpu:1 worker's two threads on a 2-core Zen 4 EPYC: every
    elementwise op of more than 32,768 values (torch's grain: a step of 57 rows and more) runs on
    both threads, and a sleeping thread takes tens of microseconds to wake, a thousand times a
    step. A prompt of 64 tokens took 104-109 ms PASSIVE, 59 with 30,000 spins, 59 ACTIVE, 53-60
    with libgomp's default 300,000 (in process). Through the server (`python -m bench streams
    --batches 1 8 16 32 48`, two runs each), decode TBT p50 20.2-21.3 / 30.4-31.1 / 42.1-44.0 /
    70.3-71.9 / 97.7-101.1 ms PASSIVE against 10.7-10.9 / 20.7-21.0 / 33.2-37.6 / 61.1-64.0 /
    82.8-87.5 with 30,000 spins."""
    saved = {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    if policy == "BRIEF":
        os.environ.pop("OMP_WAIT_POLICY", None)
        os.environ.setdefault("GOMP_SPINCOUNT", str(SPIN_COUNT))
    elif policy is not None:
        os.environ["OMP_WAIT_POLICY"] = policy
    try:
        yield tuple(os.environ.get(k) for k in saved)       # what libgomp will read: the fork server's key
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def prestart(device: str, omp_wait_policy: str | None) -> None:
    """Start the fork server that a worker on ``device`` will be forked from, if it would be,
    without waiting for it: its import of torch then overlaps whatever the caller loads before
    it starts the worker (the length predictor, the tokenizer)."""
    with _wait_policy(omp_wait_policy) as policy:
        if _start_context(device, policy).get_start_method() == "forkserver":
            from multiprocessing import forkserver
            forkserver.ensure_running()


class WorkerHandle:
    """The scheduler's view of one worker process (implements sched.scheduler.Device)."""

    POLL_S = 0.1      # how often a blocked collect() checks that the process lives

    def __init__(self, name: str, cfg: WorkerConfig):
        self.name = name
        self.cfg = cfg
        self.block_size = cfg.block_size
        self.pool_info: PoolInfo | None = None
        self._spawn()

    def _spawn(self) -> None:
        with _wait_policy(self.cfg.omp_wait_policy) as policy:
            ctx = _start_context(self.cfg.device, policy)
            self.conn, child = ctx.Pipe()
            self.proc = ctx.Process(target=worker_main, args=(child, self.cfg, dict(os.environ)), daemon=True,
                                    name=f"tandem-worker-{self.name}")
            self.proc.start()
        child.close()

    def restart(self) -> PoolInfo:
        """Replace a dead worker with a fresh one of the same configuration (blocks until it
        is ready), and a pool of as many blocks as before: a pool sized by a fraction of the
        GPU's free memory would otherwise come out another size (the free memory changed,
        another worker shares the GPU), and the device's books and placement assume this one."""
        if self.pool_info is not None:
            self.cfg = replace(self.cfg, num_blocks=self.pool_info.num_blocks)
        self.shutdown()
        self._spawn()
        return self.wait_ready()

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> PoolInfo:
        """The worker's pool once it has loaded; a worker not ready within ``timeout_s`` is
        killed and its start fails (a restart would otherwise wait on a hung start for ever)."""
        kind, payload = self._recv(time.monotonic() + timeout_s)
        if kind == "error":
            self.proc.join(timeout=5)
            raise RuntimeError(f"{self.name}: worker failed to start:\n{payload}")
        self.pool_info = payload
        return self.pool_info

    def alive(self) -> bool:
        """Whether the worker process runs (one stopped by shutdown() does not)."""
        return self.proc is not None and self.proc.is_alive()

    def submit(self, inp: StepInput) -> None:
        try:
            self.conn.send(inp)
        except (BrokenPipeError, OSError) as e:
            self.proc.join(timeout=self.POLL_S)
            gone = self.death() if not self.proc.is_alive() else f"{self.name}: worker is gone ({e})"
            raise DeviceError(gone) from e

    def collect(self) -> StepOutput:
        """A step's results; a worker silent past STEP_TIMEOUT_S is stopped (DeviceError: the
        device restarts it and queues its requests again, as after a death)."""
        return self._recv(time.monotonic() + STEP_TIMEOUT_S, f"answered no step in {STEP_TIMEOUT_S:.0f} s")

    def _recv(self, deadline: float | None = None, late: str = "was not ready in time"):
        while not self.conn.poll(self.POLL_S):
            if not self.proc.is_alive():
                raise DeviceError(self.death())
            if deadline is not None and time.monotonic() > deadline:
                self.proc.kill()
                self.proc.join(timeout=3)
                raise DeviceError(f"{self.name}: the worker {late}; it was stopped")
        try:
            return self.conn.recv()
        except (EOFError, OSError) as e:
            self.proc.join(timeout=self.POLL_S)
            raise DeviceError(self.death()) from e

    def death(self, idle: bool = False) -> str:
        """How the worker ended: its exit code, or the signal that killed it. SIGKILL, which no
        code here sends a live worker, is most often the kernel's out-of-memory killer."""
        code, who = self.proc.exitcode, f"{self.name}: {'idle ' if idle else ''}worker process"
        if code is None or code >= 0:
            return f"{who} died (exit code {code})"
        try:
            sig = signal.Signals(-code)
        except ValueError:
            return f"{who} killed by signal {-code}"
        hint = (" (most often the kernel's out-of-memory killer, which the kernel log names: fewer devices, "
                "a smaller kv_cache_bytes or a smaller model need less memory)" if sig is signal.SIGKILL else "")
        return f"{who} killed by {sig.name}{hint}"

    def shutdown(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(StepInput(Command.SHUTDOWN, -1))
            except (BrokenPipeError, OSError):
                pass
            self.proc.join(timeout=3)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=3)
        self.conn.close()


def wait_all(handles: list[WorkerHandle], timeout_s: float = START_TIMEOUT_S) -> None:
    """Wait until every worker is ready (they load in parallel, so one deadline covers all)."""
    deadline = time.monotonic() + timeout_s
    for h in handles:
        h.wait_ready(max(0.0, deadline - time.monotonic()))


class InProcessDevice:
    """A device that runs steps in the calling process (profiling, debugging)."""

    def __init__(self, name: str, cfg: WorkerConfig):
        self.name = name
        self.runner, num_blocks = _build_runner(cfg)
        self.pool_info = pool_info(self.runner, num_blocks)
        self._out: StepOutput | None = None

    def submit(self, inp: StepInput) -> None:
        self._out = self.runner.step(inp)

    def collect(self) -> StepOutput:
        out, self._out = self._out, None
        return out
