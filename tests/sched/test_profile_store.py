"""A start-up profile kept in a directory is read back by a later LLM with the same machine,
model files, software and step-shaping settings, instead of being measured again; anything
else (another setting, a model file replaced, a damaged file, ``reprofile``) measures anew.

Whether a start measured is seen from outside the code under test: the scheduler steps it ran
while it started (counted by wrapping ``Scheduler.step``). Whether it read the kept profile is
seen from its cost model, equal to the last bit to the one the measuring start fitted (two
measurements of the same steps differ in their timings)."""
import json
import logging
import os
import shutil

import pytest

from tandem.sched.llm import LLM
from tandem.sched.scheduler import Scheduler


@pytest.fixture
def model(tiny_llama, tmp_path):
    """A copy of the tiny checkpoint whose files a test may touch."""
    return shutil.copytree(tiny_llama, tmp_path / "model")


@pytest.fixture
def steps(monkeypatch):
    """The number of scheduler steps run so far (in this process)."""
    count = [0]
    real = Scheduler.step

    def counted(self, *a, **kw):
        count[0] += 1
        return real(self, *a, **kw)
    monkeypatch.setattr(Scheduler, "step", counted)
    return lambda: count[0]


def start(model, cache, steps, **kw) -> tuple:
    """(the cost model the LLM started with, scheduler steps its start ran)."""
    before = steps()
    args = dict(dtype="float32", kv_cache_bytes=4 << 20, threads_per_worker=1, policy="bros",
                profile_cache=cache) | kw
    with LLM(str(model), "cpu:1", **args) as m:
        return m.scheduler.cost.model, steps() - before


def test_a_second_start_reads_the_kept_profile_and_measures_nothing(model, tmp_path, steps):
    cache = tmp_path / "profiles"
    first, ran = start(model, cache, steps)
    assert ran > 20                                   # the plan's steps
    kept = list(cache.iterdir())
    assert len(kept) == 1 and json.loads(kept[0].read_text())["samples"]
    second, ran = start(model, cache, steps)
    assert ran == 0 and second == first
    assert list(cache.iterdir()) == kept
    # tandem's plan is bros's: it reads the same profile
    tandem, ran = start(model, cache, steps, policy="tandem", length_predictor="max_tokens")
    assert ran == 0 and tandem == first
    # without a directory nothing is kept or read
    fresh, ran = start(model, None, steps)
    assert ran > 20 and fresh != first


def test_a_bfloat16_gguf_model_reads_its_profile_back_though_its_products_are_timed_anew(tmp_path, steps):
    """A worker that multiplies thin steps over a GGUF's blocks times its products at every start
    (Scheduler.products): timings, which differ at every start, so they are no part of the key."""
    from tandem.engine.models.tiny import write_tiny_model
    gguf = write_tiny_model(tmp_path / "gguf", "llama", seed=3, gguf_blocks=True)
    cache = tmp_path / "profiles"
    first, ran = start(gguf, cache, steps, dtype="bfloat16")
    assert ran > 20 and first.projections
    second, ran = start(gguf, cache, steps, dtype="bfloat16")
    assert ran == 0 and second.projections and second.projections != first.projections
    assert len(list(cache.iterdir())) == 1


def test_another_setting_model_file_or_reprofile_measures_again(model, tmp_path, steps):
    cache = tmp_path / "profiles"
    first, _ = start(model, cache, steps)
    other, ran = start(model, cache, steps, max_num_batched_tokens=512)     # shorter chunks: other steps
    assert ran > 20 and other != first and len(list(cache.iterdir())) == 2
    again, ran = start(model, cache, steps)
    assert ran == 0 and again == first                 # each setup keeps its own
    alise, ran = start(model, cache, steps, policy="alise", length_predictor="max_tokens")
    assert ran > 0 and len(list(cache.iterdir())) == 3    # a shorter plan is another profile

    weights = next(model.glob("*.safetensors"))
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))         # the model's file replaced
    replaced, ran = start(model, cache, steps)
    assert ran > 20 and replaced != first

    remeasured, ran = start(model, cache, steps, reprofile=True)
    assert ran > 20 and remeasured != replaced
    after, ran = start(model, cache, steps)
    assert ran == 0 and after == remeasured            # the new measurement replaced the kept one


@pytest.mark.parametrize("damage", ["not json {", '{"key": {}, "samples": []}', "[1, 2]",
                                    "truncate", "few steps"])
def test_a_damaged_profile_is_measured_again_and_replaced(model, tmp_path, steps, caplog, damage):
    cache = tmp_path / "profiles"
    first, _ = start(model, cache, steps)
    (path,) = cache.iterdir()
    text = path.read_text()
    if damage == "few steps":          # its own key, too few steps to fit a model on
        data = json.loads(text)
        path.write_text(json.dumps(data | {"samples": data["samples"][:4]}))
    else:
        path.write_text(text[:len(text) // 2] if damage == "truncate" else damage)
    with caplog.at_level(logging.WARNING, logger="tandem"):
        measured, ran = start(model, cache, steps)
    assert ran > 20 and measured != first
    assert f"start-up profile {path}" in caplog.text and "measuring again" in caplog.text
    again, ran = start(model, cache, steps)
    assert ran == 0 and again == measured


def test_a_profile_that_cannot_be_kept_only_costs_the_next_start(model, tmp_path, steps, caplog):
    blocked = tmp_path / "a file"
    blocked.write_text("")
    with caplog.at_level(logging.WARNING, logger="tandem"):
        _, ran = start(model, blocked / "profiles", steps)
    assert ran > 20 and "start-up profile cannot be kept in" in caplog.text
    _, ran = start(model, blocked / "profiles", steps)
    assert ran > 20


def test_a_profile_with_rho_is_kept_apart_from_one_without(tiny_opt, tmp_path, steps):
    """On a multi-head model a hidden cache saves memory, and aptserve's profile also measures ρ
    (paired runs): a start that needs ρ never reads a profile kept without it, and reads back
    its own, ρ included."""
    cache = tmp_path / "profiles"
    kv_only, ran = start(tiny_opt, cache, steps, policy="tandem", hybrid_cache=False, length_predictor="max_tokens")
    assert ran > 20 and kv_only.per_hidden_block == 0

    def rho_start():
        before = steps()
        with LLM(str(tiny_opt), "cpu:1", dtype="float32", kv_cache_bytes=4 << 20, threads_per_worker=1,
                 policy="aptserve", profile_cache=cache) as m:
            return m.scheduler.cfg.rho, m.scheduler.cost.model, steps() - before
    rho, model, ran = rho_start()
    assert ran > 20 and isinstance(rho, float) and len(list(cache.iterdir())) == 2
    again, model_again, ran = rho_start()
    assert ran == 0 and (again, model_again) == (rho, model)


def test_profiles_unused_for_a_month_are_removed_when_one_is_kept(model, tmp_path, steps):
    cache = tmp_path / "profiles"
    start(model, cache, steps)
    (kept,) = cache.iterdir()
    stale, month = cache / "0123456789abcdef.json", 31 * 86400
    stale.write_text("{}")
    for f in (kept, stale):
        os.utime(f, (f.stat().st_atime - month, f.stat().st_mtime - month))
    _, ran = start(model, cache, steps)          # reading the kept profile marks it used
    assert ran == 0 and stale.exists()
    _, ran = start(model, cache, steps, max_num_batched_tokens=512)      # keeping another one prunes
    assert ran > 20 and kept.exists() and not stale.exists() and len(list(cache.iterdir())) == 2
