"""Bidirectional blocks on the real engine: RT and BE share blocks, the RT owner overwrites BE
slots (checkpointed to the CPU first), the BE request is swapped back in later, and both produce
exactly HF transformers' greedy tokens."""
import pytest
import torch

from tandem.cache.bidir import BidirectionalPool
from tandem.engine.messages import CacheType, Command, NewRequest, Phase, SamplingSpec, ScheduledRequest, StepInput
from tandem.engine.models.loader import load_spec
from tandem.engine.worker import InProcessDevice, WorkerConfig
from tests.conftest import ONE_DEVICE, hf_greedy

B = 4                   # slots per token-block


class Driver:
    """A minimal scheduler over BidirectionalPool: RT grows before BE in every step."""

    def __init__(self, runner, num_token_blocks: int):
        self.runner = runner
        self.pool = BidirectionalPool(num_token_blocks, B)
        self.tokens: dict[str, list[int]] = {}
        self.prompt_len: dict[str, int] = {}
        self.computed: dict[str, int] = {}
        self.rt: dict[str, bool] = {}
        self.new: list[NewRequest] = []
        self.step_id = 0
        self.moves = {"checkpoints": 0, "swap_ins": 0}
        self.shared_steps = 0

    def add(self, rid: str, prompt: list[int], rt: bool) -> None:
        self.tokens[rid], self.prompt_len[rid], self.computed[rid], self.rt[rid] = list(prompt), len(prompt), 0, rt
        spec = SamplingSpec(0.0, 1.0, 0, 0, 0, ())
        self.new.append(NewRequest(rid, list(prompt), len(prompt), CacheType.KV, spec))

    def step(self, rids: list[str]) -> None:
        """One iteration over ``rids`` (each runs its whole remaining prompt, or one decode) when
        the pool can place it; sampled tokens are appended."""
        self.step_id += 1
        inp = StepInput(Command.STEP, self.step_id, self.new, [], [], [])
        self.new = []
        for rid in sorted(rids, key=lambda r: not self.rt[r]):          # RT first: BE never overwrites RT
            n = len(self.tokens[rid]) - self.computed[rid]
            g = self.pool.grow(rid, self.computed[rid] + n, self.rt[rid])
            if g is None:
                continue
            inp.checkpoints += g.checkpoints
            inp.swap_ins += g.swap_ins
            phase = Phase.DECODE if self.computed[rid] else Phase.PREFILL
            inp.scheduled.append(ScheduledRequest(rid, phase, n, [], [], True, new_slots=g.slots))
        self.moves["checkpoints"] += len(inp.checkpoints)
        self.moves["swap_ins"] += len(inp.swap_ins)
        self.pool.check_invariants()
        self.shared_steps += self.pool.view()["shared"] > 0
        out = self.runner.step(inp)
        for s in inp.scheduled:
            self.computed[s.req_id] += s.num_new_tokens
            self.tokens[s.req_id].append(out.sampled[s.req_id])

    def output(self, rid: str) -> list[int]:
        return self.tokens[rid][self.prompt_len[rid]:]

    def finish(self, rid: str) -> None:
        self.pool.free_request(rid)
        self.runner.step(StepInput(Command.STEP, -1, [], [], [], [rid]))


def test_be_overwritten_and_swapped_back_matches_hf(tiny_llama):
    torch.set_num_threads(1)
    spec = load_spec(tiny_llama)
    cfg = WorkerConfig(str(tiny_llama), spec, "float32", ONE_DEVICE, B, 1 << 20, None, 1, 1, False, False)
    runner = InProcessDevice("cpu", cfg).runner
    g = torch.Generator().manual_seed(7)
    be_prompt = torch.randint(3, 500, (10,), generator=g).tolist()
    rt_prompt = torch.randint(3, 500, (7,), generator=g).tolist()
    be_new, rt_new = 12, 9
    d = Driver(runner, num_token_blocks=6)          # 24 slots: BE's 22 and RT's 16 tokens do not fit together
    d.add("be", be_prompt, rt=False)
    d.step(["be"])                                  # BE prefill: blocks 3 + 2 slots of a third
    d.add("rt", rt_prompt, rt=True)
    for _ in range(rt_new):                         # RT runs every step; BE whenever it can be placed
        d.step(["rt", "be"])
    assert len(d.output("rt")) == rt_new
    d.finish("rt")
    for _ in range(be_new):
        if len(d.output("be")) < be_new:
            d.step(["be"])
    assert d.moves["checkpoints"] >= 2, "the RT owner never overwrote BE slots"
    assert d.moves["swap_ins"] == d.moves["checkpoints"], "every checkpointed BE token came back"
    assert d.shared_steps > 0
    ref = hf_greedy(tiny_llama, [be_prompt, rt_prompt], max(be_new, rt_new))
    assert d.output("rt")[:rt_new] == ref[1][:rt_new]
    assert d.output("be")[:be_new] == ref[0][:be_new]


@pytest.mark.parametrize("triton", [False, True])
def test_scheduler_with_bidirectional_blocks_matches_hf(tiny_llama, triton, monkeypatch):
    """BROS + bidirectional blocks through the real Scheduler: BE requests fill the pool, RT
    requests arrive and take BE blocks over (checkpointing BE slots, dropping BE requests to the
    CPU when needed); every request still produces HF's greedy tokens and the pool ends empty.
    With ``triton`` the attention runs on the Triton kernels (interpreted without a GPU), which
    read blocks filled from the back through the block table's directions, and steps whose
    swapped-in tokens broke the block order through the row table."""
    from tandem.engine.messages import PoolInfo
    from tandem.engine.params import SamplingParams
    from tandem.sched.cost_model import CostModel, OnlineCostModel
    from tandem.sched.request import Request, ServiceClass
    from tandem.sched.scheduler import SchedConfig, Scheduler

    torch.set_num_threads(1)
    spec = load_spec(tiny_llama)
    pagings = []
    if triton:
        from tandem.engine import runner
        real_tables = runner.tables

        def recording(rows, lens, block_size, to):
            t = real_tables(rows, lens, block_size, to)
            pagings.append((t.paging.name, bool(t.dirs[0] is not None and t.dirs[0].any())))
            return t
        monkeypatch.setattr(runner, "tables", recording)
    cfg = WorkerConfig(str(tiny_llama), spec, "float32", ONE_DEVICE, B, 1 << 20, None, 1, 1, False, False,
                       triton_attention=triton)
    dev = InProcessDevice(ONE_DEVICE, cfg)
    dev.pool_info = PoolInfo(num_blocks=2 * 20, block_size=B, hidden_rows=0)   # 20 token-blocks of 4 slots
    moves = {"checkpoints": 0, "swap_ins": 0}
    submit = dev.submit

    def counting_submit(inp):
        moves["checkpoints"] += len(inp.checkpoints)
        moves["swap_ins"] += len(inp.swap_ins)
        submit(inp)
    dev.submit = counting_submit
    cost = OnlineCostModel(CostModel(0.001, 1e-5, 0.0, 1e-4, 0.0))
    sched = Scheduler(SchedConfig(max_num_seqs=8, policy="bros", bidirectional=True), [dev],
                      spec.eos_token_ids, spec.max_model_len, cost=cost)
    g = torch.Generator().manual_seed(3)
    be = [torch.randint(3, 500, (20,), generator=g).tolist() for _ in range(2)]
    rt = [torch.randint(3, 500, (12,), generator=g).tolist() for _ in range(2)]
    sp = lambda n: SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)  # noqa: E731
    states = [sched.add(Request(f"be{i}", p, sp(16), ServiceClass.BE)) for i, p in enumerate(be)]
    for _ in range(6):
        sched.step()
    states += [sched.add(Request(f"rt{i}", p, sp(10), ServiceClass.RT, arrival_time=0.0, slo_ttft_s=60.0,
                                 slo_tbt_s=60.0)) for i, p in enumerate(rt)]
    for _ in range(2000):
        if not sched.has_unfinished():
            break
        sched.step()
    assert not sched.has_unfinished()
    assert moves["checkpoints"] > 0, "no BE slot was ever overwritten"
    assert moves["swap_ins"] == moves["checkpoints"]
    assert [s.output_token_ids for s in states[:2]] == hf_greedy(tiny_llama, be, 16)
    assert [s.output_token_ids for s in states[2:]] == hf_greedy(tiny_llama, rt, 10)
    assert sched.queues[0].pool.view()["free"] == 20
    if triton:
        assert ("BLOCKS", True) in pagings, "no step read a block filled from the back by its table"
        assert any(p == "ROWS" for p, _ in pagings), "no step needed the row table"
