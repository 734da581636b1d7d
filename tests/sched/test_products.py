"""The products a step's token rows take, which a cost model adds as measured, are timed once per
server: by one worker, after every worker has loaded, and only where a policy fits a cost model
on an engine whose thin products take another path (a bfloat16 model over a GGUF's blocks).

What was timed is seen from outside the code under test: the commands the workers' handles send
their processes (counted by wrapping ``WorkerHandle.submit``), and the table the cost model of
each device holds."""
import pytest

from tandem.engine.linear import threshold_rows
from tandem.engine.messages import Command
from tandem.engine.worker import WorkerHandle
from tandem.sched.llm import LLM


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    from tandem.engine.models.tiny import write_tiny_model
    return write_tiny_model(tmp_path_factory.mktemp("gguf"), "llama", seed=3, gguf_blocks=True)


@pytest.fixture
def timings(monkeypatch):
    """Each products command sent: (the worker asked, whether every worker had loaded by then)."""
    handles, sent = [], []
    real_init, real_submit = WorkerHandle.__init__, WorkerHandle.submit

    def init(self, *a, **kw):
        handles.append(self)
        real_init(self, *a, **kw)

    def submit(self, inp):
        if inp.command is Command.PRODUCTS:
            sent.append((self.name, all(h.pool_info is not None for h in handles)))
        return real_submit(self, inp)
    monkeypatch.setattr(WorkerHandle, "__init__", init)
    monkeypatch.setattr(WorkerHandle, "submit", submit)
    return sent


def start(model, **kw) -> LLM:
    return LLM(str(model), **(dict(dtype="bfloat16", kv_cache_bytes=4 << 20, threads_per_worker=1) | kw))


def test_one_worker_times_the_products_after_every_worker_loaded(gguf, timings):
    with start(gguf, devices="cpu:2", policy="bros") as llm:
        thin = llm.scheduler.devices[0].pool_info.thin_rows
        tables = [a.cost.model.projections for a in llm.scheduler.actors]
    assert thin > 0 and len(timings) == 1 and timings[0][1]          # once, once both had loaded
    assert [r for r, _ in tables[0]] == [0, *threshold_rows(thin)]
    assert all(t > 0 for _, t in tables[0][1:]) and tables[1] == tables[0]


def test_a_policy_without_a_cost_model_times_nothing(gguf, timings):
    """(On several devices the placement fits one, and the products are timed for it.)"""
    with start(gguf, devices="cpu:1", policy="fcfs") as llm:
        assert llm.scheduler.devices[0].pool_info.thin_rows > 0 and llm.scheduler.cost is None
    assert timings == []


def test_an_engine_without_thin_products_times_nothing(gguf, timings):
    with start(gguf, devices="cpu:1", policy="bros", dtype="float32") as llm:
        assert llm.scheduler.devices[0].pool_info.thin_rows == 0
        assert llm.scheduler.cost.model.projections == ()
    assert timings == []


def test_the_products_are_never_timed_beside_the_actors_steps(gguf, timings):
    """Once the devices' actors run on their own threads, a command of the scheduler's own would
    share a worker's pipe with them: asking then is refused (it is asked before, at start-up)."""
    with start(gguf, devices="cpu:1", policy="fcfs") as llm:
        llm.start_runtime()
        with pytest.raises(RuntimeError, match="before the devices' actors start"):
            llm.scheduler.products()
    assert timings == []
