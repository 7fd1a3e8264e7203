"""LoRA through peft: adapters on the decoder's linear layers, and the merged weights the engines load.

:func:`apply_lora` injects peft's LoRA layers into a loaded model *in place*, before FSDP2 shards it: each targeted
``nn.Linear`` becomes a ``lora.Linear`` holding the frozen original as ``base_layer`` and the trainable
``lora_A.default`` ``[r, in]`` and ``lora_B.default`` ``[out, r]``, all inside the decoder layer FSDP shards as one
unit. Its state dict names follow::

    model.layers.0.self_attn.q_proj.base_layer.weight     W (frozen)
    model.layers.0.self_attn.q_proj.lora_A.default.weight A
    model.layers.0.self_attn.q_proj.lora_B.default.weight B

:func:`merge_lora` turns such a (gathered) state dict into the base model's: ``q_proj.weight = W + s * B A`` with
``s = alpha / r``, ``base_layer.`` dropped, no ``lora_`` tensor left; so SGLang loads it as any full checkpoint
(``/update_weights_from_disk`` or the distributed broadcast) and the training model is never modified to get it.
"""

from __future__ import annotations

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model
from torch import Tensor, nn
from transformers import PreTrainedModel

from agentrl.errors import ConfigError
from agentrl.trainer.config import LoraConfig

ADAPTER = "default"  # peft's name of the one adapter we train


def decoder_linears(lm: PreTrainedModel, layers: list[nn.Module]) -> dict[str, list[str]]:
    """Leaf name -> qualified names of the ``nn.Linear`` modules inside the decoder ``layers`` of ``lm``."""
    inside = {id(m) for layer in layers for m in layer.modules()}
    found: dict[str, list[str]] = {}
    for name, module in lm.named_modules():
        if isinstance(module, nn.Linear) and id(module) in inside:
            found.setdefault(name.rsplit(".", 1)[-1], []).append(name)
    return found


def apply_lora(lm: PreTrainedModel, layers: list[nn.Module], cfg: LoraConfig) -> PeftModel:
    """Inject LoRA layers into ``lm`` (in place) on the linears of the decoder ``layers`` that ``cfg`` names; freeze
    everything else. Returns peft's wrapper, whose ``disable_adapter()`` runs ``lm`` as the base model."""
    linears = decoder_linears(lm, layers)
    wanted = sorted(linears) if cfg.target_modules == "all-linear" else list(cfg.target_modules)
    unknown = [n for n in wanted if n not in linears]
    if unknown or not wanted:
        raise ConfigError(
            f"trainer.lora.target_modules {unknown or wanted} are not linear layers of {type(lm).__name__}'s "
            f"decoder layers: expected some of {sorted(linears)} (or 'all-linear')"
        )
    # qualified names, matched exactly by peft: only the decoder's linears (not a vision tower's q_proj, not lm_head)
    targets = [q for n in wanted for q in linears[n]]
    # lora_alpha is annotated int in peft but used as lora_alpha / r: a float alpha gives that scaling exactly
    peft_cfg = PeftLoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,  # type: ignore[arg-type]
                              target_modules=targets, bias="none", use_rslora=False, init_lora_weights=True)
    return get_peft_model(lm, peft_cfg, adapter_name=ADAPTER)


def merge_lora(sd: dict[str, Tensor], scaling: float, dtype: torch.dtype | None = None, *,
               consume: bool = False) -> dict[str, Tensor]:
    """The base model's state dict from a LoRA model's (see the module docstring): every ``X.base_layer.weight``
    becomes ``X.weight = W + scaling * B @ A`` (computed in fp32 at least), every other ``X.base_layer.P`` becomes
    ``X.P``, the ``lora_`` tensors are dropped. Floating-point tensors come out in ``dtype`` (default: each one's
    own). ``sd`` is not modified unless ``consume``: then each entry leaves it as its result is made, so a gathered
    copy's memory goes while the merged one grows (a publish holds one model's worth, not two)."""
    adapters = {k: v for k, v in sd.items() if ".lora_" in k}  # r rows each: small
    out: dict[str, Tensor] = {}
    for key in list(sd):
        value = sd.pop(key) if consume else sd[key]
        if ".lora_" in key:
            continue
        prefix, sep, leaf = key.rpartition(".base_layer.")
        target = dtype if dtype is not None and value.is_floating_point() else value.dtype
        if sep and leaf == "weight":
            a, b = adapters[f"{prefix}.lora_A.{ADAPTER}.weight"], adapters[f"{prefix}.lora_B.{ADAPTER}.weight"]
            work = torch.promote_types(value.dtype, torch.float32)
            delta = (b.to(work) @ a.to(work)) * scaling
            value = (value.to(work) + delta).to(target)
        else:
            value = value.to(target)
        out[f"{prefix}.{leaf}" if sep else key] = value
    return out
