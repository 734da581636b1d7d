"""ModelRunner: the tensors of one device (weights, block pool) and one step's execution.

It mirrors each request's state keyed by id and changes it only from a
StepInput. It runs in the worker process; tests may also drive it directly.
"""
from __future__ import annotations

import functools
import itertools
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.engine.attention import PAGED_PREFILL_PAIRS, AttnBatch, HiddenBatch, HiddenSegment, PrefillSegment
from tandem.engine.grammar import Vocabulary
from tandem.engine.linear import product_seconds, row_projections, thin_rows_of, threshold_rows
from tandem.engine.kvquant import Int8Rows, dequantize, int8_block_bytes, quantize
from tandem.engine.lora import Adapter, StepLora
from tandem.engine.messages import (CacheImport, CacheType, Command, DeviceRows, Direction, LoraRef, NewRequest,
                                    Offload, Phase, SamplingSpec, StepInput, StepOutput)
from tandem.engine.models.spec import ModelSpec
from tandem.engine.hostcopy import HostCopier
from tandem.engine.quantpool import QuantPool
from tandem.engine.sampling import TokenCounts, log_probs, pick_logprobs, sample, token_logprobs
from tandem.engine.triton_attention import TritonMeta, tables
from tandem.engine.triton_paging import row_table


@dataclass(slots=True)
class ReqState:
    token_ids: list[int]        # prompt + generated, as this worker knows them
    num_prompt: int
    num_computed: int           # tokens whose K/V sit in the pool
    slots: torch.Tensor         # [g, capacity] long: pool rows per token; KV: K (row 0) and V (row 1),
                                # hidden: the m rows holding the token's layer input
    capacity: int               # tokens the block table can hold
    sampling: SamplingSpec
    cache_type: CacheType = CacheType.KV
    cpu: dict | None = None     # token index -> its K/V [2, layers, kv_heads, head_dim], checkpointed
    host: torch.Tensor | Int8Rows | None = None   # swapped out whole: its rows in the host pool
    counts: TokenCounts | None = None   # a penalized request's token counts, from its first sample
    matcher: object | None = None       # a constrained request's grammar matcher, from its first sample
    adapter: Adapter | None = None      # the LoRA adapter it runs with

    def clear_cache(self, rows_per_token: int = 2) -> None:
        self.num_computed = self.capacity = 0
        self.slots = torch.empty(rows_per_token, 0, dtype=torch.long)
        self.cpu = {}
        self.host = None


def block_offsets(block_size: int, direction: Direction) -> torch.Tensor:
    """Physical offset of a block's logical offsets 0..B-1 (see engine.attention)."""
    offs = torch.arange(block_size)
    return offs if direction is Direction.LEFT else offs.flip(0)


def _cuda_pickler():
    """multiprocessing's pickler with torch's reducers registered (importing torch.multiprocessing
    registers them): a CUDA tensor pickles as a CUDA IPC handle to its memory, and unpickling
    the handle in another process opens that memory there."""
    import torch.multiprocessing  # noqa: F401
    from multiprocessing.reduction import ForkingPickler
    return ForkingPickler


class ModelRunner:
    def __init__(self, model: torch.nn.Module, spec: ModelSpec, pool: torch.Tensor | QuantPool,
                 block_size: int, kernel: object | None = None, triton: bool = False,
                 tokenizer_file: str | None = None):
        self.kernel = kernel             # compiled CPU decode attention, None = torch path
        self.triton = triton             # attention by the Triton kernels (engine.triton_attention)
        self.cuda_ipc = False            # export GPU caches as CUDA IPC handles (worker processes)
        self._exported: dict[str, torch.Tensor] = {}   # GPU copies whose handles are out
        self.device = pool.device        # step metadata is built on the CPU and moved here once
        self.copier = HostCopier(self.device)   # copies into host memory (swap-outs on a side stream)
        self.model = model
        self.spec = spec
        self.pool = pool                 # [layers, kv_heads, num_blocks * block_size, head_dim]
        self.int8 = isinstance(pool, QuantPool)   # resident int8 (engine.quantpool)
        self.block_size = block_size
        # a hidden-cache token takes m = d_model / unit pool rows; 0: not possible for this model
        self.hidden_rows = spec.d_model // spec.unit if spec.d_model % spec.unit == 0 else 0
        self.reqs: dict[str, ReqState] = {}
        self.adapters: dict[LoraRef, Adapter] = {}   # LoRA adapters, as StepInput.adapters sent them
        self.tokenizer_file = tokenizer_file   # what structured outputs read tokens by (engine.grammar)
        L, H, _, D = pool.shape
        self.int8_block_bytes = int8_block_bytes(L, H, D, block_size)
        # bytes of one resident block over all layers
        self.block_bytes = self.int8_block_bytes if self.int8 else L * H * D * block_size * pool.element_size()

    # ---- state mirroring -------------------------------------------------
    def _rows_per_token(self, cache_type: CacheType) -> int:
        if cache_type is CacheType.KV:
            return 2
        if not self.hidden_rows:
            raise ValueError(f"hidden cache: d_model {self.spec.d_model} is not a multiple of "
                             f"num_kv_heads * head_dim = {self.spec.unit}")
        return self.hidden_rows

    def _add(self, nr: NewRequest) -> None:
        g = self._rows_per_token(nr.cache_type)
        st = ReqState(list(nr.token_ids), nr.num_prompt_tokens, 0, None, 0, nr.sampling, nr.cache_type)
        st.clear_cache(g)
        if nr.lora is not None:
            if nr.lora not in self.adapters:
                raise RuntimeError(f"request {nr.req_id}: LoRA adapter {nr.lora.name!r} was never sent")
            st.adapter = self.adapters[nr.lora]
        self.reqs[nr.req_id] = st

    def _take_adapters(self, inp: StepInput) -> None:
        """Keep the adapters sent (on this device, in the pool's dtype), forget those dropped."""
        for ref in inp.drop_adapters:
            self.adapters.pop(ref, None)
        for aw in inp.adapters:
            self.adapters[aw.ref] = Adapter(aw.ref, {key: u.to(self.device, self.pool.dtype)
                                                     for key, u in aw.weights.items()})

    def _append_blocks(self, st: ReqState, block_ids: list[int], dirs: list[Direction]) -> None:
        """Blocks arrive in groups of g per block_size tokens: (K, V) pairs for a KV cache,
        the m blocks of a token's layer input for a hidden cache."""
        g = st.slots.shape[0]
        if len(block_ids) % g:
            raise ValueError(f"{st.cache_type.value} blocks must come in groups of {g}")
        if not block_ids:
            return
        B = self.block_size
        rows = [[] for _ in range(g)]
        for i in range(0, len(block_ids), g):
            group, gdirs = block_ids[i:i + g], dirs[i:i + g]
            if any(d is not gdirs[0] for d in gdirs):
                raise ValueError("a token-block's blocks must share a direction")
            offs = block_offsets(B, gdirs[0])
            for j, b in enumerate(group):
                rows[j].append(b * B + offs)
        new = torch.stack([torch.cat(r) for r in rows])
        st.slots = torch.cat([st.slots, new], dim=1)
        st.capacity += new.shape[1]

    def _append_slots(self, st: ReqState, slots: list[tuple[int, int]]) -> None:
        """Bidirectional pools: explicit (token-block, physical slot) per new token."""
        if slots and st.cache_type is not CacheType.KV:
            raise ValueError("bidirectional blocks hold KV caches only")
        if slots:
            st.slots = torch.cat([st.slots, self._rows(slots)], dim=1)
            st.capacity += len(slots)

    def _rows(self, slots) -> torch.Tensor:
        """[2, n] pool rows of K and V for (token-block, slot) pairs: blocks 2t and 2t+1."""
        t = torch.tensor(slots, dtype=torch.long).view(-1, 2)
        B = self.block_size
        return torch.stack([2 * t[:, 0] * B + t[:, 1], (2 * t[:, 0] + 1) * B + t[:, 1]])

    def _move_slots(self, inp: StepInput) -> None:
        """Checkpoint slots to the CPU store, then swap stored tokens into their new slots."""
        if self.int8 and (inp.checkpoints or inp.swap_ins):
            raise RuntimeError("bidirectional blocks' slot copies need a full-precision pool")
        if inp.checkpoints:
            rows = self._rows([(c.block, c.slot) for c in inp.checkpoints]).to(self.device)
            k = self.copier.to_host(self.pool[:, :, rows[0], :])     # [layers, kv_heads, n, head_dim]
            v = self.copier.to_host(self.pool[:, :, rows[1], :])
            for j, c in enumerate(inp.checkpoints):
                self.reqs[c.req_id].cpu[c.token] = torch.stack([k[:, :, j], v[:, :, j]])
        if inp.swap_ins:
            rows = self._rows([(c.block, c.slot) for c in inp.swap_ins])
            kv = torch.stack([self.reqs[c.req_id].cpu.pop(c.token) for c in inp.swap_ins], dim=3)
            dev_rows = rows.to(self.device)
            self.pool[:, :, dev_rows[0], :] = kv[0].to(self.device, self.pool.dtype)
            self.pool[:, :, dev_rows[1], :] = kv[1].to(self.device, self.pool.dtype)
            for j, c in enumerate(inp.swap_ins):
                self.reqs[c.req_id].slots[:, c.token] = rows[:, j]

    # ---- swapping to the host pool ---------------------------------------------------------
    def _offload(self, off: Offload) -> None:
        """Copy the request's first ``num_tokens`` tokens' rows to the host pool (int8 when asked)
        and forget its blocks; its token ids stay."""
        st = self.reqs[off.req_id]
        g = st.slots.shape[0]
        rows = self._device_rows(off.req_id, st, off.num_tokens)
        self._drop_cache(st)
        # an int8 pool's closed blocks come out exactly as they went in, so they stay compressed;
        # compressed where the rows are, so a GPU sends a quarter of the bytes over the link.
        # A GPU's copy runs on a side stream while the next steps go on (engine.hostcopy).
        out = lambda t: self.copier.to_host(t, wait=False)  # noqa: E731
        if off.int8 or self.int8:
            q = quantize(rows, g, self.block_size)
            st.host = Int8Rows(out(q.q), out(q.scale), out(q.low), q.num_tokens, q.dtype)
        else:
            st.host = out(rows)

    def _upload(self, rid: str) -> None:
        """Write a swapped request's rows back into the blocks appended to it in this step."""
        st = self.reqs[rid]
        if st.host is None:
            raise RuntimeError(f"request {rid}: nothing of it is in the host pool")
        rows, st.host = st.host, None
        self.copier.fence()
        if isinstance(rows, Int8Rows):
            dev = self.device
            rows = dequantize(Int8Rows(rows.q.to(dev, non_blocking=True), rows.scale.to(dev, non_blocking=True),
                                       rows.low.to(dev, non_blocking=True), rows.num_tokens, rows.dtype))
        self._write_rows(rid, st, rows.shape[2] // st.slots.shape[0], rows)

    def _gather(self, rid: str, st: ReqState, n: int) -> torch.Tensor:
        """The rows of the request's first n tokens, [layers, kv_heads, g * n, head_dim] on the
        host (row-major by kind: all K rows, then all V rows)."""
        return self.copier.to_host(self._device_rows(rid, st, n))

    def _device_rows(self, rid: str, st: ReqState, n: int) -> torch.Tensor:
        """``_gather``'s rows where the pool is."""
        if st.cpu:
            raise RuntimeError(f"request {rid}: tokens checkpointed on the CPU cannot be copied out")
        if n > st.num_computed:
            raise RuntimeError(f"request {rid}: {n} tokens asked for, {st.num_computed} computed")
        rows = st.slots[:, :n].reshape(-1).to(self.device)
        return self.pool.read(rows) if self.int8 else self.pool[:, :, rows, :]

    def _write_rows(self, rid: str, st: ReqState, n: int, src: torch.Tensor) -> None:
        """Write rows in ``_gather``'s layout into the request's first n tokens' slots; it then
        holds n computed tokens."""
        self._check(rid, st, n)
        rows = st.slots[:, :n].reshape(-1)
        if tuple(src.shape) != (self.pool.shape[0], self.pool.shape[1], rows.numel(), self.pool.shape[3]):
            raise RuntimeError(f"request {rid}: cache of shape {tuple(src.shape)} does not fill "
                               f"{rows.numel()} rows of this pool")
        if self.int8:
            self._prepare_writes([(st, 0, n)])
            self.pool.write(rows.to(self.device), src)
        else:
            self.pool[:, :, rows.to(self.device), :] = src.to(self.device, self.pool.dtype)
        st.num_computed = n

    def _apply_bookkeeping(self, inp: StepInput) -> None:
        for rid in inp.finished_ids:
            self._exported.pop(rid, None)
            st = self.reqs.pop(rid, None)
            if st is not None:
                self._drop_cache(st)
        for rid in inp.reset_ids:
            self._drop_cache(self.reqs[rid])
        for nr in inp.new_requests:
            self._add(nr)

    def _from_cached(self, rid: str, st: ReqState, n: int) -> None:
        """The request's first n tokens are a cached prefix: the blocks it was just given hold
        their K/V (full blocks another request computed, closed in an int8 pool); it goes on
        from token n."""
        if st.num_computed or st.cache_type is not CacheType.KV or n % self.block_size:
            raise RuntimeError(f"request {rid}: a cached prefix of {n} tokens cannot start it")
        self._check(rid, st, n)
        st.num_computed = n

    # ---- the int8 pool's open blocks ---------------------------------------------------------
    def _drop_cache(self, st: ReqState) -> None:
        """Forget a request's cache; an int8 pool frees the staging of its blocks not yet full."""
        if self.int8:
            B = self.block_size
            self.pool.release(self._blocks(st, st.num_computed // B, -(-st.capacity // B)).to(self.device))
        st.clear_cache(st.slots.shape[0])

    def _blocks(self, st: ReqState, first: int, last: int) -> torch.Tensor:
        """Physical blocks of the request's token-blocks [first, last)."""
        B = self.block_size
        return st.slots[:, first * B:last * B:B].reshape(-1) // B

    def _full_blocks(self, st: ReqState, old: int, new: int) -> torch.Tensor:
        """Physical blocks of the token-blocks that tokens [old, new) completed."""
        return self._blocks(st, old // self.block_size, new // self.block_size)

    def _prepare_writes(self, spans: list[tuple[ReqState, int, int]]) -> None:
        """Before tokens [old, new) of each request are written: the token-blocks they fill whole
        are compressed as written (any stale staging of theirs dropped); the one or two they fill
        in part get a staging slot."""
        B, whole, part = self.block_size, [], []
        for st, old, new in spans:
            lo, hi = -(-old // B), new // B              # token-blocks written whole: [lo, hi)
            whole.append(self._blocks(st, lo, hi))
            if old % B:
                part.append(self._blocks(st, old // B, old // B + 1))
            if new % B and new // B >= lo:
                part.append(self._blocks(st, new // B, new // B + 1))
        if whole:
            self.pool.release(torch.cat(whole).to(self.device))
        if part:
            self.pool.open(torch.cat(part).to(self.device))

    # ---- migration -----------------------------------------------------------
    def export_cache(self, rid: str) -> torch.Tensor | DeviceRows:
        """A copy of the request's computed cache rows, [layers, kv_heads, g * n, head_dim] (g rows
        per token, row-major by kind: all K rows, then all V rows). On the CPU it is placed in
        shared memory, so the pipe passes a handle, not the bytes. A GPU worker process keeps its
        copy on the GPU and exports a CUDA IPC handle to it (DeviceRows), held until the
        request's blocks here are freed (the destination has confirmed); in one process (tests,
        profiling) a CUDA copy is staged on the host instead."""
        st = self.reqs[rid]
        if self.device.type == "cuda" and self.cuda_ipc:
            rows = self._device_rows(rid, st, st.num_computed).contiguous()
            self._exported[rid] = rows
            return DeviceRows(bytes(_cuda_pickler().dumps(rows)), rows.nbytes)
        return self._gather(rid, st, st.num_computed).share_memory_()

    def _import(self, imp: CacheImport) -> None:
        """Write an exported cache into the blocks reserved for it; the request's state now holds
        ``num_tokens`` computed tokens."""
        st = self.reqs[imp.req_id]
        if st.capacity or st.num_computed:
            raise RuntimeError(f"request {imp.req_id}: imported into a request that holds a cache")
        self._append_blocks(st, imp.block_ids, imp.directions)
        rows = imp.rows
        if isinstance(rows, DeviceRows):      # the source GPU's copy, opened here: a device-to-device copy
            rows = _cuda_pickler().loads(rows.handle)
        self._write_rows(imp.req_id, st, imp.num_tokens, rows)

    def products(self) -> tuple[tuple[int, float], ...]:
        """(rows, seconds) of the products every token row of a step takes, at rows about the
        model's thin-product threshold (engine.linear.product_seconds); () where it has none, whose
        products take one path at every row count."""
        thin = thin_rows_of(self.model)
        return product_seconds(row_projections(self.model), threshold_rows(thin)) if thin else ()

    # ---- one step ----------------------------------------------------------
    def step(self, inp: StepInput) -> StepOutput:
        if inp.command is Command.RESET:
            self.reqs.clear()
            self._exported.clear()
            if self.int8:
                self.pool.release(torch.arange(self.pool.num_blocks, device=self.device))
            return StepOutput(inp.step_id, {}, 0, 0.0, 0.0)
        if inp.command is Command.PRODUCTS:
            return StepOutput(inp.step_id, {}, 0, 0.0, 0.0, products=self.products())
        self._take_adapters(inp)
        self._apply_bookkeeping(inp)
        for off in inp.offloads:
            self._offload(off)
        for imp in inp.imports:
            self._import(imp)
        exported = {rid: self.export_cache(rid) for rid in inp.exports}
        self._move_slots(inp)
        if not inp.scheduled:
            return StepOutput(inp.step_id, {}, 0, 0.0, 0.0, exported=exported)
        t0 = time.perf_counter()
        prefills = [s for s in inp.scheduled if s.phase is Phase.PREFILL]
        decodes = [s for s in inp.scheduled if s.phase is Phase.DECODE]
        if self.adapters:              # each adapter's requests side by side: its rows are one slice
            prefills, decodes = self._by_adapter(prefills), self._by_adapter(decodes)
        for s in inp.scheduled:
            self._append_blocks(self.reqs[s.req_id], s.new_block_ids, s.new_directions)
            self._append_slots(self.reqs[s.req_id], s.new_slots)
            if s.num_cached:
                self._from_cached(s.req_id, self.reqs[s.req_id], s.num_cached)
        for rid in inp.uploads:
            self._upload(rid)
        if self.int8:
            sts = [self.reqs[s.req_id] for s in inp.scheduled]
            self._prepare_writes([(st, st.num_computed, st.num_computed + s.num_new_tokens)
                                  for st, s in zip(sts, inp.scheduled)])
        ids, pos, batch, rows, samplers, scored, lora = self._build(prefills, decodes)
        specs = [self.reqs[r].sampling for r in samplers]
        ngen = [len(self.reqs[r].token_ids) - self.reqs[r].num_prompt for r in samplers]
        with torch.inference_mode():
            logits = (self.model(ids, pos, self.pool, batch, rows) if lora is None      # sampled where it lies
                      else self.model(ids, pos, self.pool, batch, rows, lora))
            allowed = self._allowed(samplers)      # grammar masks on the CPU while a GPU runs the forward
            prompt_lps = self._prompt_logprobs(logits[len(samplers):], scored)
            logits = logits[:len(samplers)]
            if self.device.type == "cuda":      # the forward's time, not its launch's (nor a swap-out's copy)
                torch.cuda.current_stream(self.device).synchronize()
            t1 = time.perf_counter()
            lp_rows, lp = log_probs(logits, specs, allowed)
            counts = [self._counts(self.reqs[r], logits) for r in samplers]
            tokens = sample(logits, specs, ngen, counts, allowed, [self._recent(self.reqs[r]) for r in samplers])
            by_row = token_logprobs(lp_rows, lp, specs, tokens)
        full = []
        for s in inp.scheduled:
            st = self.reqs[s.req_id]
            if self.int8:
                full.append(self._full_blocks(st, st.num_computed, st.num_computed + s.num_new_tokens))
            st.num_computed += s.num_new_tokens
        if full:
            self.pool.close(torch.cat(full).to(self.device))
        sampled = {}
        for rid, tok in zip(samplers, tokens):
            st = self.reqs[rid]
            st.token_ids.append(tok)
            if st.counts is not None:
                st.counts.add(tok)
            if st.matcher is not None:
                st.matcher.consume_token(tok)
            sampled[rid] = tok
        return StepOutput(inp.step_id, sampled, int(ids.shape[0]), t1 - t0, time.perf_counter() - t1,
                          exported=exported, logprobs={samplers[r]: v for r, v in by_row.items()},
                          prompt_logprobs=prompt_lps)

    @staticmethod
    def _counts(st: ReqState, logits: torch.Tensor) -> TokenCounts | None:
        """A penalized request's TokenCounts, counted from its tokens at its first sample and kept
        up to date after; None for a request without penalties."""
        if st.counts is None and st.sampling.penalized:
            st.counts = TokenCounts.of(st.token_ids, st.num_prompt, logits.shape[-1], logits.device)
        return st.counts

    @staticmethod
    def _recent(st: ReqState) -> list[int] | None:
        """A request with bad words: its last output tokens, as many as its longest word has
        before its last token (the sampler compares them with each word's start)."""
        if not st.sampling.bad_words:
            return None
        span = max(map(len, st.sampling.bad_words)) - 1
        return st.token_ids[max(st.num_prompt, len(st.token_ids) - span):]

    def _allowed(self, samplers: list[str]) -> tuple[list[int], torch.Tensor] | None:
        """The rows sampled under a grammar and the tokens each may take next."""
        rows = [i for i, rid in enumerate(samplers) if self.reqs[rid].sampling.grammar]
        if not rows:
            return None
        return rows, self.vocabulary.allowed([self._matcher(self.reqs[samplers[i]]) for i in rows])

    def _matcher(self, st: ReqState):
        """A constrained request's grammar matcher, built at its first sample here from its output
        so far (a request moved from another device goes on where it was) and kept after."""
        if st.matcher is None:
            st.matcher = self.vocabulary.matcher(st.sampling.grammar, st.token_ids[st.num_prompt:])
        return st.matcher

    @functools.cached_property
    def vocabulary(self) -> Vocabulary:
        """The tokenizer as structured outputs read it, built at the first constrained request."""
        if self.tokenizer_file is None:
            raise ValueError("structured outputs: this worker was given no tokenizer")
        return Vocabulary(Path(self.tokenizer_file).read_text(encoding="utf-8"), self.spec.vocab_size,
                          self.spec.eos_token_ids)

    def _prompt_logprobs(self, logits: torch.Tensor, scored) -> dict:
        """req_id -> (p, the TokenLogprobs of its prompt tokens p, p+1, ...) from the logits of the
        rows that score them (``_build``'s ``scored``, in order)."""
        if not scored:
            return {}
        chosen, ks = [], []
        for rid, first, n in scored:
            st = self.reqs[rid]
            chosen += st.token_ids[first:first + n]
            ks += [st.sampling.prompt_logprobs] * n
        picked = pick_logprobs(torch.log_softmax(logits.float(), dim=-1), chosen, ks)
        out, at = {}, 0
        for rid, first, n in scored:
            out[rid] = (first, picked[at:at + n])
            at += n
        return out

    def _scored_rows(self, s, st: ReqState, row: int, a: int, b: int, scored: list) -> list[int]:
        """Rows of a prefill chunk [a, b) starting at ``row`` whose logits score prompt tokens
        a+1, ... (for prompt log probabilities): the row of position p scores token p + 1, up to
        the prompt's last token (its own row samples the first output token)."""
        n = min(b, st.num_prompt - 1) - a
        if st.sampling.prompt_logprobs < 0 or n <= 0:
            return []
        scored.append((s.req_id, a + 1, n))
        return list(range(row, row + n))

    def _build(self, prefills, decodes):
        """Token ids, positions, attention metadata and logit rows for one step (rows: the
        sampled ones of KV prefills, KV decodes, hidden-cache prefills and decodes; then the
        prompt-scoring ones, as ``scored`` lists them), and the rows that run with adapters."""
        hidden = [s for s in prefills + decodes if self.reqs[s.req_id].cache_type is CacheType.HIDDEN]
        if hidden:
            prefills = [s for s in prefills if self.reqs[s.req_id].cache_type is CacheType.KV]
            decodes = [s for s in decodes if self.reqs[s.req_id].cache_type is CacheType.KV]
        ids, pos, k_w, v_w, segs, rows, samplers, scored, extra = [], [], [], [], [], [], [], [], []
        row = 0
        for s in prefills:
            st, a, b = self._take(s, ids, pos)
            extra += self._scored_rows(s, st, row, a, b, scored)
            k_w.append(st.slots[0, a:b])
            v_w.append(st.slots[1, a:b])
            ctx = (st.slots[0, :a], st.slots[1, :a]) if a > 0 else (None, None)
            segs.append(PrefillSegment(row, row + b - a, *ctx, self._paged(st, a, b)))
            row += b - a
            if s.sample:
                rows.append(row - 1)
                samplers.append(s.req_id)
        decode_start = row
        dec = self._decode_meta(decodes, ids, pos, k_w, v_w) if decodes else (None, None, None)
        for s in decodes:
            rows.append(row)
            samplers.append(s.req_id)
            row += 1
        dev = self.device
        to = (lambda t: t if t is None or dev.type == "cpu" else t.to(dev, non_blocking=True))  # noqa: E731
        hb = self._hidden_meta(hidden, row, ids, pos, rows, samplers, scored, extra) if hidden else None
        empty = torch.empty(0, dtype=torch.long)
        slots = (to(torch.cat(k_w) if k_w else empty), to(torch.cat(v_w) if v_w else empty))
        parts = (prefills, hidden, decode_start, to)
        w, full = self.spec.sliding_window, self.spec.full_layers
        batch = self._assemble(slots, segs, dec, hb, parts) if not w or full else None
        if w:
            windowed = self._assemble(slots, *window_cut(segs, dec, hb, w), parts, w)
            if batch is None:
                batch = windowed
            else:
                batch.windowed = windowed
        return (to(torch.tensor(ids, dtype=torch.long)), to(torch.cat(pos)), batch,
                to(torch.tensor(rows + extra, dtype=torch.long)), samplers, scored,
                self._step_lora(prefills + decodes + hidden))

    def _paged(self, st, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """A chunk of tokens a..b-1 over a cached prefix as the compiled kernel takes it, each token
        a query over its context (``PrefillSegment.paged``); None where the torch path serves it:
        no prefix, a chunk too large (``PAGED_PREFILL_PAIRS``), no compiled kernel, an int8 pool,
        the Triton kernels."""
        n = b - a
        if a == 0 or n * b > PAGED_PREFILL_PAIRS or self.kernel is None or self.int8 or self.triton:
            return None
        return (st.slots[0, :b].expand(n, b).contiguous(), st.slots[1, :b].expand(n, b).contiguous(),
                torch.arange(a + 1, b + 1, dtype=torch.long))

    def _by_adapter(self, scheduled: list) -> list:
        """The requests in a stable order that puts those on the same adapter side by side."""
        def key(s) -> tuple[str, str]:
            a = self.reqs[s.req_id].adapter
            return ("", "") if a is None else (a.ref.name, a.ref.path)
        return sorted(scheduled, key=key)

    def _step_lora(self, order) -> StepLora | None:
        """The step's slices of rows that run with an adapter (the scheduled requests in their
        rows' order, each adapter's side by side); None when none has one."""
        if not self.adapters:            # no adapter on this device: nothing to look for
            return None
        groups: list[list] = []
        row = 0
        for s in order:
            adapter = self.reqs[s.req_id].adapter
            if adapter is not None:
                if groups and groups[-1][0] is adapter and groups[-1][2] == row:
                    groups[-1][2] += s.num_new_tokens
                else:
                    groups.append([adapter, row, row + s.num_new_tokens])
            row += s.num_new_tokens
        return StepLora([tuple(g) for g in groups]) if groups else None

    def _assemble(self, slots, segs, dec, hb, parts, window: int | None = None) -> AttnBatch:
        """One layout of a step's attention metadata, on the device: every context whole, or
        (``window``) cut to what a sliding window reaches."""
        prefills, hidden, decode_start, to = parts
        # rows the Triton kernels read through their own tables stay on the host
        dec_to = (lambda t: t) if self.triton else to  # noqa: E731
        ctx_to = dec_to if not self.int8 else to        # an int8 pool's prefills keep the torch path
        segs = [PrefillSegment(g.start, g.end, ctx_to(g.k_ctx), ctx_to(g.v_ctx), g.paged if window is None else None)
                for g in segs]
        if hb is not None:
            hb = HiddenBatch(hb.start, hb.m, to(hb.write_rows),
                             [HiddenSegment(g.start, g.end, to(g.ctx_rows), g.first, g.adapter) for g in hb.segs])
        batch = AttnBatch(*slots, segs, decode_start, *(dec_to(t) for t in dec), self.kernel, hb, window=window)
        if self.triton:
            batch.triton = self._triton_meta(prefills, dec, hidden, hb, to, window)
        return batch

    def _triton_meta(self, prefills, dec, hidden, hb: HiddenBatch | None, to, window: int | None) -> TritonMeta:
        """Tables for the Triton kernels (engine.triton_attention), built after ``_build``'s
        bookkeeping: the requests' computed counts are still those before this step."""
        B = self.block_size
        meta = TritonMeta(B, window=window or 0)
        if dec[0] is not None:
            meta.decode = tables([dec[0], dec[1]], dec[2], B, to)
            meta.decode_lens = to(dec[2])
        if prefills and not self.int8:
            sts = [self.reqs[s.req_id] for s in prefills]
            ctx = [st.num_computed + s.num_new_tokens for st, s in zip(sts, prefills)]
            lens = torch.tensor(ctx)
            meta.prefill = tables([row_table([st.slots[0, :c] for st, c in zip(sts, ctx)]),
                                   row_table([st.slots[1, :c] for st, c in zip(sts, ctx)])], lens, B, to)
            meta.seg_n = [s.num_new_tokens for s in prefills]
            meta.seg_start = [0] + list(itertools.accumulate(meta.seg_n))[:-1]
            meta.seg_ctx = ctx
        # the fused kernel projects with the base weights only: a request with an adapter takes the torch path
        single = ([i for i, s in enumerate(hidden) if s.num_new_tokens == 1 and self.reqs[s.req_id].adapter is None]
                  if hb is not None else [])
        # the kernel has no per-head norm of K, and numbers its context's positions from 0
        if single and not self.int8 and not self.spec.qk_norm and not window:
            sts = [self.reqs[hidden[i].req_id] for i in single]
            ctx = [st.num_computed + 1 for st in sts]
            lens = torch.tensor(ctx)
            meta.hidden = tables([row_table([st.slots[:, :c].T for st, c in zip(sts, ctx)])], lens, B, to)
            meta.hidden_segs, meta.hidden_lens = single, to(lens)
        return meta

    def _take(self, s, ids: list[int], pos: list[torch.Tensor]) -> tuple[ReqState, int, int]:
        """Append a scheduled request's new tokens [a, b) and their positions to the step."""
        st = self.reqs[s.req_id]
        a, b = st.num_computed, st.num_computed + s.num_new_tokens
        self._check(s.req_id, st, b)
        ids.extend(st.token_ids[a:b])
        pos.append(torch.arange(a, b))
        return st, a, b

    def _hidden_meta(self, hidden, row, ids, pos, rows, samplers, scored, extra) -> HiddenBatch:
        """Rows to store the new tokens' layer inputs and each request's context rows (on the host)."""
        start, write, segs = row, [], []
        for s in hidden:
            st, a, b = self._take(s, ids, pos)
            if s.phase is Phase.PREFILL:
                extra += self._scored_rows(s, st, row, a, b, scored)
            write.append(st.slots[:, a:b].T.reshape(-1))          # token-major: token i's m rows
            segs.append(HiddenSegment(row - start, row - start + b - a, st.slots[:, :b].T.reshape(-1),
                                      adapter=st.adapter))
            row += b - a
            if s.sample or s.phase is Phase.DECODE:
                rows.append(row - 1)
                samplers.append(s.req_id)
        return HiddenBatch(start, self.hidden_rows, torch.cat(write), segs)

    def _decode_meta(self, decodes, ids, pos, k_w, v_w):
        """Padded per-token K/V rows and context lengths of the decode requests."""
        sts = [self.reqs[s.req_id] for s in decodes]
        lens = []
        for s, st in zip(decodes, sts):
            self._check(s.req_id, st, st.num_computed + 1)
            ids.append(st.token_ids[st.num_computed])
            lens.append(st.num_computed + 1)
        lens_t = torch.tensor(lens)
        pos.append(lens_t - 1)
        k_rows = torch.nn.utils.rnn.pad_sequence([st.slots[0, :n] for st, n in zip(sts, lens)], batch_first=True)
        v_rows = torch.nn.utils.rnn.pad_sequence([st.slots[1, :n] for st, n in zip(sts, lens)], batch_first=True)
        last = lens_t - 1
        k_w.append(k_rows.gather(1, last[:, None]).view(-1))
        v_w.append(v_rows.gather(1, last[:, None]).view(-1))
        return k_rows, v_rows, lens_t

    @staticmethod
    def _check(rid: str, st: ReqState, need: int) -> None:
        if st.host is not None:
            raise RuntimeError(f"request {rid}: its cache is in the host pool, not uploaded")
        if st.cpu and min(st.cpu) < need:
            raise RuntimeError(f"request {rid}: token {min(st.cpu)} is checkpointed on the CPU, not swapped in")
        if need > st.capacity:
            raise RuntimeError(f"request {rid}: block table holds {st.capacity} tokens, step needs {need}")
        if need > len(st.token_ids):
            raise RuntimeError(f"request {rid}: step asks for {need} tokens, only {len(st.token_ids)} known")


def window_cut(segs: list[PrefillSegment], dec, hb: HiddenBatch | None, w: int):
    """A step's host-side attention metadata cut to a sliding window of ``w`` tokens: a query at
    position p attends to p - w + 1 .. p, so a prefill chunk whose first query sits at a keeps its
    prefix from a - w + 1 on, a decode at position n - 1 its last w rows, and a hidden-cache
    request its stored inputs from its first query's window on (``first`` numbering them)."""
    cut = []
    for g in segs:
        a = 0 if g.k_ctx is None else g.k_ctx.shape[0]
        lo = max(0, a - w + 1)
        cut.append(PrefillSegment(g.start, g.end, *((g.k_ctx[lo:], g.v_ctx[lo:]) if lo < a else (None, None))))
    if dec[0] is not None:
        k_rows, v_rows, lens = dec
        kept = lens.clamp(max=w)
        idx = ((lens - kept)[:, None] + torch.arange(int(kept.max()))[None, :]).clamp(max=k_rows.shape[1] - 1)
        dec = (k_rows.gather(1, idx), v_rows.gather(1, idx), kept)
    if hb is not None:
        hsegs = []
        for g in hb.segs:
            a = g.ctx_rows.shape[0] // hb.m - (g.end - g.start)
            lo = max(0, a - w + 1)
            hsegs.append(HiddenSegment(g.start, g.end, g.ctx_rows[lo * hb.m:], g.first + lo, g.adapter))
        hb = HiddenBatch(hb.start, hb.m, hb.write_rows, hsegs)
    return cut, dec, hb


def copy_bandwidth(nbytes: int = 32 << 20, repeats: int = 3) -> float:
    """Bytes per second a KV migration moves on this host, measured as it copies: rows gathered
    out of a pool-shaped tensor into shared memory, then scattered into another pool (best of
    ``repeats``; the start-up probe behind the rebalancer's link budget)."""
    rows = nbytes // (4 * 64)
    src = torch.randn(1, 1, 2 * rows, 64)
    dst = torch.empty_like(src)
    idx = torch.randperm(2 * rows)[:rows]
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        staged = src[:, :, idx, :].share_memory_()
        dst[:, :, idx, :] = staged
        best = min(best, time.perf_counter() - t0)
    return rows * 64 * 4 / best
