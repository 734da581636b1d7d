"""A log of every model step, one JSON line each (``python -m server --step-log``,
``LLM.log_steps``): what the step computed for which class, how long it took, and what the cost
model had priced it at. ``python -m bench steps`` reads it: where a device's time goes, and how
well the iterations a policy sized to a deadline kept it."""
from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import asdict, dataclass

from tandem.sched.cost_model import StepShape

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StepRecord:
    t: float                     # the clock when the step's results came back (seconds, monotonic)
    device: str
    seconds: float               # from its planning to its results (what the cost model learns from)
    predicted: float | None      # the cost model's price of its shape before this step refined it
    rt_decodes: int              # requests that decoded one token, by class
    be_decodes: int
    rt_prompt_tokens: int        # prompt (or recomputed) tokens, by class
    be_prompt_tokens: int
    prompt_chunks: int           # requests whose prompt tokens it computed
    chunk_context: int           # the longest context a prompt chunk reached (tokens, 0: none)
    shape: StepShape

    def to_json(self) -> str:
        return json.dumps(asdict(self))          # the shape as a dict of its own

    @classmethod
    def from_dict(cls, d: dict) -> "StepRecord":
        return cls(**{**d, "shape": StepShape(**d["shape"])})


class StepLog:
    """Appends records to a file, a line each as it comes (the actors of several devices share
    one log: each line names its device). A line a killed server left cut short is ended
    first, so the records after it stay whole. A write that fails (a full disk) closes the log
    and says so once: a diagnostic never stops a step."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        with open(self.path, "ab+") as f:
            if f.seek(0, os.SEEK_END) and (f.seek(-1, os.SEEK_END), f.read(1))[1] != b"\n":
                f.write(b"\n")
        self._file = open(self.path, "a", buffering=1, encoding="utf-8")
        self._lock = threading.Lock()

    def write(self, record: StepRecord) -> None:
        line = record.to_json() + "\n"
        with self._lock:
            if self._file.closed:
                return
            try:
                self._file.write(line)
            except OSError as e:
                log.warning("step log %s: %s; no more steps are written to it", self.path, e)
                self._close()

    @property
    def closed(self) -> bool:
        return self._file.closed

    def close(self) -> None:
        with self._lock:
            self._close()

    def _close(self) -> None:
        try:
            self._file.close()
        except OSError:          # what is still buffered cannot be written either
            pass


def read_steps(path: str | os.PathLike) -> list[StepRecord]:
    """The records of a step log. A line cut short (a server killed mid-write; the next server
    logging to the file ends it) is left out; a whole line that is not a record is refused, as
    is a file of which no line reads."""
    out, cut = [], 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                d = json.loads(line)
            except ValueError:
                cut += 1
                continue
            try:
                out.append(StepRecord.from_dict(d))
            except (TypeError, KeyError):
                raise ValueError(f"{path}: not a step log line: {line[:80]!r}") from None
    if cut and not out:
        raise ValueError(f"{path}: not a step log (no line reads as one)")
    return out
