"""Shared fixtures: tiny random checkpoints, HF reference generation, invariant checks."""
from __future__ import annotations

import functools
import os
import random

import pytest

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _no_cuda() -> bool:
    import torch
    return not torch.cuda.is_available()


# Without a GPU the Triton kernels' tests run under Triton's interpreter. Triton fixes the mode of
# every jit function (its own library's included) when it is first imported, so it is chosen here,
# before anything imports Triton; worker processes inherit it. Nothing else on a CPU runs Triton.
if _no_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The device of the single-device tests that check the engine against HF (the Triton kernels
# under the interpreter; swapping, int8 and hidden caches, prefix caching, the default policy):
# the CPU by default; a GPU machine sets TANDEM_TEST_DEVICE=cuda:0 (bench/gpu_run.sh), where
# they run on CUDA, with the Triton kernels wherever the model's head_dim allows them.
ONE_DEVICE = os.environ.get("TANDEM_TEST_DEVICE", "cpu")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    from tandem.engine.models.tiny import write_tiny_model
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama", seed=1)


@pytest.fixture(scope="session")
def tiny_opt(tmp_path_factory):
    from tandem.engine.models.tiny import write_tiny_model
    return write_tiny_model(tmp_path_factory.mktemp("tiny-opt"), "opt", seed=2)


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory):
    """Tiny random Llama with SmolLM2's real tokenizer and chat template."""
    from tandem.sched.llm import DEFAULT_CACHE_DIR
    from tandem.engine.models.loader import resolve_model
    from tandem.engine.models.tiny import write_tiny_model
    return write_tiny_model(tmp_path_factory.mktemp("tiny-chat"), "llama", seed=3,
                            tokenizer_from=resolve_model("smollm2", DEFAULT_CACHE_DIR))


@pytest.fixture(autouse=True)
def scheduler_invariants(monkeypatch):
    """Check block pool and queue invariants after every device step, in every test (lock-step
    and actor threads alike: each step ends in DeviceActor.account)."""
    from tandem.sched.actor import DeviceActor
    real = DeviceActor.account

    def checked(self, pending, out):
        updates = real(self, pending, out)
        self.check_invariants()
        return updates
    monkeypatch.setattr(DeviceActor, "account", checked)


def environ_of(pid: int) -> dict[str, str]:
    """The environment process ``pid`` began with (a forked one's: its parent's at the fork)."""
    raw = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    return dict(kv.decode().split("=", 1) for kv in raw if b"=" in kv)


def mixed_prompts(n: int, vocab: int, seed: int, lo: int = 2, hi: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def hf_greedy(model_dir, prompts: list[list[int]], max_new_tokens: int, eos: bool = False,
              adapter=None, **generate_kw) -> list[list[int]]:
    """Reference: HF transformers generate, one unpadded prompt at a time, fp32 (``adapter``: a
    LoRA adapter's directory, applied by PEFT; ``generate_kw``: more of generate's arguments,
    e.g. bad_words_ids)."""
    import torch
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if adapter is not None:
        from peft import PeftModel
        hf = PeftModel.from_pretrained(hf, str(adapter)).eval()
    out = []
    for p in prompts:
        kw = {} if eos else {"eos_token_id": None}
        g = hf.generate(torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False,
                        pad_token_id=0, **kw, **generate_kw)
        out.append(g[0, len(p):].tolist())
    return out


def write_adapter(model_dir, out, targets: list[str], r: int = 8, alpha: float = 16, seed: int = 0,
                  **config):
    """A random LoRA adapter for the checkpoint at ``model_dir``, saved by PEFT to ``out``: A and B
    both random (B three times PEFT's non-default init, so that the adapter changes the
    model's greedy tokens). ``config``: more of LoraConfig's fields (use_rslora, use_dora, ...)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                           LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, init_lora_weights=False,
                                      **config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(3.0)
    model.save_pretrained(str(out))
    return out


def assert_pool_free(llm) -> None:
    for q in llm.scheduler.queues:
        q.pool.check_invariants()
        assert q.pool.num_free == q.pool.geometry.num_blocks, "blocks leaked"
        assert not q.running and not q.waiting
        assert q.host is None or (len(q.host) == 0 and q.host.used == 0), "host memory leaked"


def int8_blocks_as_read(values, closed_blocks, block_size: int):
    """What an int8 pool's rows read back as, computed independently with numpy: each closed
    block's rows rounded channel-wise to lo + λ·q (λ = (hi - lo) / 255), open blocks exact.
    values [heads, rows, dim] -> float64 torch tensor of the same shape."""
    import numpy as np
    import torch
    expect = values.double().numpy().copy()
    B = block_size
    for b in closed_blocks:
        x = expect[:, b * B:(b + 1) * B]
        lo, hi = x.min(axis=1, keepdims=True), x.max(axis=1, keepdims=True)
        step = (hi - lo) / 255
        expect[:, b * B:(b + 1) * B] = lo + step * np.clip(np.round((x - lo) / np.where(step > 0, step, 1)), 0, 255)
    return torch.from_numpy(expect)


@functools.cache
def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte alphabet read back: each spelling character's byte (built once: 0.5 ms)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    return {c: b for b, c in bytes_to_unicode().items()}


# characters of two to four bytes that SmolLM2's vocabulary splits over several tokens
SPLIT_PROMPT = "Hi 猫 and 😁 or 🦜🦜, ok ɐ."


def raw_bytes(tok, tid: int) -> bytes:
    """A byte-level BPE token's own bytes, from its spelling in GPT-2's byte alphabet (as
    transformers converts it)."""
    back = _byte_alphabet()
    return bytes(back[c] for c in tok.convert_ids_to_tokens(tid))


def hf_whole(tok, ids: list[int]) -> str:
    """HF's decode of ids, less a character their bytes leave incomplete at the end: its bytes,
    which a byte-level decode shows as one U+FFFD, are dropped (a truncated UTF-8 sequence is
    what Python's strict decoder calls an unexpected end of data)."""
    raw = b"".join(raw_bytes(tok, t) for t in ids
                   if tok.decode([t], skip_special_tokens=True))          # a special token's text is skipped
    full = tok.decode(ids, skip_special_tokens=True)
    for n in (1, 2, 3):
        try:
            raw[-n:].decode("utf-8")
        except UnicodeDecodeError as e:
            if e.start == 0 and e.reason == "unexpected end of data":
                assert full.endswith("\ufffd")
                return full[:-1]
    return full
