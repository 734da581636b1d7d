"""Batch jobs: validate the input file, run every line as a BE request, write OpenAI-format output.

States: validating -> in_progress -> finalizing -> completed, or failed (bad
input), cancelling -> cancelled, expired. The store records each line's result
as it completes; on start-up every active batch resumes where it stopped.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Awaitable, Callable, Iterator

import orjson

from tandem.sched.request import error_id
from tandem.server.errors import MAX_NESTING, ApiError, nests_deeper, out_of_storage, too_deep, when_stored
from tandem.server.store import NewFile, Store, result_file_id

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
WINDOWS = {"24h": 24 * 3600}
MAX_LINES = 50_000
MAX_ERRORS = 1_000           # a failed batch lists at most this many of its input's errors
PENDING_READ = 256           # pending lines read from the store at a time
MAX_LINE_ATTEMPTS = 3        # a line failing on the server's side (5xx, an exception) runs again
LINE_RETRY_S = 1.0           # times the attempt number, before the next attempt

log = logging.getLogger("tandem.batches")

# run_line(body, endpoint) -> (status_code, response body); BE class forced by the caller
RunLine = Callable[[dict, str], Awaitable[tuple[int, dict]]]


def result_files(rows: list[dict], final: str) -> tuple[bytes, bytes]:
    """A batch's output and error files (JSONL) from its recorded line results; a line that did
    not run lands in the error file with why (the batch was cancelled, or expired)."""
    out, errs = [], []
    reason = {"cancelled": ("batch_cancelled", "the batch was cancelled"),
              "expired": ("batch_expired", "the batch expired before this request ran")}.get(
                  final, ("not_run", "the request did not run"))
    for r in rows:
        rid = f"batch_req_{uuid.uuid4().hex[:24]}"
        if r["status"] == "pending":
            errs.append({"id": rid, "custom_id": r["custom_id"], "response": None,
                         "error": {"code": reason[0], "message": reason[1]}})
            continue
        body = json.loads(r["result"])
        line = {"id": rid, "custom_id": r["custom_id"],
                "response": {"status_code": r["status_code"], "request_id": body.get("id", rid),
                             "body": body}, "error": None}
        (out if r["status_code"] == 200 else errs).append(line)
    return _jsonl(out), _jsonl(errs)


def _jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(x) + "\n" for x in rows).encode()


def line_usage(code: int, body: dict) -> tuple[int, int, int, int]:
    """A line's tokens for its batch's usage: (in, of them cached, out, of them reasoning), from a
    chat's or completion's usage or a response's; a failed line used none."""
    u = body.get("usage") if code == 200 else None
    if not u:
        return 0, 0, 0, 0
    chat = "prompt_tokens" in u
    tokens_in, tokens_out = (u["prompt_tokens"], u["completion_tokens"]) if chat else (u["input_tokens"],
                                                                                      u["output_tokens"])
    cached = (u.get("prompt_tokens_details" if chat else "input_tokens_details") or {}).get("cached_tokens", 0)
    reasoning = (u.get("completion_tokens_details" if chat else "output_tokens_details") or {}).get(
        "reasoning_tokens", 0)
    return tokens_in, cached or 0, tokens_out, reasoning or 0


def validate_lines(raw: bytes, endpoint: str) -> tuple[list[tuple[int, str, dict]], list[dict]]:
    """Parse a JSONL batch input; errors name 1-based line numbers, as OpenAI's do (the first
    ``MAX_ERRORS``, then how many more). A line is JSON as a request body is (orjson, as the
    server reads bodies: no lone surrogates, NaN or integers past 64 bits), and a byte order
    mark before the first line is skipped."""
    lines, errors, seen = [], [], set()

    def err(n, msg, param=None):
        errors.append({"code": "invalid_request", "message": msg, "param": param, "line": n})
    try:
        text = raw.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError:
        return [], [{"code": "invalid_file", "message": "the input file is not UTF-8", "param": None,
                     "line": None}]
    # JSONL lines end at "\n" only: str.splitlines() would also cut at U+2028, U+0085 and the
    # like, which a JSON string may hold unescaped
    rows = [(i + 1, s) for i, s in enumerate(text.split("\n")) if s.strip()]
    if not rows:
        return [], [{"code": "empty_file", "message": "the input file has no requests", "param": None, "line": None}]
    if len(rows) > MAX_LINES:
        return [], [{"code": "too_many_requests", "message": f"at most {MAX_LINES} lines", "param": None,
                     "line": None}]
    for n, s in rows:
        try:
            obj = orjson.loads(s)
        except orjson.JSONDecodeError as e:
            err(n, f"line is not valid JSON: {e.msg}")
            continue
        if not isinstance(obj, dict):
            err(n, "line must be a JSON object")
            continue
        cid = obj.get("custom_id")
        if not isinstance(cid, str) or not cid:
            err(n, "custom_id must be a non-empty string", "custom_id")
        elif cid in seen:
            err(n, f"custom_id {cid!r} is used twice", "custom_id")
        if obj.get("method") != "POST":
            err(n, "method must be POST", "method")
        if obj.get("url") != endpoint:
            err(n, f"url must be the batch's endpoint {endpoint}", "url")
        if not isinstance(obj.get("body"), dict):
            err(n, "body must be an object", "body")
        elif obj["body"].get("stream"):
            err(n, "stream is not allowed in a batch", "body.stream")
        elif nests_deeper(obj["body"]):
            err(n, f"body nests deeper than {MAX_NESTING} levels", "body")
        if isinstance(cid, str) and cid:
            seen.add(cid)
            lines.append((n, cid, obj.get("body")))
    if len(errors) > MAX_ERRORS:
        more = len(errors) - MAX_ERRORS
        errors[MAX_ERRORS:] = [{"code": "too_many_errors", "message": f"{more} more errors are not listed",
                                "param": None, "line": None}]
    return lines, errors


class BatchRunner:
    """Runs every active batch. ``concurrency`` bounds the lines in flight across all batches
    together (what the scheduler can run at once): more would only wait in its queue."""

    def __init__(self, store: Store, run_line: RunLine, concurrency: int):
        self.store = store
        self.run_line = run_line
        self.concurrency = max(1, concurrency)
        self.tasks: dict[str, asyncio.Task] = {}
        self.running = 0            # lines whose request is in flight, over all batches
        self._slots: asyncio.Semaphore | None = None

    @property
    def slots(self) -> asyncio.Semaphore:
        if self._slots is None:              # made inside the running loop
            self._slots = asyncio.Semaphore(self.concurrency)
        return self._slots

    def resume_all(self) -> None:
        for bid in self.store.active_batches():
            self.start(bid)

    def start(self, bid: str) -> None:
        self.tasks[bid] = asyncio.get_running_loop().create_task(self._run(bid))

    def cancel(self, bid: str) -> dict:
        b = self.store.get_batch(bid)
        if b["status"] in ("validating", "in_progress"):
            self.store.set_status(bid, "cancelling")
        return self.store.get_batch(bid)

    async def stop(self) -> None:
        """Stop running lines; the pending ones stay pending in the store (resumed on restart)."""
        for t in self.tasks.values():
            t.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)

    async def _run(self, bid: str) -> None:
        """Run a batch to its end; a bug on the way fails the batch (with an error id in the log)
        instead of leaving it active for ever. A full disk does not: the batch waits and goes on
        from what the store holds (a line whose result could not be kept runs again), so a full
        data dir delays a batch and loses none of it."""
        try:
            await when_stored(lambda: self._steps(bid), f"batch {bid}", log)
        except asyncio.CancelledError:
            raise
        except Exception:                    # noqa: BLE001 -- the batch must reach a final state
            eid = error_id()
            log.exception("batch %s failed (%s)", bid, eid)
            self._fail(bid, [{"code": "server_error", "message": f"internal error (error id {eid})",
                              "param": None, "line": None}])
        finally:
            self.tasks.pop(bid, None)

    async def _steps(self, bid: str) -> None:
        b = self.store.get_batch(bid)
        if self.store.needs_lines(bid):     # validating, or cancelled meanwhile and stopped before its lines were in
            raw = self.store.input_bytes(bid)
            if raw is None and b["status"] == "validating":
                return self._fail(bid, [{"code": "file_not_found", "message": "input file was deleted",
                                         "param": "input_file_id", "line": None}])
            if raw is not None:
                # off the event loop: parsing 50,000 lines would stall every stream meanwhile
                lines, errors = await asyncio.to_thread(validate_lines, raw, b["endpoint"])
                if errors:
                    return self._fail(bid, errors)
                await asyncio.to_thread(self.store.add_lines, bid, lines)
                log.info("batch %s: %d lines to %s", bid, len(lines), b["endpoint"])
        expired = False
        if self.store.status(bid) == "in_progress":
            expired = await self._run_lines(bid, b["endpoint"], b["expires_at"])
        status = self.store.status(bid)
        if status == "cancelling":
            await self._finalize(bid, "cancelled")
        elif expired:                 # "expired" is written with its files: a stop in between resumes
            await self._finalize(bid, "expired")
        elif status in ("in_progress", "finalizing"):
            self.store.set_status(bid, "finalizing")
            await self._finalize(bid, "completed")

    async def _run_lines(self, bid: str, endpoint: str, expires_at: int) -> bool:
        """Run the pending lines until all are done, the batch is cancelled or it expires (True).
        Lines still running then, or when this task is cancelled (the server stops), are aborted;
        a batch already past its window starts none.

        ``concurrency`` workers take the lines in order, each holding one of the slots all
        batches share while its line runs. A worker queues for a slot again after each line, so
        batches running together take turns (a long batch does not hold up a short one until it
        ends), and a batch of 50,000 lines is read from the store a few hundred at a time."""
        if time.time() > expires_at:  # resumed (a restart, a full data dir) past its window: run nothing
            return next(self._pending(bid), None) is not None      # every line done: it completes
        stop, expired = asyncio.Event(), False
        lines = self._pending(bid)

        async def worker() -> None:
            while not stop.is_set():
                async with self.slots:
                    line = None if stop.is_set() else next(lines, None)
                    if line is None:
                        return
                    self.running += 1
                    try:
                        code, resp = await self._attempts(bid, line[0], line[2], endpoint)
                    finally:
                        self.running -= 1
                    self.store.finish_line(bid, line[0], code, resp, line_usage(code, resp))

        async def watch() -> None:
            nonlocal expired
            while not stop.is_set():
                await asyncio.sleep(0.5)
                if self.store.status(bid) == "cancelling":
                    stop.set()
                elif time.time() > expires_at:
                    expired = True
                    stop.set()

        watcher = asyncio.create_task(watch())
        jobs = [asyncio.create_task(worker()) for _ in range(self.concurrency)]
        try:
            while jobs and not stop.is_set():
                done, _ = await asyncio.wait(jobs + [watcher], return_when=asyncio.FIRST_COMPLETED)
                for j in done - {watcher}:
                    j.result()            # a worker's bug fails the batch (``_run``)
                jobs = [j for j in jobs if not j.done()]
        finally:
            stop.set()
            watcher.cancel()
            for j in jobs:            # cancelled, expired or stopping: in-flight requests are aborted
                j.cancel()
            await asyncio.gather(*jobs, return_exceptions=True)
        return expired

    def _pending(self, bid: str) -> Iterator[tuple[int, str, dict]]:
        """The batch's pending lines in order, read ``PENDING_READ`` at a time."""
        after = -1
        while chunk := self.store.pending_lines(bid, after, PENDING_READ):
            yield from chunk
            after = chunk[-1][0]

    async def _attempts(self, bid: str, line_no: int, body: dict, endpoint: str) -> tuple[int, dict]:
        """Run one line. A client error (4xx) is its result at once; a failure on the server's
        side is tried again, and only the last of MAX_LINE_ATTEMPTS becomes the line's error."""
        for attempt in range(1, MAX_LINE_ATTEMPTS + 1):
            try:
                return await self.run_line(body, endpoint)
            except ApiError as e:
                if e.status < 500:
                    return e.status, e.body()
                code, resp = e.status, e.body()
            except RecursionError:
                return 400, too_deep().body()
            except Exception as e:           # noqa: BLE001 -- never lose a line to a bug
                if out_of_storage(e):        # not the line's: the batch waits for room (``_run``)
                    raise
                eid = error_id()
                log.exception("batch %s line %d failed (%s)", bid, line_no, eid)
                code, resp = 500, ApiError(500, f"internal error (error id {eid})", type="server_error").body()
            if attempt < MAX_LINE_ATTEMPTS:
                log.warning("batch %s line %d: attempt %d failed (%d), retrying", bid, line_no, attempt, code)
                await asyncio.sleep(LINE_RETRY_S * attempt)
        return code, resp

    def _fail(self, bid: str, errors: list[dict]) -> None:
        self.store.fail_batch(bid, errors)
        log.info("batch %s failed: %s", bid, errors[0]["message"] + (f" (and {len(errors) - 1} more errors)"
                                                                        if len(errors) > 1 else ""))

    async def _finalize(self, bid: str, final: str) -> None:
        """Write the output and error files from the recorded results, then the final status.
        The files are built and written off the event loop (50,000 lines take over a second)."""
        out, errs = await asyncio.to_thread(lambda: result_files(self.store.line_results(bid), final))
        files, keep_s = [], self.store.output_expiry(bid)
        for data, kind in ((out, "output"), (errs, "error")):
            f = None
            if data:        # its id is the batch's: a finalize run again after a stop rewrites the same bytes
                f = NewFile(result_file_id(bid, kind), len(data), f"{bid}_{kind}.jsonl", "batch_output", keep_s)
                await asyncio.to_thread(self.store.write_blob, f.id, data)
            files.append(f)
        await asyncio.to_thread(self.store.end_batch, bid, final, *files)
        b = self.store.get_batch(bid)
        c = b["request_counts"]
        log.info("batch %s %s: %d of %d lines completed, %d failed, in %.0f s", bid, final, c["completed"],
                 c["total"], c["failed"], time.time() - b["created_at"])
