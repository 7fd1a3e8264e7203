"""Trainer configuration (pydantic v2: it is read from the run's YAML).

``TrainerConfig`` holds everything the :class:`~agentrl.trainer.Trainer` needs: the model and its
:class:`TrainerSettings` (a run's ``trainer:`` section), with the objective in their ``loss`` section
(:class:`LossConfig`) and the optimiser in ``optimizer`` (:class:`OptimizerConfig`).
Unknown keys are rejected so a typo in a YAML file fails loudly.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Advantage = Literal["grpo", "dr_grpo", "rloo"]
LossAgg = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]
Correction = Literal["none", "decoupled", "tis", "icepop"]
Proximal = Literal["recompute", "current"]
KLEstimator = Literal["k1", "k3"]
StalePolicy = Literal["drop", "downweight"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class OptimizerConfig(_Strict):
    """AdamW with linear warm-up, then a constant or cosine schedule, and global-norm gradient clipping.

    The schedule counts optimiser updates (``TrainerConfig.mini_batches`` of them per RL step):
    ``lr(u) = lr * (u + 1) / (warmup_steps + 1)`` for update ``u < warmup_steps`` (0-based); then ``lr``
    (constant) or
    ``lr * (m + (1 - m) * (1 + cos(pi * p)) / 2)`` with ``p = (u - warmup) / (total - warmup)`` clamped to
    [0, 1] and ``m = min_lr_ratio`` (cosine).
    """

    lr: float = Field(default=1e-6, gt=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(default=1e-8, gt=0)
    weight_decay: float = Field(default=0.01, ge=0)  # applied to matrices only, never to norms and biases
    warmup_steps: int = Field(default=0, ge=0)
    schedule: Literal["constant", "cosine"] = "constant"
    total_steps: int | None = Field(default=None, gt=0)
    min_lr_ratio: float = Field(default=0.0, ge=0, le=1)
    grad_clip: float | None = Field(default=1.0, gt=0)  # None: no clipping (the norm is still reported)

    @model_validator(mode="after")
    def _check(self) -> OptimizerConfig:
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas must be in [0, 1), got {self.betas}")
        if self.schedule == "cosine" and self.total_steps is None:
            raise ValueError("schedule 'cosine' needs total_steps (the number of optimiser updates)")
        if self.total_steps is not None and self.warmup_steps > self.total_steps:
            raise ValueError(f"warmup_steps {self.warmup_steps} exceeds total_steps {self.total_steps}")
        return self


class LossConfig(_Strict):
    """The RL objective: advantages, clipped surrogate, off-policy correction, KL, entropy, staleness.

    Per token, with ``r = exp(logp - logp_old)`` and advantage ``A``:
    ``pg = max(-A * r, -A * clip(r, 1 - clip_eps_low, 1 + clip_eps_high))`` (DAPO clip-higher when
    ``clip_eps_high > clip_eps_low``). ``logp_old`` is the behaviour logprob (correction ``none``) or the
    proximal logprob (every other correction). With ``w = exp(logp_prox - logp_behav)``:

    - ``none``: loss ``pg`` (naive PPO against the engine's behaviour policy).
    - ``decoupled`` (AReaL): ``w * pg``; tokens with ``w > decoupled_weight_cap`` are masked (if set).
    - ``tis``: ``min(w, tis_cap) * pg`` (truncated importance sampling).
    - ``icepop``: ``w * pg`` where ``icepop_low <= w <= icepop_high``, masked elsewhere.

    ``proximal``: ``recompute`` runs a no-grad forward pass before the first update (AReaL's recomputed
    proximal policy); ``current`` uses the current logprobs, detached. With one optimiser update per RL step
    (``mini_batches: 1``) the two are the same policy, and no extra pass is run.
    """

    advantage: Advantage = "grpo"
    adv_eps: float = Field(default=1e-6, gt=0)  # GRPO: A = (r - mean) / (std + adv_eps)
    clip_eps_low: float = Field(default=0.2, gt=0, lt=1)
    clip_eps_high: float = Field(default=0.28, gt=0)
    loss_agg: LossAgg = "token_mean"
    # seq_mean_token_sum divides by this constant (Dr.GRPO's, e.g. the generation budget)
    token_sum_norm: float | None = Field(default=None, gt=0)
    correction: Correction = "decoupled"
    proximal: Proximal = "recompute"
    decoupled_weight_cap: float | None = Field(default=5.0, gt=1)
    tis_cap: float = Field(default=2.0, gt=0)
    icepop_low: float = Field(default=0.5, gt=0)
    icepop_high: float = Field(default=5.0, gt=0)
    kl_coef: float = Field(default=0.0, ge=0)
    kl_estimator: KLEstimator = "k3"
    entropy_coef: float = Field(default=0.0, ge=0)
    temperature: float = Field(default=1.0, gt=0)  # logits / temperature, as the engine sampled
    max_staleness: int | None = Field(default=None, ge=0)  # eta: more than eta versions old is stale
    stale_policy: StalePolicy = "drop"
    stale_decay: float = Field(
        default=0.5, gt=0, le=1
    )  # downweight: weight = stale_decay ** (staleness - eta)

    @model_validator(mode="after")
    def _check(self) -> LossConfig:
        if self.icepop_low >= self.icepop_high:
            raise ValueError(f"icepop_low {self.icepop_low} must be below icepop_high {self.icepop_high}")
        if self.token_sum_norm is not None and self.loss_agg != "seq_mean_token_sum":
            raise ValueError("token_sum_norm applies only to loss_agg 'seq_mean_token_sum'")
        return self

    @property
    def needs_proximal_pass(self) -> bool:
        return self.correction != "none" and self.proximal == "recompute"


class LoraConfig(_Strict):
    """LoRA adapters (peft) on linear layers of the decoder; the base weights stay frozen and only the adapters
    train (and sit in the optimiser and in checkpoints).

    Each targeted linear ``y = W x`` becomes ``y = W x + (alpha / r) * B A dropout(x)`` with ``A`` ``[r, in]``
    (random) and ``B`` ``[out, r]`` (zeros: training starts from the base model exactly). Published weights are
    merged, ``W + (alpha / r) * B A``, under the base model's names. ``target_modules``: leaf names of linear
    layers inside the decoder layers (``q_proj``, ``down_proj``, ...), or ``all-linear`` for every one of them.
    ``dropout`` applies in the training forward only; scoring passes (proximal, reference, logprobs) run without.
    """

    r: int = Field(default=16, ge=1)
    alpha: float = Field(default=32.0, gt=0)
    dropout: float = Field(default=0.0, ge=0, lt=1)
    target_modules: Literal["all-linear"] | tuple[str, ...] = "all-linear"

    @model_validator(mode="after")
    def _check(self) -> LoraConfig:
        if isinstance(self.target_modules, tuple):
            if not self.target_modules:
                raise ValueError("target_modules is empty: name linear layers (e.g. [q_proj, v_proj]) or 'all-linear'")
            if len(set(self.target_modules)) != len(self.target_modules):
                raise ValueError(f"target_modules names a layer twice: {list(self.target_modules)}")
        return self

    @property
    def scaling(self) -> float:
        return self.alpha / self.r


class TrainerSettings(_Strict):
    """Everything a trainer needs besides the weights it starts from: precision, batching, optimiser and objective
    (a run's ``trainer:`` section; the run's top-level ``model`` names the weights). ``ref_model`` (default: the
    model) is the frozen reference policy, used only when ``loss.kl_coef > 0``: with ``lora`` and no other
    ``ref_model`` it is the policy with its adapters switched off (no second copy of the model)."""

    ref_model: str | None = None
    lora: LoraConfig | None = None  # None: full fine-tuning
    optimizer: OptimizerConfig = OptimizerConfig()  # frozen: sharing the default instance is safe
    loss: LossConfig = LossConfig()
    # budget of one micro-batch, padding included; decoder activations grow with it (SmolLM2-135M: 1.34 MB a token
    # in fp32), not the step's work: on an fp32 CPU a smaller micro-batch costs next to nothing; AMX's bf16 matmuls
    # run ~2x faster on rows of 1,024+ tokens than on ~576 (the demo's step 1.22x, +2-3 GB; docs/results.md)
    micro_batch_tokens: int = Field(default=8192, gt=0)
    # shared_prefix: a group's prompt runs once for all its responses (agentrl.trainer.shared_prefix)
    layout: Literal["packed", "padded", "shared_prefix"] = "packed"
    mini_batches: int = Field(
        default=1, ge=1
    )  # optimiser updates per rl_step (the batch is split in this many)
    # each micro-batch's rows padded to a multiple of this many tokens, so that micro-batches repeat a few shapes:
    # on a CPU in bf16 oneDNN compiles and keeps (up to 1,024) kernels per matmul shape, and a run whose every
    # micro-batch had a new width grew by them (docs/results.md); auto: 64 for bf16 on a CPU, else 1 (no padding)
    pad_to_multiple_of: Literal["auto"] | Annotated[int, Field(ge=1)] = "auto"
    # bf16: bf16 compute, fp32 master weights and reductions; auto: bf16 only where this device multiplies bf16
    # fast (agentrl.hardware: AMX/AVX512-BF16 CPUs measured, Ampere+ GPUs), fp32 elsewhere
    dtype: Literal["auto", "fp32", "bf16"] = "auto"
    # recompute each decoder layer in the backward pass instead of keeping its activations; auto: for each
    # micro-batch whose activations (bytes per token measured at start-up, agentrl.trainer.model.activation_bytes_per_token,
    # x its tokens, padding included) would exceed activation_memory_gb, on in as few layers as bring them under it
    # (Trainer.layers_to_checkpoint), off for the others
    activation_checkpointing: bool | Literal["auto"] = "auto"
    activation_memory_gb: float = Field(default=2.0, gt=0)
    # the gated MLPs and RMSNorms keep fewer tensors for the backward pass and recompute their element-wise ops
    # there (agentrl.trainer.lean_activations): SmolLM2-135M's decoder keeps 0.83 MB a token instead of 1.34 in
    # fp32, for next to no CPU; false: the model's own forward
    lean_activations: bool = True
    # each FSDP unit's weights stay gathered (cast to the compute dtype) through a step, from their first forward to
    # the step's end: no gather and cast for every micro-batch's forward, recomputation and backward pass (gradients
    # are still reduced into the shards after each backward). Costs one copy of the weights in the compute dtype for
    # the step. auto: on for one rank in bf16. Off by default: the demo's bf16 step alone on an AMX Xeon took 18.5 s
    # instead of 22.2 (+0.16-0.29 GB; fp32: 2 %), but in the demo, with SGLang decoding on the other core, two runs
    # with it computed a median 39.0 and 30.4 s a step where four without it computed 28.3-31.6 (docs/results.md)
    keep_gathered: bool | Literal["auto"] = False
    # scored positions per LM-head + log-softmax chunk (each chunk recomputed in the backward pass): at most
    # 4 * vocab * logits_chunk_tokens bytes of logits alive at once; null: all of a micro-batch's at once
    logits_chunk_tokens: int | None = Field(default=1024, gt=0)
    # bf16 on a CPU: attention over at most this many keys computed in fp32, where this CPU's bf16 attention kernel
    # is the slower (auto: measured at the trainer's start on rank 0; 0: never). agentrl.trainer.sdpa_precision
    attention_fp32_max_keys: Literal["auto"] | Annotated[int, Field(ge=0)] = "auto"
    # CPU (glibc) heap: "never" (the default) serves every tensor from the heap and reuses freed memory without
    # page faults (RSS stays at its peak); a number: tensors of this many KiB or more get their own mapping,
    # returned to the OS when freed (1024: ~0.2 GB lower peak over RL steps, 1.2 GB over the demo's SFT then RL
    # steps; a page fault per 4 KiB of every large tensor: a quarter to a third more CPU a step); 0: glibc's default
    # (a threshold that rises to 32 MiB). Not with malloc: jemalloc (a number makes auto choose glibc). agentrl.heap
    mmap_threshold_kb: Literal["never"] | Annotated[int, Field(ge=0, le=32768)] = "never"
    # the trainer ranks' allocator: jemalloc, preloaded into each rank's process at its start (Ray mode; its library
    # from Ray's wheel), or glibc (shaped by mmap_threshold_kb). jemalloc levels off where glibc's heap fragments
    # (the demo's trainer: -1.2 GB in fp32; in bf16 5.4 GB after 10 RL steps where glibc's was 8.8 and growing) for
    # 6-10 % more CPU a step (a Xeon; 1.3x the step on an AVX2 EPYC: page faults). auto (the default): jemalloc for
    # CPU trainers in Ray mode where the library is found and mmap_threshold_kb is left at never, but glibc for an
    # fp32 full fine-tuning trainer on a machine with 16 GiB or more (fp32's glibc heap levels off); else glibc;
    # the controller logs the choice. agentrl.heap
    malloc: Literal["auto", "glibc", "jemalloc"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    num_threads: int | None = Field(
        default=None, ge=1
    )  # torch intra-op threads of this process (None: leave as is)
    seed: int = 0

    @model_validator(mode="after")
    def _heap_setting_fits_allocator(self) -> TrainerSettings:
        if self.malloc == "jemalloc" and self.mmap_threshold_kb != "never":
            raise ValueError(f"mmap_threshold_kb {self.mmap_threshold_kb} shapes glibc's heap, which serves nothing "
                             "with malloc: jemalloc: leave it unset, or set malloc: glibc")
        return self

    def for_model(self, model: str) -> TrainerConfig:
        """These settings for the trainer of ``model``."""
        return TrainerConfig(model=model, **dict(self))


class TrainerConfig(TrainerSettings):
    """One trainer process group: ``model``, a local Hugging Face folder (resolve named models such as ``tiny``
    with :func:`agentrl.models.resolve_model` first), and its settings."""

    model: str


class WeightSyncSettings(_Strict):
    """How each published weight version reaches the SGLang servers (a run's ``weight_sync:`` section; the shorthand
    ``weight_sync: distributed`` sets the mode only).

    ``disk``: the trainer writes ``runs/<name>/weights/v<N>/`` and the servers load it (``/update_weights_from_disk``):
    needs a filesystem both sides see. ``distributed``: no shared filesystem; the trainer keeps the newest weights in
    memory (one CPU copy on rank 0, in the engine's dtype) and broadcasts them over a process group it forms with
    the servers per update (:mod:`agentrl.weight_sync`); a failed broadcast is tried ``attempts`` times with a new
    group, then falls back to disk when ``fallback: disk`` and the folder is readable on the rollout's node.
    ``tensor``: the servers on the trainer's host; the same snapshot, in shared memory (``/dev/shm``), and each
    server loads it from there (SGLang's ``/update_weights_from_tensor``): no file and no socket carries the
    weights. Same attempts, timeout and fallback as ``distributed``."""

    mode: Literal["disk", "distributed", "tensor"] = "disk"
    backend: Literal["auto", "gloo", "nccl"] = "auto"  # auto: nccl when the trainer runs on CUDA, else gloo
    bucket_mb: float = Field(default=512.0, gt=0)  # one broadcast carries at most this many MiB of one dtype
    timeout_s: float = Field(default=120.0, gt=0)  # every step of a broadcast (group formation, each bucket) or load
    # what the servers connect to (the trainer's rank-0 node); null: this node's address toward the Redis server
    address: str | None = None
    attempts: int = Field(default=2, ge=1)  # broadcasts tried (each with a fresh group) before the fallback
    fallback: Literal["disk", "none"] = "disk"

    @model_validator(mode="before")
    @classmethod
    def _mode_shorthand(cls, value: object) -> object:
        return {"mode": value} if isinstance(value, str) else value
