"""The FSDP2 trainer: RL steps with off-policy corrections, SFT steps, checkpoints and HF export.

SPMD: every rank constructs a :class:`Trainer` and calls the same methods with the same global batch
(e.g. rank 0 reads the queue and shares the batch with :func:`broadcast_object`); the trainer splits the
work between ranks itself. One ``rl_step`` = a proximal (and reference) no-grad pass if the objective needs
it, then ``mini_batches`` optimiser updates, each accumulating gradients over micro-batches under the token
budget.
"""

from __future__ import annotations

import gc
import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import fields, replace
from pathlib import Path
from typing import Any, Literal, Self, TypeVar, cast

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.fsdp import FSDPModule
from transformers import PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer

from agentrl import heap
from agentrl.errors import TrainerError
from agentrl.hardware import resolve_dtype
from agentrl.trainer import sdpa_precision, storage
from agentrl.trainer.base import SFTMetrics, StepMetrics, TokenTrace
from agentrl.trainer.collate import (
    MicroBatch,
    PreparedBatch,
    plan_micro_batches,
    prepare_rl,
    prepare_sft,
    split_mini_batches,
)
from agentrl.trainer.config import TrainerConfig
from agentrl.trainer.model import (
    DistInfo,
    EntropyMode,
    ScoredLM,
    activation_bytes_per_token,
    build_policy,
    init_distributed,
    make_optimizer,
)
from agentrl.trainer.objectives import TokenStats, policy_loss, sft_loss
from agentrl.types import Trajectory

logger = logging.getLogger(__name__)
T = TypeVar("T")
LossFn = Callable[[int, MicroBatch], tuple[Tensor, TokenStats | None]]


@contextmanager
def process_group(device: str = "auto") -> Iterator[DistInfo]:
    """The default process group of one rank's whole job (torchrun's environment: ``MASTER_ADDR``, ``WORLD_SIZE``,
    ``RANK``; without it a world of one), destroyed at the end if it was created here. Inside it,
    :func:`broadcast_object` works before any :class:`Trainer` exists, and successive trainers (SFT, then RL)
    share the group instead of each creating and destroying its own."""
    info = init_distributed(device)
    try:
        yield info
    finally:
        if info.owns_group and dist.is_initialized():
            dist.destroy_process_group()


def broadcast_object(obj: T | None, src: int = 0) -> T:
    """Send a picklable object (e.g. the list of trajectories read by rank 0) to every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        if obj is None:
            raise TrainerError("broadcast_object: the source rank passed None; it must pass the object")
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]  # type: ignore[return-value]


class Trainer:
    """FSDP2 policy trainer. Use as a context manager or call :meth:`close`.

    Attributes ``step`` (trainer steps done) and ``weight_version`` (version of the current weights) are
    saved in checkpoints; ``rank`` and ``world_size`` describe the process group; ``checkpointing`` says whether
    activation checkpointing is on (True, False, or ``"auto"``: per micro-batch, by the measured budget).
    """

    def __init__(self, config: TrainerConfig) -> None:
        self.config = config
        runtime_flag = hasattr(FSDPModule, "set_reshard_after_forward")  # torch >= 2.7
        if config.keep_gathered is True and not runtime_flag:
            raise TrainerError(f"trainer.keep_gathered needs torch >= 2.7 (FSDPModule.set_reshard_after_forward); "
                               f"this is torch {torch.__version__}: set it to auto or false, or upgrade torch")
        # called before every forward pass over a micro-batch (the launcher's CoreBorrower widens or narrows the
        # cores this process computes on there: agentrl.launcher.cores)
        self.before_micro_batch: Callable[[], None] | None = None
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        heap.configure(config.mmap_threshold_kb, config.malloc)  # process-wide, before any model is allocated
        torch.manual_seed(config.seed)
        self._dist: DistInfo = init_distributed(config.device)
        self._source = Path(config.model)
        # every rank must run the same dtype: rank 0's choice holds (a measurement near the threshold could differ)
        self.precision = broadcast_object(resolve_dtype(config.dtype, self._dist.device.type)
                                          if self._dist.rank == 0 else None)
        if config.dtype == "auto":
            logger.info("trainer dtype auto -> %s (%s)", self.precision.dtype, self.precision.reason)
        self.pad_to_multiple_of = (config.pad_to_multiple_of if config.pad_to_multiple_of != "auto"
                                   else 64 if self._bf16_cpu() else 1)
        try:
            self._act_bytes_per_token: float | None = None  # measured when activation_checkpointing is auto
            self._policy, ac_on = build_policy(
                self._source,
                self._dist,
                dtype=self.precision.dtype,
                trainable=True,
                activation_checkpointing=self._checkpointing_rule(),
                logits_chunk_tokens=config.logits_chunk_tokens,
                lora=config.lora,
                lean_activations=config.lean_activations,
                pad_scored_to=self.pad_to_multiple_of,
            )
            # kl_coef 0: no reference pass; LoRA with the model itself as reference: the policy, adapters off
            ref_path = Path(config.ref_model or config.model)
            self._ref_is_base = config.loss.kl_coef > 0 and config.lora is not None and ref_path == self._source
            self._ref: ScoredLM | None = None
            if config.loss.kl_coef > 0 and not self._ref_is_base:
                self._ref, _ = build_policy(ref_path, self._dist, dtype=self.precision.dtype, trainable=False,
                                            logits_chunk_tokens=config.logits_chunk_tokens,
                                            pad_scored_to=self.pad_to_multiple_of)
            # HF's layers recompute themselves when their flag is set (in training mode): auto flips it per micro-batch
            self._ckpt_layers = [m for m in self._policy.modules()
                                 if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing]
            self.checkpointing: bool | Literal["auto"] = "auto" if self._act_bytes_per_token is not None else ac_on
        except BaseException:
            if self._dist.owns_group and dist.is_initialized():
                dist.destroy_process_group()
            raise
        # auto: one rank, mixed precision (each gather casts every weight to bf16 there; in fp32 it is a copy, and
        # keeping them saved 2 % of the demo's step for +0.33 GB: docs/results.md)
        self.keep_gathered = (config.keep_gathered if config.keep_gathered != "auto"
                              else runtime_flag and self.world_size == 1 and self.precision.dtype == "bf16")
        if self.keep_gathered and self.rank == 0:
            logger.info("trainer weights kept gathered through each step (keep_gathered %s)", config.keep_gathered)
        # fixed here, before any forward, for the trainer's life: every pass over a shape takes one path
        self.attention_fp32_max_keys = self._attention_limit()
        self._optimizer, self._scheduler = make_optimizer(self._policy, config.optimizer)
        text_cfg = self._policy.lm.config.get_text_config()
        self._pad_id = int(getattr(text_cfg, "pad_token_id", None) or 0)
        self.step = 0
        self.weight_version = 0
        self._closed = False

    def _attention_limit(self) -> int:
        """The key length up to which bf16 attention runs in fp32 (:mod:`agentrl.trainer.sdpa_precision`), set for
        this process: ``attention_fp32_max_keys`` as given, or measured on rank 0 (``auto``; every rank takes its
        value); 0 unless the trainer computes in bf16 on a CPU."""
        setting = self.config.attention_fp32_max_keys
        if not self._bf16_cpu():
            keys = 0
        elif setting != "auto":
            keys = setting
        else:
            cfg = self._policy.lm.config.get_text_config()
            heads = int(cfg.num_attention_heads)
            kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
            dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
            keys = broadcast_object(sdpa_precision.measure_limit(heads, kv_heads, dim) if self.rank == 0 else None)
        sdpa_precision.set_limit(keys)
        return keys

    def _bf16_cpu(self) -> bool:
        return self.precision.dtype == "bf16" and self._dist.device.type == "cpu"

    def _checkpointing_rule(self) -> bool | Callable[[PreTrainedModel], bool]:
        """``activation_checkpointing`` as given, or for ``auto`` a rule that measures the decoder's activation bytes
        per token (x 1/2 in bf16) and installs checkpointing, which :meth:`_forward` then switches on, in as few
        decoder layers as it takes, for the micro-batches whose ``tokens x bytes per token`` exceed
        ``activation_memory_gb`` (padding counted: it is computed too). A micro-batch under the budget pays no
        recomputation; one over it (a long unit or sequence gets a micro-batch of its own, whatever
        ``micro_batch_tokens`` says) is bounded anyway."""
        setting = self.config.activation_checkpointing
        if setting != "auto":
            return bool(setting)
        scale = 0.5 if self.precision.dtype == "bf16" else 1.0

        def rule(lm: PreTrainedModel) -> bool:
            self._act_bytes_per_token = activation_bytes_per_token(lm) * scale
            logger.info("activation checkpointing auto: %.2f MB of activations per token; micro-batches over %d "
                        "tokens recompute as many decoder layers as bring them under activation_memory_gb %.2f",
                        self._act_bytes_per_token / 1e6, self._act_token_limit(), self.config.activation_memory_gb)
            return True

        return rule

    def _act_token_limit(self) -> int:
        assert self._act_bytes_per_token is not None
        return int(self.config.activation_memory_gb * 1e9 / max(self._act_bytes_per_token, 1.0))

    def layers_to_checkpoint(self, tokens: int) -> int:
        """``auto``: the fewest decoder layers whose recomputation brings a micro-batch of ``tokens`` under
        ``activation_memory_gb``. Each layer holds an equal share of the activations (the layers are alike); a
        checkpointed one keeps only its input (``hidden`` values a token, under 1 % of a layer's share here:
        not counted). 0 for a micro-batch under the budget, all of them for one over it by a layer's whole share
        or more each. Recomputation costs a forward of each such layer: a budget between none and all of a
        micro-batch's activations pays for part of the layers, not all."""
        if self._act_bytes_per_token is None:
            return len(self._ckpt_layers)
        layers = len(self._ckpt_layers)
        need = tokens * self._act_bytes_per_token
        excess = need - self.config.activation_memory_gb * 1e9
        if excess <= 0 or layers == 0:
            return 0
        return min(layers, math.ceil(layers * excess / need - 1e-9))  # (the epsilon: 15.000000000000002 is 15)

    def _switch_checkpointing(self, tokens: int) -> None:
        """``auto``: checkpoint the first :meth:`layers_to_checkpoint` layers for this micro-batch, the rest not."""
        if self._act_bytes_per_token is None:
            return
        n = self.layers_to_checkpoint(tokens)
        for i, layer in enumerate(self._ckpt_layers):
            layer.gradient_checkpointing = i < n

    @property
    def rank(self) -> int:
        return self._dist.rank

    @property
    def device(self) -> torch.device:
        return self._dist.device

    @property
    def world_size(self) -> int:
        return self._dist.world_size

    @property
    def has_reference(self) -> bool:
        """Whether steps compute the reference policy's logprobs (for the KL term)."""
        return self._ref is not None or self._ref_is_base

    # ---- steps -------------------------------------------------------------------------------------------

    def rl_step(self, trajectories: Sequence[Trajectory], *, current_version: int) -> StepMetrics:
        """One RL step on the global batch (same list on every rank); leaves ``weight_version = v + 1``."""
        t0 = time.perf_counter()
        cfg = self.config.loss
        prep = prepare_rl(trajectories, current_version=current_version, cfg=cfg)
        plans = [
            self._plan(mini, cfg.loss_agg, cfg.token_sum_norm)
            for mini in split_mini_batches(prep.samples, self.config.mini_batches)
        ]
        # With a single update the proximal policy IS the current one: its logprobs come with the forward.
        with self._gathered(self._policy):
            prox = (
                [[self._logprobs(self._policy, mb) for mb in plan] for plan in plans]
                if cfg.needs_proximal_pass and len(plans) > 1
                else None
            )
        with self._gathered(self._ref or self._policy):
            ref = [[self._ref_logprobs(mb) for mb in plan] for plan in plans] if self.has_reference else None
        entropy: EntropyMode = "grad" if cfg.entropy_coef > 0 else "metric"
        sums, maxes, norms, skipped = [], [], [], not plans
        for i, plan in enumerate(plans):

            def loss_fn(j: int, mb: MicroBatch, i: int = i) -> tuple[Tensor, TokenStats | None]:
                logp, ent = self._forward(self._policy, mb, entropy)
                loss, _, stats = policy_loss(
                    cfg,
                    logp=logp,
                    behavior_logp=mb.behavior_logprobs,
                    advantages=mb.advantages,
                    weights=mb.weights,
                    proximal_logp=prox[i][j] if prox else None,
                    ref_logp=ref[i][j] if ref else None,
                    entropy=ent,
                )
                return loss, stats

            s, m, norm, ok = self._update(plan, loss_fn)
            sums.append(s)
            maxes.append(m)
            norms.append(norm)
            skipped = skipped or not ok
        self.step += 1
        self.weight_version = current_version + 1
        return self._rl_metrics(prep, sums, maxes, norms, skipped, time.perf_counter() - t0)

    def sft_step(self, batch: Sequence[TokenTrace]) -> SFTMetrics:
        """One optimiser update of masked next-token NLL (token mean over the global batch)."""
        t0 = time.perf_counter()
        prep = prepare_sft(batch)
        plan = self._plan(list(prep.samples), "token_mean", None)

        def loss_fn(j: int, mb: MicroBatch) -> tuple[Tensor, TokenStats | None]:
            logp, _ = self._forward(self._policy, mb, "none")
            return sft_loss(logp, mb.weights), None

        s, _, norm, ok = self._update(plan, loss_fn) if prep.samples else (torch.zeros(9), None, 0.0, False)
        self.step += 1
        return SFTMetrics(
            step=self.step,
            loss=float(s[0]),
            grad_norm=norm,
            lr=self._lr(),
            tokens=prep.tokens,
            model_tokens=prep.model_tokens,
            num_sequences=len(prep.samples),
            skipped=not ok,
            time_s=time.perf_counter() - t0,
        )

    @torch.no_grad()
    def logprobs(self, batch: Sequence[TokenTrace]) -> list[Tensor]:
        """Per-token logprobs of the current policy (collective; same batch on every rank).

        One fp32 tensor per trace, aligned with ``token_ids``: the logprob of token t (given tokens < t) where
        ``loss_mask[t] == 1``, 0.0 elsewhere, as ``Trajectory.behavior_logprobs`` holds the engine's.
        """
        prep = prepare_sft(batch)
        out = [torch.zeros(len(t.token_ids)) for t in batch]
        source = {s.index: s for s in prep.samples}
        found: list[tuple[int, Tensor, Tensor]] = []
        with self._gathered(self._policy):
            for mb in self._plan(list(prep.samples), "token_mean", None):
                # a dummy micro-batch (this rank holds fewer than another) still runs its forward: FSDP's gathers in
                # it are collectives the other ranks' forwards wait for; it scores nothing
                logp = self._logprobs(self._policy, mb).cpu()
                if mb.is_dummy:
                    continue
                for idx in mb.seq_index.unique().tolist():
                    sel = (mb.seq_index == idx).cpu()
                    s = source[idx]
                    found.append((s.source, s.score_pos + 1, logp[sel]))
        if self.world_size > 1:
            parts: list[Any] = [None] * self.world_size
            dist.all_gather_object(parts, found)
            found = [x for part in parts for x in part]
        for src, pos, vals in found:
            out[src][pos] = vals
        return out

    # ---- persistence ---------------------------------------------------------------------------------------

    def save_checkpoint(self, path: str | Path, extra: dict[str, Any] | None = None) -> Path:
        """Atomically write model, optimiser, scheduler, RNG, step, version and ``extra`` (JSON)."""
        state = {"step": self.step, "weight_version": self.weight_version,
                 # only where it means something: a bf16 trainer on a CPU (elsewhere it is 0 by construction)
                 "attention_fp32_max_keys": self.attention_fp32_max_keys if self._bf16_cpu() else None}
        return storage.save_checkpoint(
            Path(path),
            model=self._policy,
            optimizer=self._optimizer,
            scheduler=self._scheduler,
            state=state,
            extra=extra or {},
        )

    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        """Restore everything :meth:`save_checkpoint` wrote; return its ``extra`` dict."""
        doc = storage.load_checkpoint(
            Path(path), model=self._policy, optimizer=self._optimizer, scheduler=self._scheduler
        )
        self.step = int(doc["step"])
        self.weight_version = int(doc["weight_version"])
        saved = doc.get("attention_fp32_max_keys")
        if saved is not None and self.config.attention_fp32_max_keys == "auto" and self._bf16_cpu():
            # a resumed run keeps the path its steps so far took, not what this start happened to measure
            if saved != self.attention_fp32_max_keys:
                logger.info("bf16 attention in fp32 up to %d keys, as before the checkpoint (measured now: %d)",
                            saved, self.attention_fp32_max_keys)
            self.attention_fp32_max_keys = int(saved)
            sdpa_precision.set_limit(self.attention_fp32_max_keys)
        return dict(doc.get("extra", {}))

    def export_hf(self, path: str | Path, dtype: torch.dtype | None = None, *, durable: bool = True) -> Path:
        """Atomically write the current weights as an HF folder (safetensors, config, tokenizer files);
        ``durable=False`` skips the fsync (for versions a checkpoint can re-create)."""
        return storage.export_hf(self._policy, self._source, Path(path), dtype, durable=durable)

    def full_state_dict(self, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
        """The current weights with their HF names, gathered on rank 0 (CPU), floating-point ones in ``dtype`` if
        given; empty on other ranks. Collective."""
        return storage.full_state_dict(self._policy, dtype)

    def write_hf(self, sd: dict[str, Tensor], path: str | Path, dtype: torch.dtype | None = None, *,
                 durable: bool = False) -> Path:
        """Write ``sd`` (from :meth:`full_state_dict`, maybe of an earlier version) as an HF folder, atomically;
        ``durable`` fsyncs it. Not collective: any one rank, any thread."""
        return storage.write_hf_folder(sd, self._policy.lm.config, self._source, Path(path), dtype, durable=durable)

    def close(self) -> None:
        """Free the model and destroy the process group if this trainer created it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        # every reference to the models' modules goes (the layers listed for activation checkpointing too: kept, they
        # held the whole policy alive, 1.7 GB for the demo's model, through the RL trainer that follows SFT in the
        # same process), then the cycles among them (modules, FSDP2's hooks) are collected now, not at some later gc
        del self._policy, self._ref, self._optimizer, self._scheduler, self._ckpt_layers
        gc.collect()
        if self._dist.owns_group and dist.is_initialized():
            dist.destroy_process_group()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals -----------------------------------------------------------------------------------------

    def _plan(self, samples: Sequence[Any], mode: Any, norm: float | None) -> list[MicroBatch]:
        mbs = plan_micro_batches(
            samples,
            mode=mode,
            token_budget=self.config.micro_batch_tokens,
            layout=self.config.layout,
            rank=self.rank,
            world_size=self.world_size,
            token_sum_norm=norm,
            pad_id=self._pad_id,
            pad_to_multiple_of=self.pad_to_multiple_of,
        )
        return [self._to_device(mb) for mb in mbs]

    def _to_device(self, mb: MicroBatch) -> MicroBatch:
        dev = self._dist.device
        if dev.type == "cpu":
            return mb
        moved: dict[str, Any] = {
            f.name: v.to(dev) for f in fields(mb) if isinstance(v := getattr(mb, f.name), Tensor)
        }
        if mb.prefix_attention is not None:
            moved["prefix_attention"] = mb.prefix_attention.to(dev)
        return replace(mb, **moved)

    def _forward(
        self, module: ScoredLM, mb: MicroBatch, entropy: EntropyMode
    ) -> tuple[Tensor, Tensor | None]:
        if self.before_micro_batch is not None:
            self.before_micro_batch()
        if module is self._policy and torch.is_grad_enabled():
            self._switch_checkpointing(mb.input_ids.numel())
        return module(
            mb.input_ids,
            mb.position_ids,
            mb.attention_mask,
            mb.score_index,
            mb.targets,
            self.config.loss.temperature,
            entropy,
            mb.prefix_attention,
        )

    @torch.no_grad()
    def _logprobs(self, module: ScoredLM, mb: MicroBatch) -> Tensor:
        """A scoring pass: no gradients, no dropout (LoRA's, the model's), then back to the module's mode."""
        training = module.training
        module.train(False)
        try:
            return self._forward(module, mb, "none")[0]
        finally:
            module.train(training)

    def _ref_logprobs(self, mb: MicroBatch) -> Tensor:
        if self._ref is not None:
            return self._logprobs(self._ref, mb)
        with self._policy.adapters_disabled():
            return self._logprobs(self._policy, mb)

    @contextmanager
    def _gathered(self, model: ScoredLM) -> Iterator[None]:
        """With ``keep_gathered``: ``model``'s units are not resharded after their forward (the decoder layers; FSDP2
        never reshards the root there) nor after their backward inside the block, so later passes of the block reuse
        the gathered, cast weights (gradients are still reduced into the shards after each backward: accumulating
        them unsharded held +0.25 GB, no faster); all are freed at its end (before an optimiser step changes the
        shards)."""
        if not self.keep_gathered:
            yield
            return
        root = cast(FSDPModule, model)
        layers = [cast(FSDPModule, m) for m in model.modules() if isinstance(m, FSDPModule) and m is not model]
        for unit in layers:
            unit.set_reshard_after_forward(False, recurse=False)
        root.set_reshard_after_backward(False)
        try:
            yield
        finally:
            for unit in layers:
                unit.set_reshard_after_forward(True, recurse=False)
            root.set_reshard_after_backward(True)
            for unit in (root, *layers):
                unit.reshard()

    def _update(self, plan: list[MicroBatch], loss_fn: LossFn) -> tuple[Tensor, Tensor, float, bool]:
        """Accumulate gradients over ``plan``, clip, step; return reduced (sums, maxima), norm, applied."""
        self._optimizer.zero_grad(set_to_none=True)
        sums = torch.zeros(9, dtype=torch.float64)
        maxes = torch.full((2,), -math.inf, dtype=torch.float64)
        with self._gathered(self._policy):
            for j, mb in enumerate(plan):
                loss, stats = loss_fn(j, mb)
                # FSDP averages gradients over ranks; the weights hold global normalisers already: undo it.
                (loss * self.world_size).backward()
                sums[0] += loss.detach().double().cpu()
                if stats is not None:
                    s, m = stats.vectors()
                    sums[1:] += s.cpu()
                    maxes = torch.maximum(maxes, m.cpu())
        if self.world_size > 1:  # on the device: NCCL reduces GPU tensors only
            dev = self._dist.device
            sums, maxes = sums.to(dev), maxes.to(dev)
            dist.all_reduce(sums)
            dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
            sums, maxes = sums.cpu(), maxes.cpu()
        params = [p for p in self._policy.parameters() if p.requires_grad]
        clip = self.config.optimizer.grad_clip
        norm_t = torch.nn.utils.clip_grad_norm_(params, max_norm=clip if clip is not None else math.inf)
        norm = float(norm_t.full_tensor() if hasattr(norm_t, "full_tensor") else norm_t)
        if not math.isfinite(norm):
            logger.warning("gradient norm is %s at step %d: update skipped", norm, self.step + 1)
            self._optimizer.zero_grad(set_to_none=True)
            return sums, maxes, norm, False
        self._optimizer.step()
        self._scheduler.step()
        return sums, maxes, norm, True

    def _lr(self) -> float:
        return float(self._optimizer.param_groups[0]["lr"])

    def _rl_metrics(
        self,
        prep: PreparedBatch,
        sums: list[Tensor],
        maxes: list[Tensor],
        norms: list[float],
        skipped: bool,
        elapsed: float,
    ) -> StepMetrics:
        n = len(sums)
        tot = torch.stack(sums).sum(0) if sums else torch.zeros(9, dtype=torch.float64)
        mx = torch.stack(maxes).max(0).values if maxes else torch.full((2,), -math.inf, dtype=torch.float64)
        loss, (tokens, clipped, masked, w_sum, kl_sum, ent_sum, bkl_sum, pg) = tot[0] / max(n, 1), tot[1:]
        per = 1.0 / max(float(tokens), 1.0)
        return StepMetrics(
            step=self.step,
            weight_version=self.weight_version,
            loss=float(loss),
            pg_loss=float(pg) / max(n, 1),
            grad_norm=sum(norms) / max(n, 1),
            lr=self._lr(),
            clip_frac=float(clipped) * per,
            kl=float(kl_sum) * per if self.has_reference else None,
            entropy=float(ent_sum) * per,
            is_weight_mean=float(w_sum) * per,
            is_weight_min=-float(mx[1]) if tokens else math.nan,
            is_weight_max=float(mx[0]) if tokens else math.nan,
            masked_frac=float(masked) * per,
            behav_kl=float(bkl_sum) * per,
            staleness_mean=prep.staleness_mean,
            staleness_max=prep.staleness_max,
            reward_mean=prep.reward_mean,
            tokens=prep.tokens,
            model_tokens=prep.model_tokens,
            num_trajectories=len(prep.samples),
            dropped_stale=prep.dropped_stale,
            downweighted_stale=prep.downweighted_stale,
            dropped_invalid=prep.dropped_invalid,
            skipped=skipped,
            time_s=elapsed,
        )
