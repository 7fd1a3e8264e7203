"""Checkpoints and HF weight export, both written atomically (temp dir beside the target, then rename).

Checkpoint folder::

    trainer_state.json   step, weight_version, world_size, scheduler state, LoRA settings (or null), the bf16 CPU
                         attention's fp32 limit (or null), the caller's ``extra`` (JSON)
    state/               model + optimiser, sharded with torch.distributed.checkpoint (reshardable: a run
                         saved at one world size resumes at another); with LoRA the adapters and their optimiser
                         state only (the frozen base is the model the trainer starts from)
    rng/rank<r>.pt       each rank's RNG states (torch, CUDA, python, numpy)

A folder exists under its final name only once complete, so the newest folder with a ``trainer_state.json``
is always a good checkpoint. Every rank calls save/load/export (they are collective); only rank 0 renames.
"""

from __future__ import annotations

import copy
import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from agentrl.errors import ConfigError, TrainerError
from agentrl.trainer.model import ScoredLM

STATE_FILE = "trainer_state.json"
WEIGHT_SUFFIXES = (
    ".safetensors",
    ".bin",
    ".pt",
    ".pth",
    ".gguf",
    ".safetensors.index.json",
    ".bin.index.json",
)
MAX_SHARD_BYTES = 4 * 1024**3


def partial_path(target: Path) -> Path:
    """Where a folder is assembled before its rename to ``target`` (same filesystem, same on every rank)."""
    return target.parent / f".{target.name}.partial"


def publish_dir(tmp: Path, target: Path, *, durable: bool = True) -> None:
    """Rename a finished temp folder to ``target``, replacing an existing one (rank 0 only).

    ``durable``: fsync the files first, so ``target`` survives a machine crash whole (checkpoints). Without it the
    rename is still atomic for every reader on this machine; what a crash may lose is re-created from the last
    checkpoint (how the trainer treats published weight versions).
    """
    for f in tmp.rglob("*") if durable else ():
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    old = target.parent / f".{target.name}.old"
    if target.exists():
        shutil.rmtree(old, ignore_errors=True)
        target.rename(old)
    tmp.rename(target)
    shutil.rmtree(old, ignore_errors=True)
    if not durable:
        return
    fd = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _prepare_tmp(target: Path, rank: int) -> Path:
    tmp = partial_path(target)
    if rank == 0:
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    dist.barrier()
    return tmp


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _state_dicts(model: ScoredLM, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    """Model and optimiser state dicts to save or load in place; with LoRA only the trainable parameters (the
    adapters: torch's ``ignore_frozen_params`` would keep a tied alias of a frozen weight such as ``lm_head``)."""
    msd, osd = get_state_dict(model, optimizer)
    if model.lora is not None:
        trainable = {name for name, p in model.named_parameters() if p.requires_grad}
        msd = {k: v for k, v in msd.items() if k in trainable}
    return msd, osd


def _lora_doc(model: ScoredLM) -> dict[str, Any] | None:
    """What a LoRA checkpoint must agree on to be loaded (dropout may change between runs)."""
    return None if model.lora is None else model.lora.model_dump(mode="json", exclude={"dropout"})


def save_checkpoint(
    target: Path,
    *,
    model: ScoredLM,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    state: dict[str, Any],
    extra: dict[str, Any],
) -> Path:
    """Write a complete checkpoint to ``target`` (collective)."""
    try:
        extra_json = json.dumps(extra)
    except TypeError as exc:
        raise ConfigError(
            f"checkpoint extra must be JSON-serialisable (str, number, list, dict): {exc}"
        ) from exc
    rank = dist.get_rank()
    tmp = _prepare_tmp(target, rank)
    msd, osd = _state_dicts(model, optimizer)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp / "state"))
    (tmp / "rng").mkdir(exist_ok=True)
    torch.save(_rng_state(), tmp / "rng" / f"rank{rank}.pt")
    dist.barrier()
    if rank == 0:
        sched = {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"}
        doc = dict(state, world_size=dist.get_world_size(), scheduler=sched, lora=_lora_doc(model),
                   extra=json.loads(extra_json))
        (tmp / STATE_FILE).write_text(json.dumps(doc, indent=1))
        publish_dir(tmp, target)
    dist.barrier()
    return target


def load_checkpoint(
    source: Path,
    *,
    model: ScoredLM,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> dict[str, Any]:
    """Restore model, optimiser, scheduler and RNG from ``source``; return the saved state document."""
    if not (source / STATE_FILE).exists():
        raise TrainerError(
            f"{source} is not a complete checkpoint (no {STATE_FILE}): pass a folder written by "
            "save_checkpoint (find the newest with agentrl.trainer.latest_checkpoint)"
        )
    doc = json.loads((source / STATE_FILE).read_text())
    if doc.get("lora") != _lora_doc(model):
        raise TrainerError(
            f"{source} holds {'LoRA adapters ' + str(doc['lora']) if doc.get('lora') else 'full weights'} but this "
            f"trainer {'has LoRA ' + str(_lora_doc(model)) if model.lora else 'fine-tunes the full model'}: resume "
            "with the trainer.lora settings the checkpoint was written with"
        )
    msd, osd = _state_dicts(model, optimizer)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=str(source / "state"))  # loads in place
    set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd,
                   options=StateDictOptions(strict=model.lora is None))  # LoRA: the base is not in msd
    sched = dict(doc["scheduler"])
    sched["lr_lambdas"] = [None] * len(optimizer.param_groups)
    scheduler.load_state_dict(sched)
    rank = dist.get_rank()
    rng_file = source / "rng" / f"rank{rank}.pt"
    if not rng_file.exists():  # resumed at a larger world size: new ranks start from rank 0's state
        rng_file = source / "rng" / "rank0.pt"
    _set_rng_state(torch.load(rng_file, weights_only=False))
    dist.barrier()
    return doc


def latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    """The most recently completed checkpoint folder directly under ``root`` (None if there is none)."""
    root = Path(root)
    if not root.is_dir():
        return None
    done = [p for p in root.iterdir() if not p.name.startswith(".") and (p / STATE_FILE).exists()]
    return max(done, key=lambda p: (p / STATE_FILE).stat().st_mtime_ns, default=None)


def prune_checkpoints(root: str | os.PathLike[str], keep: int) -> list[Path]:
    """Delete all but the ``keep`` most recent completed checkpoints under ``root`` (rank 0, after a save);
    unfinished ``.partial`` folders are left to the save that owns them. Returns what was deleted."""
    root = Path(root)
    if keep < 1:
        raise ValueError(f"keep must be >= 1 (the checkpoint a resume needs), got {keep}")
    if not root.is_dir():
        return []
    done = sorted((p for p in root.iterdir() if not p.name.startswith(".") and (p / STATE_FILE).exists()),
                  key=lambda p: (p / STATE_FILE).stat().st_mtime_ns)
    old = done[:-keep]
    for p in old:
        shutil.rmtree(p, ignore_errors=True)
    return old


def full_state_dict(model: ScoredLM, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The HF state dict gathered on rank 0 (CPU); empty on other ranks. Tied weights appear once. With LoRA the
    adapters are merged into the base weights, under the base model's names (:func:`agentrl.trainer.lora.merge_lora`;
    the model is not modified). ``dtype``: floating-point tensors come out in it, converted one by one as the
    gathered ones are let go (a whole second copy, then a cast third, is what the publish used to peak at)."""
    raw = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    sd = {k.removeprefix("lm."): v for k, v in raw.items() if isinstance(v, torch.Tensor)}
    del raw
    lm = model.lm
    if getattr(lm.config.get_text_config(), "tie_word_embeddings", False):
        for key in getattr(lm, "_tied_weights_keys", None) or ():  # base-model names (LoRA never targets the head)
            sd.pop(key, None)
    if model.lora is not None and sd:
        from agentrl.trainer.lora import merge_lora

        # no dtype: the trainer's own precision, fp32, as a full fine-tuning's weights (a bf16 base's merge too)
        sd = merge_lora(sd, model.lora.scaling, dtype or torch.float32, consume=True)
    elif dtype is not None:
        for k, v in sd.items():  # replacing values of existing keys while iterating is allowed
            if v.is_floating_point():
                sd[k] = v.to(dtype)
    return sd


def _write_safetensors(sd: dict[str, torch.Tensor], out: Path) -> None:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, v in sd.items():
        nbytes = v.numel() * v.element_size()
        if shards[-1] and size + nbytes > MAX_SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][k] = v.contiguous()
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    index: dict[str, Any] = {
        "metadata": {"total_size": sum(v.numel() * v.element_size() for v in sd.values())},
        "weight_map": {},
    }
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        index["weight_map"].update({k: name for k in shard})
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))


def intact_hf_folder(folder: Path) -> bool:
    """Whether ``folder`` holds a config and safetensors files whose headers parse and whose sizes match them
    (what a crash before the data reached the disk breaks). Reads headers only."""
    files = sorted(folder.glob("*.safetensors"))
    if not (folder / "config.json").is_file() or not files:
        return False
    for f in files:
        try:
            with open(f, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                header = json.loads(fh.read(n))
            end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        except (OSError, ValueError, KeyError, TypeError):
            return False
        if f.stat().st_size != 8 + n + end:
            return False
    return True


def _link_or_copy(src: Path, dst: Path) -> None:
    """Tokenizer files never change between versions: hard-link them (no copy) when on the same filesystem."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def export_hf(model: ScoredLM, source: Path, target: Path, dtype: torch.dtype | None = None, *,
              durable: bool = True) -> Path:
    """Write the current weights as an HF folder: safetensors, config, generation config, tokenizer files.

    Collective: every rank joins the gather; rank 0 writes into a temp folder and renames it to ``target``.
    Non-weight files (tokenizer, chat template, generation config) are copied from the ``source`` folder.
    ``durable=False`` skips the fsync (see :func:`publish_dir`).
    """
    sd = full_state_dict(model, dtype)
    if dist.get_rank() == 0:
        write_hf_folder(sd, model.lm.config, source, target, dtype, durable=durable)
    dist.barrier()
    return target


def write_hf_folder(sd: dict[str, torch.Tensor], config: Any, source: Path, target: Path,
                    dtype: torch.dtype | None = None, *, durable: bool = True) -> Path:
    """Write the state dict ``sd`` (HF names, tied weights once) as an HF folder at ``target``, atomically: the
    model ``config`` (a transformers config), the other files of ``source`` (tokenizer, templates) linked or copied.
    One process, no collective: rank 0 of :func:`export_hf`, or the trainer's weight server writing a snapshot."""
    tmp = partial_path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for f in source.iterdir():
        if f.is_file() and not f.name.endswith(WEIGHT_SUFFIXES) and f.name != "config.json":
            _link_or_copy(f, tmp / f.name)
    if dtype is not None:
        sd = {k: v.to(dtype) if v.is_floating_point() else v for k, v in sd.items()}
    _write_safetensors(sd, tmp)
    config = copy.deepcopy(config)
    config.use_cache = True
    config.dtype = dtype or next((v.dtype for v in sd.values() if v.is_floating_point()), torch.float32)
    config.save_pretrained(str(tmp))
    publish_dir(tmp, target, durable=durable)
    return target
