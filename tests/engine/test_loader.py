"""A checkpoint's geometry and tokenizer as the server reads them, without transformers' model
config classes, against what transformers' AutoConfig and AutoTokenizer make of the same files."""
import json
import subprocess
import sys

import pytest

from tandem.engine.models.loader import load_spec, load_tokenizer, resolve_model
from tandem.engine.models.spec import spec_from_hf_config
from tandem.sched.llm import DEFAULT_CACHE_DIR

# config.json files leaving out what transformers fills in, written the way older releases did
# (rope_theta at the top level, num_key_value_heads and head_dim absent), and one of another kind
WRITTEN = {
    "llama-bare": {"model_type": "llama"},
    "llama-old": {"model_type": "llama", "hidden_size": 256, "num_attention_heads": 8, "intermediate_size": 512,
                  "num_hidden_layers": 2, "vocab_size": 1000, "rope_theta": 500000.0, "eos_token_id": [5, 7],
                  "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "bos_token_id": None},
    "llama-gqa": {"model_type": "llama", "hidden_size": 192, "num_attention_heads": 6, "num_key_value_heads": 2,
                  "head_dim": 48, "intermediate_size": 512, "num_hidden_layers": 1, "vocab_size": 99},
    "llama31-old": {"model_type": "llama", "hidden_size": 256, "num_attention_heads": 4, "rope_theta": 500000.0,
                    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                     "original_max_position_embeddings": 8192, "rope_type": "llama3"}},
    "llama-linear": {"model_type": "llama", "rope_scaling": {"type": "linear", "factor": 2.0}},
    "mistral-bare": {"model_type": "mistral"},
    "mistral-v02": {"model_type": "mistral", "sliding_window": None, "max_position_embeddings": 32768},
    "qwen2-bare": {"model_type": "qwen2"},
    "qwen25": {"model_type": "qwen2", "hidden_size": 896, "num_attention_heads": 14, "num_key_value_heads": 2,
               "intermediate_size": 4864, "num_hidden_layers": 24, "max_position_embeddings": 32768,
               "max_window_layers": 21, "rope_theta": 1000000.0, "sliding_window": 32768,
               "use_sliding_window": False, "tie_word_embeddings": True, "bos_token_id": 151643,
               "eos_token_id": 151645, "vocab_size": 151936},
    "qwen2-window": {"model_type": "qwen2", "num_hidden_layers": 4, "use_sliding_window": True,
                     "max_window_layers": 2, "sliding_window": 1024},
    "qwen2-window-unused": {"model_type": "qwen2", "num_hidden_layers": 4, "use_sliding_window": True,
                            "max_window_layers": 4, "sliding_window": 1024},
    "qwen2-window-default": {"model_type": "qwen2", "num_hidden_layers": 4, "use_sliding_window": True,
                             "max_window_layers": 2, "max_position_embeddings": 8192},
    "qwen2-types-unused": {"model_type": "qwen2", "num_hidden_layers": 2, "use_sliding_window": False,
                           "layer_types": ["full_attention", "sliding_attention"], "sliding_window": 100},
    "llama3-no-original": {"model_type": "llama", "max_position_embeddings": 4096,
                           "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0}},
    "qwen3-bare": {"model_type": "qwen3"},
    "phi3-bare": {"model_type": "phi3"},
    "phi3-mini-4k": {"model_type": "phi3", "hidden_size": 3072, "num_attention_heads": 32, "num_key_value_heads": 32,
                     "intermediate_size": 8192, "num_hidden_layers": 32, "max_position_embeddings": 4096,
                     "original_max_position_embeddings": 4096, "rope_scaling": None, "rope_theta": 10000.0,
                     "sliding_window": 2047, "vocab_size": 32064, "bos_token_id": 1, "eos_token_id": 32000,
                     "rms_norm_eps": 1e-5, "tie_word_embeddings": False},
    "qwen3-06b": {"model_type": "qwen3", "hidden_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 8,
                  "head_dim": 128, "intermediate_size": 3072, "num_hidden_layers": 28, "max_window_layers": 28,
                  "max_position_embeddings": 40960, "rope_theta": 1000000, "sliding_window": None,
                  "use_sliding_window": False, "tie_word_embeddings": True, "attention_bias": False,
                  "bos_token_id": 151643, "eos_token_id": 151645, "vocab_size": 151936},
    "opt-bare": {"model_type": "opt"},
    "opt-sized": {"model_type": "opt", "hidden_size": 512, "num_attention_heads": 8, "ffn_dim": 2048,
                  "num_hidden_layers": 3, "vocab_size": 5000, "max_position_embeddings": 1024},
}


def _hf_spec(d):
    from transformers import AutoConfig
    return spec_from_hf_config(AutoConfig.from_pretrained(d))


@pytest.mark.parametrize("name", sorted(WRITTEN))
def test_written_configs_read_as_transformers_reads_them(name, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(WRITTEN[name]))
    assert load_spec(tmp_path) == _hf_spec(tmp_path)


def test_shipped_configs_read_as_transformers_reads_them(tiny_llama, tiny_opt, tiny_chat_model, tmp_path):
    dirs = [tiny_llama, tiny_opt, tiny_chat_model, resolve_model("smollm2", DEFAULT_CACHE_DIR)]
    dirs += [resolve_model(n, tmp_path) for n in ("opt13b-random", "llama8b-random")]
    for d in dirs:
        assert load_spec(d) == _hf_spec(d), d


def test_the_tokenizer_is_the_one_autotokenizer_loads(tiny_chat_model):
    """Same class, same ids, same text back, same chat rendering and special tokens, for the
    real SmolLM2 tokenizer and the test models' copy of it."""
    from transformers import AutoTokenizer
    texts = ["Hello, world!", "  leading spaces\tand tabs\n", "Écrire — 東京 🌧️", "<|im_start|>user\nhi<|im_end|>"]
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    for d in (tiny_chat_model, resolve_model("smollm2", DEFAULT_CACHE_DIR)):
        ours, hf = load_tokenizer(d), AutoTokenizer.from_pretrained(d)
        assert type(ours) is type(hf)
        for t in texts:
            ids = hf(t)["input_ids"]
            assert ours(t)["input_ids"] == ids and ours.decode(ids) == hf.decode(ids)
        assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
            hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert ours.all_special_ids == hf.all_special_ids and ours.eos_token_id == hf.eos_token_id


def test_reading_a_model_imports_no_model_config_class(tiny_chat_model):
    """Each server start reads the spec and tokenizer: transformers' Llama config class imports
    its model-loading and distributed modules (about 2 s)."""
    code = ("import sys; from pathlib import Path; from tandem.engine.models.loader import load_spec, load_tokenizer; "
            f"d = Path({str(tiny_chat_model)!r}); load_spec(d); load_tokenizer(d); "
            "print(sorted(m for m in sys.modules if m.startswith(('transformers.models.llama', "
            "'torch.distributed.tensor'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


@pytest.mark.parametrize("family, config", [("llama", {}), ("llama", {"tie_word_embeddings": False}),
                                            ("opt", {}), ("qwen2", {"tie_word_embeddings": False}), ("qwen3", {})])
def test_weight_bytes_count_what_transformers_holds(family, config, tmp_path):
    """The memory estimate's weights: every matrix and embedding table of HF's model (a tied head
    once), at the given element size."""
    import torch
    from transformers import AutoModelForCausalLM
    from tandem.engine.models.loader import weight_bytes
    from tandem.engine.models.tiny import write_tiny_model
    d = write_tiny_model(tmp_path, family, config=config)
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    matrices = sum(p.numel() for p in hf.parameters() if p.dim() == 2)
    assert weight_bytes(d, load_spec(d), 2) == 2 * matrices
