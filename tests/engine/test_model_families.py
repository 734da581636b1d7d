"""Llama-shaped checkpoints beyond Llama itself -- Qwen2 (Q/K/V biases), Qwen3 (per-head Q/K
norms), Mistral and Phi-3 (a sliding window, which the engine applies; Phi-3's projections stored
fused), Gemma 3 (text: output norms, GELU, scaled embeddings, a rotary base per layer type),
SmolLM3 (layers without rotary embeddings),
Llama 3.1's,
linear and YaRN rotary scaling, Llama with attention biases -- generate exactly
HF transformers' greedy tokens; configs this engine cannot compute are refused by name."""
import json
import logging
from pathlib import Path

import pytest

from tandem import LLM, SamplingParams
from tandem.engine.models.loader import load_spec
from tandem.engine.models.spec import RopeScaling
from tandem.engine.models.tiny import write_tiny_gguf, write_tiny_model
from tests.conftest import ONE_DEVICE, assert_pool_free, hf_greedy, mixed_prompts

MAX_NEW = 16
WINDOW = 40          # shorter than most prompts here, and than the 32-token chunks plus their prefix
GEMMA_LAYERS = ["sliding_attention", "full_attention"]
# a tied head would read back mostly the last token's embedding, which Gemma scales by sqrt(d_model)
GEMMA = {"sliding_window": WINDOW, "layer_types": GEMMA_LAYERS, "tie_word_embeddings": False}
# SmolLM3's second layer rotates neither Q nor K ("no_rope_layers" flags the layers that do)
NOPE = {"no_rope_layers": [1, 0]}
WINDOWED = {"gemma3_text": GEMMA, "smollm3": NOPE | {"use_sliding_window": True, "sliding_window": WINDOW}}
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}
LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
# family, extra config fields; Llama 3.1's scaling with a 64-token original context touches the
# tiny heads' low, blended and kept frequency bands alike
CASES = {
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "qwen3-attention-bias": ("qwen3", {"attention_bias": True}),
    "mistral-window": ("mistral", {"sliding_window": WINDOW}),
    "qwen2-window": ("qwen2", {"sliding_window": WINDOW, "use_sliding_window": True, "max_window_layers": 0}),
    # layer 0 attends fully, layer 1 within the window: a step carries both layouts
    "qwen3-upper-window": ("qwen3", {"sliding_window": WINDOW, "use_sliding_window": True, "max_window_layers": 1}),
    "llama3-rope": ("llama", {"rope_parameters": LLAMA3}),
    "qwen3-yarn": ("qwen3", {"rope_parameters": YARN}),
    "phi3-window": ("phi3", {"sliding_window": WINDOW}),
    "phi3": ("phi3", {}),
    # a sliding layer (rotary base 10,000) under a full one (1,000,000)
    "gemma3": ("gemma3_text", GEMMA),
    # Gemma 3 4B's: the full layers' frequencies divided by 8, the sliding ones' kept
    # Gemma 3 4B and up: the language model of a multimodal checkpoint
    "gemma3-multimodal": ("gemma3", GEMMA),
    "smollm3": ("smollm3", NOPE),
    # with use_sliding_window, the layers without rotary embeddings slide
    "smollm3-window": ("smollm3", WINDOWED["smollm3"]),
    "gemma3-linear": ("gemma3_text", GEMMA | {"rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}),
    "linear-rope": ("llama", {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}}),
    "llama-attention-bias": ("llama", {"attention_bias": True}),
}


def _generate(model_dir, prompts, **kw):
    with LLM(str(model_dir), ONE_DEVICE, dtype="float32", policy="fcfs", block_size=8,
             max_num_batched_tokens=32, threads_per_worker=1, **kw) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True))
        assert_pool_free(llm)
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("case", sorted(CASES))
def test_llama_shaped_checkpoints_match_hf(case, tmp_path):
    family, config = CASES[case]
    model_dir = write_tiny_model(tmp_path, family, seed=5, config=config)
    prompts = mixed_prompts(6, 512, seed=3, hi=120)      # prefilled in 32-token chunks
    if config.get("sliding_window"):                     # and one many windows long
        prompts.append(mixed_prompts(1, 512, seed=8, lo=300, hi=301)[0])
    outs = _generate(model_dir, prompts)
    for i, (o, r) in enumerate(zip(outs, hf_greedy(model_dir, prompts, MAX_NEW), strict=True)):
        assert o == r, f"prompt {i} differs"


def _count_parses(monkeypatch) -> list:
    """The paths gguf's reader parses from now on (each GGUFReader made is one parse)."""
    from gguf import GGUFReader
    parses, real = [], GGUFReader.__init__

    def counted(self, path, *a, **kw):
        parses.append(Path(path))
        real(self, path, *a, **kw)
    monkeypatch.setattr(GGUFReader, "__init__", counted)
    return parses


@pytest.mark.parametrize("arch, config", [("llama", {}), ("llama", {"rope_parameters": LLAMA3}), ("qwen2", {}),
                                          ("qwen3", {"head_dim": 128}), ("phi3", {"sliding_window": WINDOW})])
def test_gguf_files_generate_the_checkpoint_s_tokens(arch, config, tmp_path, caplog, monkeypatch):
    """A GGUF of each architecture, laid out as llama.cpp's converter does (Llama's Q/K rows
    permuted, a tied head left out, the tokenizer as GGUF keys, Llama 3.1's rotary scaling as
    per-frequency divisors and Phi-3's sliding window as a key, both of which transformers' reader
    drops), served by its path: it generates
    the original checkpoint's greedy tokens, and tokenizes and renders a chat as the original's
    tokenizer does."""
    from transformers import AutoTokenizer
    from tandem.engine.models.loader import resolve_model
    from tandem.sched.llm import DEFAULT_CACHE_DIR
    caplog.set_level(logging.INFO, logger="tandem.engine")
    hf = write_tiny_model(tmp_path / "hf", arch, seed=7, config=config,
                          tokenizer_from=resolve_model("smollm2", DEFAULT_CACHE_DIR))
    (tmp_path / "gguf").mkdir()                 # alone: beside a tokenizer.json, transformers reads that
    gguf = write_tiny_gguf(hf, tmp_path / "gguf" / f"tiny-{arch}.gguf", arch)
    prompts = mixed_prompts(4, 49152, seed=9, hi=40)
    chat = [{"role": "user", "content": "Write one line about the sea."}]
    parses = _count_parses(monkeypatch)
    with LLM(str(gguf), ONE_DEVICE, dtype="float32", threads_per_worker=1, cache_dir=str(tmp_path / "cache")) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True))
        said = llm.chat(chat, SamplingParams(max_tokens=2))[0]
        text = llm.generate("Hello, world! 12345", SamplingParams(max_tokens=1))[0]
    assert [o.token_ids for o in outs] == hf_greedy(hf, prompts, MAX_NEW)
    assert f"converting tiny-{arch}.gguf" in caplog.text          # once, saying where and what it costs
    assert parses == [gguf]                 # the tokenizer, config, weights and the checks share one parse
    tok = AutoTokenizer.from_pretrained(hf)
    assert said.prompt_token_ids == tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                                            return_dict=False)
    assert text.prompt_token_ids == tok("Hello, world! 12345").input_ids


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_hidden_cache_recomputes_kv_with_biases_and_norms(family, tmp_path):
    """A hidden cache keeps each layer's input and projects K and V again at every step: Qwen2's
    K and V biases, and Qwen3's norm of each K head, must come with them."""
    model_dir = write_tiny_model(tmp_path, family, seed=6, num_kv_heads=4)
    prompts = mixed_prompts(6, 512, seed=4, hi=90)
    outs = _generate(model_dir, prompts, cache_type="hidden")
    assert outs == hf_greedy(model_dir, prompts, MAX_NEW)


@pytest.mark.parametrize("rope", [
    LLAMA3, LLAMA3 | {"factor": 32.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0, "rope_theta": 500000.0,
                      "original_max_position_embeddings": 8192},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.5},
    YARN | {"rope_theta": 1e6, "original_max_position_embeddings": 1024},                 # Qwen's card's
    YARN | {"factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.707, "beta_fast": 16.0},   # DeepSeek's kind
    YARN | {"attention_factor": 1.25, "truncate": False, "beta_slow": 2.0}])
def test_scaled_frequencies_match_transformers(rope):
    """The engine's scaled rotary frequencies, and YaRN's scale of cos and sin, against
    transformers' own initialisers."""
    import torch
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from tandem.engine.models.llama import rope_tables
    from tandem.engine.models.spec import spec_from_config_json
    cfg = LlamaConfig(hidden_size=512, num_attention_heads=4, max_position_embeddings=4096, rope_parameters=rope)
    ref, attention = ROPE_INIT_FUNCTIONS[rope["rope_type"]](cfg, "cpu")
    spec = spec_from_config_json(cfg.to_dict())
    assert isinstance(spec.rope_scaling, RopeScaling)
    plain = (1.0 / rope["rope_theta"] ** (torch.arange(0, 128, 2) / 128)).tolist()
    got = torch.tensor(spec.rope_scaling.apply(plain, rope["rope_theta"]))
    torch.testing.assert_close(got, ref.double().float(), rtol=1e-6, atol=0)
    cos, sin = rope_tables(spec, torch.float32)          # position 1: cos and sin of each frequency
    torch.testing.assert_close(cos[1, :64], ref.cos() * attention, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(sin[1, 64:], ref.sin() * attention, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("head_dim, factor", [(128, 8.0), (64, 32.0)])     # Llama 3.1 8B, Llama 3.2 1B
def test_llama3_scaling_comes_back_from_llama_cpp_s_divisors(head_dim, factor):
    """llama.cpp keeps the scaling as each frequency's divisor; the scaling read back from them
    gives transformers' scaled frequencies. Divisors of no llama3 scaling give None."""
    import torch
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": factor, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    cfg = LlamaConfig(hidden_size=head_dim * 8, num_attention_heads=8, rope_parameters=rope)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    plain = 1.0 / 500000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    found = RopeScaling.from_divisors((plain / scaled.double()).float().tolist(), plain.tolist())
    torch.testing.assert_close(torch.tensor(found.apply(plain.tolist()), dtype=torch.float64), scaled.double(),
                               rtol=1e-6, atol=0)
    bumpy = (plain / scaled.double()).tolist()
    bumpy[len(bumpy) // 2] *= 1.5
    assert RopeScaling.from_divisors(bumpy, plain.tolist()) is None


def test_yarn_stretches_the_context(tmp_path):
    """Qwen3's card adds YaRN (4x over 32,768 trained positions) for 131,072 tokens of context, as
    vLLM derives it; a factor that stretches less than max_position_embeddings keeps that."""
    base = {"model_type": "qwen3", "max_position_embeddings": 40960}
    for rope, context in (({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, 131072),
                          ({"rope_type": "yarn", "factor": 1.0, "original_max_position_embeddings": 32768}, 40960)):
        (tmp_path / "config.json").write_text(json.dumps(base | {"rope_scaling": rope}))
        assert load_spec(tmp_path).max_model_len == context


def test_rope_scaling_beside_rope_parameters_is_applied(tmp_path):
    """As transformers reads it: the older ``rope_scaling`` wins over ``rope_parameters``, whose
    rope_theta it keeps."""
    cfg = {"model_type": "llama", "rope_parameters": {"rope_type": "default", "rope_theta": 5e5},
           "rope_scaling": {"type": "linear", "factor": 2.0}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = load_spec(tmp_path)
    assert (spec.rope_scaling, spec.rope_theta) == (RopeScaling("linear", 2.0), 5e5)


@pytest.mark.parametrize("family, kw", [("phi3", {"cache_type": "hidden"}), ("mistral", {"cpu_kernels": False}),
                                        ("gemma3_text", {"cache_type": "hidden"}), ("smollm3", {"cache_type": "hidden"}),
                                        ("mistral", {"preemption_mode": "recompute"})])
def test_sliding_window_in_every_attention_path(family, kw, tmp_path):
    """The window holds where K and V are projected again from stored layer inputs (a hidden
    cache), on torch's reference attention instead of the compiled kernel, and for requests
    preempted and computed again (a pool of 24 token-blocks of 8 for prompts of up to 120)."""
    model_dir = write_tiny_model(tmp_path, family, seed=4, config=WINDOWED.get(family, {"sliding_window": WINDOW}))
    prompts = mixed_prompts(6, 512, seed=5, lo=30, hi=120)
    recompute = "preemption_mode" in kw
    if recompute:
        spec = load_spec(model_dir)
        kw = kw | {"kv_cache_bytes": 24 * 2 * spec.num_layers * 8 * spec.unit * 4}
    with LLM(str(model_dir), ONE_DEVICE, dtype="float32", policy="fcfs", block_size=8,
             max_num_batched_tokens=32, threads_per_worker=1, **kw) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True))
        preempted = sum(q.num_preemptions for q in llm.scheduler.queues)
    assert [o.token_ids for o in outs] == hf_greedy(model_dir, prompts, MAX_NEW)
    assert (preempted > 0) == recompute, preempted


def test_sliding_window_keeps_the_context(tmp_path):
    """A sliding-window model keeps its whole context, the window applied in the layers that
    slide: all of Mistral's, Qwen's from max_window_layers on. Qwen2 without use_sliding_window
    has no window."""
    spec = load_spec(write_tiny_model(tmp_path / "m", "mistral", config={"sliding_window": 160}))
    assert (spec.max_model_len, spec.sliding_window, spec.full_layers) == (512, 160, ())
    nowin = load_spec(write_tiny_model(tmp_path / "nowin", "mistral", config={"sliding_window": None}))
    assert (nowin.max_model_len, nowin.sliding_window) == (512, None)
    q = load_spec(write_tiny_model(tmp_path / "q", "qwen2", config={"sliding_window": 64}))
    assert (q.max_model_len, q.sliding_window) == (512, None)
    upper = load_spec(write_tiny_model(tmp_path / "qu", "qwen2", config={
        "sliding_window": 64, "use_sliding_window": True, "max_window_layers": 1}))
    assert (upper.max_model_len, upper.sliding_window, upper.full_layers) == (512, 64, (0,))


@pytest.mark.parametrize("change, message", [
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0}}, "rope type 'dynamic'"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}},
     "part of each head"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "llama3 rotary scaling needs low_freq_factor"),
    # a model card's rope_scaling added to a config saved with rope_parameters: transformers applies it
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
      "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, "rope type 'dynamic'"),
    ({"hidden_act": "gelu"}, "activation 'gelu'"),
    ({"mlp_bias": True}, "MLP biases"),
    ({"model_type": "gemma"}, "architecture 'gemma' is not supported"),
    ({"model_type": "gemma2"}, r"architecture 'gemma2' is not supported \(.*gemma3_text, .*, gemma3\)"),
    ({"model_type": "gemma3_text", "attn_logit_softcapping": 50.0}, "attn_logit_softcapping is not supported"),
    ({"model_type": "gemma3_text", "final_logit_softcapping": 30.0}, "final_logit_softcapping is not supported"),
    ({"model_type": "gemma3_text", "hidden_activation": "gelu"}, "activation 'gelu'"),
])
def test_configs_not_computed_are_refused(tmp_path, change, message):
    cfg = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 1,
           "intermediate_size": 128, "vocab_size": 128} | change
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=message):
        load_spec(tmp_path)


@pytest.mark.parametrize("arch, tensor, message", [
    ("gemma3", "token_embd.weight", "g.gguf is a gemma3 GGUF, which this engine does not read"),
    ("phi3", "rope_factors_long.weight", "g.gguf has longrope rotary scaling, which is not supported")])
def test_gguf_files_not_read_back_are_refused_before_any_conversion(arch, tensor, message, tmp_path):
    """transformers' GGUF reader drops Gemma 3's rotary scaling, and Phi-3's longrope factors are
    refused from a checkpoint too: such a file is refused, before the float32 conversion is
    written."""
    import gguf
    import numpy as np
    from tandem.engine.models.loader import resolve_model
    w = gguf.GGUFWriter(str(tmp_path / "g.gguf"), arch)
    w.add_tensor(tensor, np.ones((4, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=message):
        resolve_model(str(tmp_path / "g.gguf"), tmp_path / "cache")
    assert not (tmp_path / "cache").exists()
