"""The policy module: a Hugging Face causal LM sharded with FSDP2, scoring only the positions that matter.

:class:`ScoredLM` runs the decoder over every input position but the LM head (a ``[tokens, vocab]`` matmul,
the largest activation of a small model) only at the scored positions, in every layout. It is the FSDP root, so
one pre-forward unshard covers the embeddings, the final norm and the (possibly tied) head.

Memory: the head's fp32 logits cost ``4 * vocab`` bytes per scored token (196 KB for SmolLM2's 49,152 tokens; a
step's 3,000 scored tokens: 0.6 GB, and the log-softmax keeps them for the backward pass). With
``logits_chunk_tokens = C`` the scored positions are taken ``C`` at a time and each chunk's head + log-softmax is
checkpointed (recomputed in the backward pass), so at most one chunk's logits are alive: ``4 * vocab * C`` bytes
plus the softmax's temporaries, at the price of one more head matmul per scored token. Decoder activations are
bounded by activation checkpointing (:func:`activation_bytes_per_token` measures what it would save).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint
from transformers import AutoModelForCausalLM, PreTrainedModel

from agentrl.errors import ConfigError, TrainerError
from agentrl.trainer import lean_activations as lean_activations_
from agentrl.trainer import prefix_attention
from agentrl.trainer.config import LoraConfig, OptimizerConfig
from agentrl.trainer.objectives import entropy_from_logits, entropy_given_lse, token_logprobs_and_lse
from agentrl.trainer.prefix_attention import PrefixAttention

if TYPE_CHECKING:
    from peft import PeftModel

logger = logging.getLogger(__name__)

EntropyMode = Literal["none", "metric", "grad"]


@dataclass(frozen=True, slots=True)
class DistInfo:
    rank: int
    world_size: int
    device: torch.device
    mesh: DeviceMesh
    owns_group: bool  # this process created the default process group and must destroy it


def init_distributed(device: str) -> DistInfo:
    """Join the default process group, creating it if needed (gloo on CPU, NCCL on GPU).

    Without ``torch.distributed`` already initialised and without torchrun's ``WORLD_SIZE``/``MASTER_ADDR``
    environment, a world of one is created on an in-process store (no port is opened).
    """
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device 'cuda' was requested but torch sees no GPU: use device 'cpu' or 'auto'")
    owns = False
    if not dist.is_initialized():
        backend = "nccl" if use_cuda else "gloo"
        if "MASTER_ADDR" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        owns = True
    rank, world = dist.get_rank(), dist.get_world_size()
    if use_cuda:
        local = int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count()))
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
    else:
        dev = torch.device("cpu")
    mesh = init_device_mesh(dev.type, (world,))
    return DistInfo(rank=rank, world_size=world, device=dev, mesh=mesh, owns_group=owns)


class ScoredLM(nn.Module):
    """``forward`` returns the logprob of each target at its scored position (and optionally the entropy).

    ``logits_chunk_tokens``: scored positions per head + log-softmax chunk (None: all at once); see the module doc.
    ``lora``: the adapters' settings when ``lm`` carries peft's LoRA layers (``peft`` is peft's wrapper of ``lm``).
    """

    def __init__(self, lm: PreTrainedModel, logits_chunk_tokens: int | None = None, *,
                 lora: LoraConfig | None = None, peft: PeftModel | None = None, pad_scored_to: int = 1) -> None:
        super().__init__()
        self.lm = lm
        # the head runs on the scored positions padded to a multiple of ``pad_scored_to`` (zero rows, outputs
        # dropped), in chunks of whole multiples, so that its matmuls repeat a few shapes
        # (TrainerConfig.pad_to_multiple_of)
        self.pad_scored_to = pad_scored_to
        self.logits_chunk_tokens = (logits_chunk_tokens if logits_chunk_tokens is None or pad_scored_to == 1
                                    else max(logits_chunk_tokens // pad_scored_to, 1) * pad_scored_to)
        self.lora = lora
        # peft's wrapper holds ``lm`` too: kept out of the module tree (a plain attribute) so that FSDP and the
        # state dict see each parameter once, under ``lm``
        self.__dict__["_peft"] = peft
        text_cfg = lm.config.get_text_config()
        self._softcap: float | None = getattr(text_cfg, "final_logit_softcapping", None)

    def forward(
        self,
        input_ids: Tensor,
        position_ids: Tensor,
        attention_mask: Tensor | None,
        score_index: Tensor,
        targets: Tensor,
        temperature: float = 1.0,
        entropy: EntropyMode = "none",
        prefix_attention: PrefixAttention | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        extra = {} if prefix_attention is None else {"prefix_attention": prefix_attention}
        out = self.lm.get_decoder()(
            input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, use_cache=False, **extra
        )
        hidden = out.last_hidden_state
        h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, score_index)
        n, pad = h.shape[0], -h.shape[0] % self.pad_scored_to
        if pad:  # each row's logprob depends on that row alone: the zero rows change no real one
            h = torch.cat([h, h.new_zeros(pad, h.shape[1])])
            targets = torch.cat([targets, targets.new_zeros(pad)])
        logp, ent = self._chunked(h, targets, temperature, entropy)
        if not pad:
            return logp, ent
        # copies, not views: FSDP2 hooks the root's outputs for its backward, and warns of views (an in-place op on one
        # would drop the hook)
        return logp[:n].clone(), ent[:n].clone() if ent is not None else None

    def _chunked(
        self, h: Tensor, targets: Tensor, temperature: float, entropy: EntropyMode
    ) -> tuple[Tensor, Tensor | None]:
        chunk = self.logits_chunk_tokens
        if chunk is None or h.shape[0] <= chunk:
            return self._score(h, targets, temperature, entropy)
        parts = [
            checkpoint(self._score, hc, tc, temperature, entropy, use_reentrant=False)
            if torch.is_grad_enabled()
            else self._score(hc, tc, temperature, entropy)
            for hc, tc in zip(h.split(chunk), targets.split(chunk))
        ]
        logp = torch.cat([p[0] for p in parts])
        ents = [p[1] for p in parts]
        return logp, torch.cat(ents) if ents[0] is not None else None  # type: ignore[arg-type]

    def adapters_disabled(self) -> AbstractContextManager[None]:
        """Inside: the base model's outputs, LoRA adapters off (peft's ``disable_adapter``); a no-op without LoRA."""
        peft: PeftModel | None = self.__dict__["_peft"]
        return _adapters_off(self, peft) if peft is not None else nullcontext()

    def _score(
        self, h: Tensor, targets: Tensor, temperature: float, entropy: EntropyMode
    ) -> tuple[Tensor, Tensor | None]:
        """Head, softcap, temperature and log-softmax on the hidden states ``h`` of scored positions. The entropy
        metric comes last: a checkpointed chunk's recomputation in the backward pass stops at the last tensor saved
        for it (non-reentrant checkpoint's early stop), so the metric is computed once."""
        logits = self.lm.get_output_embeddings()(h).float()
        if self._softcap:
            logits = torch.tanh(logits / self._softcap) * self._softcap
        if temperature != 1.0:
            logits = logits / temperature  # the entropy below is the tempered distribution's too
        logp, lse = token_logprobs_and_lse(logits, targets)
        ent: Tensor | None = None
        if entropy == "grad":
            ent = entropy_from_logits(logits)
        elif entropy == "metric":
            ent = entropy_given_lse(logits.detach(), lse.detach())
        return logp, ent


def activation_bytes_per_token(lm: PreTrainedModel, tokens: tuple[int, int] = (32, 96)) -> float:
    """Bytes the decoder keeps for the backward pass per input token (all layers), measured: two probe forwards of
    different lengths under autograd's saved-tensor hooks, unique storages summed, the difference divided by the
    difference in length (what does not grow with tokens, such as the weights, cancels). Runs on the unsharded
    model before FSDP wraps it, so every rank measures the same without a collective."""

    def saved(n: int) -> int:
        seen: dict[int, int] = {}

        def pack(t: Tensor) -> Tensor:
            if t.device.type != "meta":
                st = t.untyped_storage()
                seen[st.data_ptr()] = st.nbytes()
            # detached, not the tensor itself: a saved output packed as itself makes a cycle through its own
            # grad_fn that no collector breaks, and the graph kept the whole unsharded model alive (1.6 GB for
            # the demo's model, in every trainer process with activation_checkpointing auto)
            return t.detach()

        ids = torch.zeros((1, n), dtype=torch.long)
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = lm.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state
        del out
        return sum(seen.values())

    a, b = tokens
    return max(saved(b) - saved(a), 0) / (b - a)


def load_lm(path: Path) -> PreTrainedModel:
    if not (path / "config.json").exists():
        raise ConfigError(
            f"model folder {path} has no config.json: expected a local Hugging Face folder "
            "(resolve named models such as 'tiny' with agentrl.models.resolve_model first)"
        )
    prefix_attention.register()
    lm = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                              attn_implementation=prefix_attention.ATTENTION)
    lm.config.use_cache = False
    return lm


def build_policy(
    path: Path,
    info: DistInfo,
    *,
    dtype: str,
    trainable: bool,
    activation_checkpointing: bool | Callable[[PreTrainedModel], bool] = False,
    logits_chunk_tokens: int | None = None,
    lora: LoraConfig | None = None,
    lean_activations: bool = False,
    pad_scored_to: int = 1,
) -> tuple[ScoredLM, bool]:
    """Load an HF causal LM in fp32 (its frozen weights in bf16 when computing in bf16: a reference model, a LoRA
    base), add LoRA adapters if ``lora``
    (only they train then), shard each decoder layer then the root with FSDP2; return it and whether activation checkpointing is on (``activation_checkpointing`` may
    be a rule deciding it from the loaded model, adapters included). ``lean_activations``: the MLPs and RMSNorms of a
    trainable model keep fewer tensors for the backward pass (:mod:`agentrl.trainer.lean_activations`)."""
    lm = load_lm(path)
    if lean_activations and trainable:
        patched = lean_activations_.apply(lm)
        logger.info("lean activations: %d MLPs, %d RMSNorms", patched["mlp"], patched["norm"])
    layer_names = set(getattr(lm, "_no_split_modules", None) or ())
    layers = [m for m in lm.modules() if type(m).__name__ in layer_names]
    if not layers:
        raise TrainerError(
            f"cannot find the decoder layers of {type(lm).__name__} (no module named in _no_split_modules "
            f"{sorted(layer_names)}): this architecture is not supported by the FSDP2 wrapper"
        )
    peft = None
    if lora is not None and trainable:
        from agentrl.trainer.lora import apply_lora  # peft is imported only by LoRA runs

        peft = apply_lora(lm, layers, lora)
    ac = trainable and (activation_checkpointing(lm) if callable(activation_checkpointing)
                        else activation_checkpointing)
    if ac:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lm.train(trainable)
    if not trainable:
        lm.requires_grad_(False)
    if dtype == "bf16":
        # a frozen weight (the KL term's reference model, or a LoRA policy's base) needs no fp32 master copy: kept in
        # bf16 it takes half the RAM and computes the same values (FSDP2 would cast its fp32 copy to bf16 on every
        # forward; it casts none when it already is, and still casts the floating-point inputs by the same policy).
        # FSDP2 wants one dtype among a unit's *trainable* parameters only, so LoRA's fp32 adapters sit beside a bf16
        # base. Parameters only: buffers (the rotary inv_freq) stay fp32, as FSDP2 leaves them in the policy.
        for p in lm.parameters():  # tied weights are one Parameter: cast once, still tied
            if not p.requires_grad:
                p.data = p.data.to(torch.bfloat16)
    wrapper = ScoredLM(lm, logits_chunk_tokens, lora=lora if peft is not None else None, peft=peft,
                       pad_scored_to=pad_scored_to)
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if dtype == "bf16"
        else None
    )
    policy = mp if mp is not None else MixedPrecisionPolicy()  # the default casts nothing
    for layer in layers:
        fully_shard(layer, mesh=info.mesh, mp_policy=policy)
    fully_shard(wrapper, mesh=info.mesh, mp_policy=policy)
    return wrapper, ac


@contextmanager
def _adapters_off(model: nn.Module, peft: PeftModel) -> Iterator[None]:
    """peft's ``disable_adapter()``, but the adapters stay trainable inside. peft also clears their
    ``requires_grad`` there, and FSDP2 fixes each unit's dtypes at its first forward from the parameters trainable
    then: if that forward is a reference pass (the KL term's, adapters off) with a bf16 base beside fp32 adapters, it
    sees two dtypes and no trainable one, keeps none, and the first backward fails to store bf16 gradients in the fp32
    adapters. Reference passes run without gradients, so leaving the flag on changes nothing else."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    with peft.disable_adapter():
        for p in trainable:
            p.requires_grad_(True)
        yield


def lr_lambda(warmup: int, schedule: str, total: int | None, min_ratio: float) -> Callable[[int], float]:
    """The LR multiplier of optimiser update ``u`` (0-based), as documented on OptimizerConfig."""

    def f(u: int) -> float:
        if u < warmup:
            return (u + 1) / (warmup + 1)
        if schedule == "constant" or total is None:
            return 1.0
        p = min(max((u - warmup) / max(total - warmup, 1), 0.0), 1.0)
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * p))

    return f


def make_optimizer(
    module: nn.Module, cfg: OptimizerConfig
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW (fused where torch supports it: ~6x faster steps on CPU) with decay on matrices only."""
    params = [p for p in module.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    try:
        opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, fused=True)
    except (RuntimeError, TypeError) as exc:
        logger.info("fused AdamW unavailable (%s): using the default implementation", exc)
        opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lr_lambda(cfg.warmup_steps, cfg.schedule, cfg.total_steps, cfg.min_lr_ratio)
    )
    return opt, sched
