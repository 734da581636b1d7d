"""A log of every model step, one JSON line each (``python -m server --step-log``,
``LLM.log_steps``): what the step computed for which class, how long it took, and what the cost
model had priced it at. ``python -m bench steps`` reads it: where a device's time goes, and how
well the iterations a policy sized to a deadline kept it."""
from __future__ import annotations

import json
import os
import threading
from dataclasses import asdict, dataclass

from tandem.sched.cost_model import StepShape


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
        d = asdict(self)
        d["shape"] = asdict(self.shape)
        return json.dumps(d)

    @classmethod
    def from_json(cls, line: str) -> "StepRecord":
        d = json.loads(line)
        return cls(**{**d, "shape": StepShape(**d["shape"])})


class StepLog:
    """Appends records to a file, a line each as it comes (the actors of several devices share
    one log: each line names its device)."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self._file = open(self.path, "a", buffering=1, encoding="utf-8")
        self._lock = threading.Lock()

    def write(self, record: StepRecord) -> None:
        line = record.to_json() + "\n"
        with self._lock:
            if not self._file.closed:
                self._file.write(line)

    @property
    def closed(self) -> bool:
        return self._file.closed

    def close(self) -> None:
        with self._lock:
            self._file.close()


def read_steps(path: str | os.PathLike) -> list[StepRecord]:
    """The records of a step log; a last line cut short (a server killed mid-write) is left out."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                out.append(StepRecord.from_json(line))
            except (ValueError, TypeError, KeyError):
                if line.endswith("\n"):
                    raise ValueError(f"{path}: not a step log line: {line[:80]!r}") from None
    return out
