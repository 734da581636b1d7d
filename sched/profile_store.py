"""Start-up profiles kept between starts.

A policy that prices its iterations measures the engine at start-up (sched.profiling: 5-30 s
on a CPU). The steps it measures depend on the hardware, the model's files, the software and
the settings that shape a step (dtype, pool, threads, kernels, chunk size), never on what a
request brings. So a server started again with all of those the same reads the measured steps
back instead of measuring them again. The cost model is fitted anew on them at every start and
refined online from served steps, as after a measurement.

Each profile is one JSON file named by a hash of its key, and holds the key itself: a start
whose key differs in anything (another dtype, a model file replaced) measures and keeps its
own file beside the others. A file that cannot be read or does not match is measured again and
replaced; one that cannot be written costs only the next start's measurement. Reading a file
marks it used; a file no start has used for ``KEEP_DAYS`` is removed when another is written.

A profile measured while the machine was busy (another server starting beside it, say) keeps
its slow steps; the cost model's online refits weigh them beside up to 1,024 served steps, and
measuring again on a quiet machine replaces them.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from dataclasses import astuple, dataclass, field
from pathlib import Path
from typing import Any

from tandem.sched.cost_model import FEATURES, MIN_STEPS, StepShape

log = logging.getLogger(__name__)

FORMAT = 2      # the file's layout and its shapes' meaning (2: prefill_attn counts causal pairs); the key
                # holds FEATURES too, so a changed StepShape measures again
KEEP_DAYS = 30  # a profile no start has read or written for this long is removed


@dataclass(frozen=True, slots=True)
class Profile:
    samples: list[tuple[StepShape, float]]      # (shape, seconds) of each measured step
    seconds: float                              # how long measuring them took
    rho: float | None = None                    # Apt-Serve's ρ, where the plan measured it
    measured_at: float = field(default_factory=time.time)    # Unix time


def samples_of(data: dict) -> list[tuple[StepShape, float]]:
    """The measured steps of a kept profile's JSON."""
    return [(StepShape(*map(int, shape)), float(t)) for shape, t in data["samples"]]


class ProfileStore:
    """The profiles kept under ``root`` for one machine, model and setup (``key``: JSON values)."""

    def __init__(self, root: str | os.PathLike, key: dict[str, Any]):
        self.root = Path(root)
        self.key = key

    def _full_key(self, plan: Any, rho: bool) -> dict[str, Any]:
        """The whole key of the profile of ``plan`` (with ρ's paired runs: ``rho``), as JSON reads
        it back (tuples as lists)."""
        return json.loads(json.dumps({"format": FORMAT, "features": FEATURES, "plan": plan, "rho": rho, **self.key}))

    def path(self, plan: Any, rho: bool = False) -> Path:
        text = json.dumps(self._full_key(plan, rho), sort_keys=True)
        return self.root / f"{hashlib.sha256(text.encode()).hexdigest()[:16]}.json"

    def load(self, plan: Any, rho: bool = False) -> Profile | None:
        """The kept profile of ``plan`` (and ρ, with ``rho``); None: none kept, or one that cannot
        be used (said in the log)."""
        path = self.path(plan, rho)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            log.warning("start-up profile %s cannot be read (%s): measuring again", path, e)
            return None
        try:
            if data["key"] != self._full_key(plan, rho):
                raise ValueError("its key is not this setup's")
            samples = samples_of(data)
            if len(samples) < MIN_STEPS:
                raise ValueError(f"{len(samples)} measured steps, fewer than a fit needs")
            profile = Profile(samples, float(data["seconds"]), float(data["rho"]) if rho else None,
                              float(data["measured_at"]))
        except (KeyError, TypeError, ValueError) as e:
            log.warning("start-up profile %s cannot be used (%s): measuring again", path, e)
            return None
        with contextlib.suppress(OSError):
            os.utime(path)                      # used: kept from pruning
        return profile

    def save(self, plan: Any, profile: Profile, rho: bool = False) -> Path | None:
        """Keep ``profile`` for ``plan`` (written whole or not at all), and remove the profiles
        unused for KEEP_DAYS; None where it cannot be written."""
        path = self.path(plan, rho)
        data = {"key": self._full_key(plan, rho), "measured_at": profile.measured_at, "seconds": profile.seconds,
                "rho": profile.rho, "samples": [[list(astuple(s)), t] for s, t in profile.samples]}
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(data))
            os.replace(tmp, path)
        except OSError as e:
            log.warning("start-up profile cannot be kept in %s (%s): the next start measures again", self.root, e)
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            return None
        self._prune()
        return path

    def _prune(self) -> None:
        """Remove the profiles no start has read or written for KEEP_DAYS."""
        cutoff = time.time() - KEEP_DAYS * 86400
        for old in self.root.glob("*.json"):
            with contextlib.suppress(OSError):
                if old.stat().st_mtime < cutoff:
                    old.unlink()
