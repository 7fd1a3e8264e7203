"""The RL objectives as pure functions on tensors (no model, no distribution, no config reads).

Tokens are flat: every per-token tensor is ``[N]`` over the scored tokens of a batch. A token contributes
exactly ``weights[i] * token_loss[i]`` to the loss; ``weights[i] == 0`` means the token contributes nothing —
not even a NaN from garbage values at that position (``torch.where`` guards every masked product).

Conventions (``A`` advantage, ``logp`` current, ``logp_old`` the policy the PPO ratio is taken against):

- ratio ``r = exp(clamp(logp - logp_old, -20, 20))``
- PPO clipped surrogate (DAPO clip-higher): ``pg = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))``;
  a token is *clipped* when the second term is strictly larger.
- behaviour weight ``w = exp(clamp(logp_prox - logp_behav, max=20))``, detached; per correction
  ``none``: 1; ``decoupled``: ``w``, 0 where ``w > cap``; ``tis``: ``min(w, cap)``;
  ``icepop``: ``w`` where ``low <= w <= high``, 0 elsewhere.
- KL to the reference: ``k1 = logp - logp_ref``; ``k3 = exp(d) - d - 1`` with ``d = logp_ref - logp``,
  clamped at 10 (the low-variance estimator).
- token loss ``= weight * pg + kl_coef * kl - entropy_coef * entropy``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from agentrl.errors import ConfigError
from agentrl.trainer.config import Advantage, Correction, KLEstimator, LossAgg, LossConfig

LOG_RATIO_CLAMP = 20.0
K3_CLAMP = 10.0


def group_advantages(rewards: Tensor, group_index: Tensor, method: Advantage, eps: float = 1e-6,
                     pool: Tensor | None = None) -> Tensor:
    """Per-sample advantages from scalar rewards, normalised within groups (samples of the same prompt).

    ``group_index[i]`` in ``[0, G)`` names sample i's group. With group mean ``m``, size ``n`` and unbiased
    std ``s``: ``grpo``: ``(r - m) / (s + eps)``; ``dr_grpo``: ``r - m``; ``rloo``: ``r - mean of the others
    = n / (n - 1) * (r - m)``. A group of one sample has no baseline: its advantage is 0.

    ``pool`` (``[N, 3]``: ``n, m, s`` per sample, NaN rows for none) replaces a sample's group statistics by
    those of the larger pool its group was cut from (adaptive sampling: ``metadata["reward_pool"]``).
    """
    rewards = rewards.to(torch.float64)
    num_groups = int(group_index.max().item()) + 1 if group_index.numel() else 0
    count = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group_index, torch.ones_like(rewards))
    total = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group_index, rewards)
    mean = group_mean = (total / count)[group_index]
    n = count[group_index]
    pooled = torch.zeros_like(rewards, dtype=torch.bool)
    if pool is not None:
        pool = pool.to(torch.float64)
        pooled = pool[:, 1].isfinite()
        n = torch.where(pooled, pool[:, 0], n)
        mean = torch.where(pooled, pool[:, 1], mean)
    centred = rewards - mean
    if method == "grpo":
        # a member without a pool: its group's own spread
        sq = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group_index, (rewards - group_mean) ** 2)
        std = torch.sqrt(sq[group_index] / (n - 1).clamp_min(1))
        if pool is not None:
            std = torch.where(pooled, pool[:, 2], std)
        adv = centred / (std + eps)
    elif method == "dr_grpo":
        adv = centred
    elif method == "rloo":
        adv = centred * n / (n - 1).clamp_min(1)
    else:
        raise ConfigError(f"unknown advantage {method!r}: expected grpo, dr_grpo or rloo")
    return torch.where(n > 1, adv, torch.zeros_like(adv)).to(torch.float32)


def ppo_surrogate(
    logp: Tensor, logp_old: Tensor, advantages: Tensor, eps_low: float, eps_high: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token clipped surrogate loss, the ratio, and whether the clip was active (see module doc)."""
    ratio = torch.exp((logp - logp_old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    return torch.maximum(unclipped, clipped), ratio, clipped > unclipped


def behaviour_weights(
    logp_prox: Tensor, logp_behav: Tensor, correction: Correction, cfg: LossConfig
) -> tuple[Tensor, Tensor]:
    """Detached per-token importance weight on the surrogate and the keep mask (False = masked token)."""
    log_w = (logp_prox - logp_behav).detach().clamp(max=LOG_RATIO_CLAMP)
    ones = torch.ones_like(log_w, dtype=torch.bool)
    if correction == "none":
        return torch.ones_like(log_w), ones
    if correction == "tis":
        return torch.exp(log_w.clamp(max=math.log(cfg.tis_cap))), ones
    if correction == "decoupled":
        cap = cfg.decoupled_weight_cap
        keep = log_w <= math.log(cap) if cap is not None else ones
    elif correction == "icepop":
        keep = (log_w >= math.log(cfg.icepop_low)) & (log_w <= math.log(cfg.icepop_high))
    else:
        raise ConfigError(f"unknown correction {correction!r}: expected none, decoupled, tis or icepop")
    return torch.where(keep, torch.exp(torch.where(keep, log_w, 0.0)), 0.0), keep


def kl_penalty(logp: Tensor, ref_logp: Tensor, estimator: KLEstimator) -> Tensor:
    """Per-token KL(current || reference) estimate from samples of the current policy."""
    if estimator == "k1":
        return logp - ref_logp
    if estimator == "k3":
        d = (ref_logp - logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        return (torch.exp(d) - d - 1.0).clamp(max=K3_CLAMP)
    raise ConfigError(f"unknown KL estimator {estimator!r}: expected k1 or k3")


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the categorical distribution at each row: ``logsumexp(z) - sum(softmax(z) * z)``."""
    logits = logits.float()
    return torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, dim=-1) * logits).sum(-1)


def entropy_given_lse(logits: Tensor, lse: Tensor) -> Tensor:
    """:func:`entropy_from_logits` without gradients, from the rows' ``logsumexp`` already computed (the
    log-probabilities' own): ``lse - sum(exp(z - lse) * z)``, four passes over the logits where recomputing the
    logsumexp and a softmax took nine (the entropy metric of every RL step, over ``[scored tokens, vocab]``)."""
    with torch.no_grad():
        p = (logits.float() - lse.unsqueeze(-1)).exp_()
        return lse - p.mul_(logits).sum(-1)


def token_logprobs(logits: Tensor, targets: Tensor, temperature: float = 1.0) -> Tensor:
    """``log softmax(logits / temperature)[target]`` per row, computed in fp32."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    return token_logprobs_and_lse(logits, targets)[0]


def token_logprobs_and_lse(logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """``log softmax(logits)[target]`` per row and the rows' logsumexp (for :func:`entropy_given_lse`)."""
    lse = torch.logsumexp(logits, dim=-1)
    return logits.gather(-1, targets[:, None]).squeeze(-1) - lse, lse


def aggregation_weights(
    mask: Tensor, seq_index: Tensor, mode: LossAgg, token_sum_norm: float | None = None
) -> Tensor:
    """Per-token weights that turn ``sum(weights * token_loss)`` into the aggregated loss.

    With ``T`` scored tokens, ``S`` sequences that have at least one, and ``n_s`` tokens in sequence s:
    ``token_mean``: ``1 / T``; ``seq_mean_token_mean``: ``1 / (S * n_s)``; ``seq_mean_token_sum``:
    ``1 / (S * token_sum_norm)`` (``token_sum_norm`` defaults to 1). Masked tokens get 0.
    """
    m = mask.to(torch.float64)
    if seq_index.numel() == 0:
        return m.to(torch.float32)
    per_seq = torch.zeros(int(seq_index.max().item()) + 1, dtype=torch.float64).index_add_(0, seq_index, m)
    num_seqs = max(int((per_seq > 0).sum().item()), 1)
    if mode == "token_mean":
        w = m / max(float(m.sum().item()), 1.0)
    elif mode == "seq_mean_token_mean":
        w = m / (per_seq[seq_index].clamp_min(1.0) * num_seqs)
    elif mode == "seq_mean_token_sum":
        w = m / (num_seqs * (token_sum_norm or 1.0))
    else:
        raise ConfigError(f"unknown loss_agg {mode!r}")
    return w.to(torch.float32)


def aggregate(token_values: Tensor, weights: Tensor) -> Tensor:
    """``sum(weights * token_values)`` where masked (zero-weight) tokens add exactly nothing."""
    live = weights != 0
    return (torch.where(live, token_values, 0.0) * weights).sum()


@dataclass(frozen=True, slots=True)
class TokenStats:
    """Sums (and extremes) over the live tokens of a micro-batch; reducible over micro-batches and ranks."""

    tokens: Tensor
    clipped: Tensor
    masked: Tensor
    is_weight_sum: Tensor
    kl_sum: Tensor
    entropy_sum: Tensor
    behav_kl_sum: Tensor  # sum of logp_behav - logp_prox: KL(behaviour || proximal) estimate
    pg_loss: Tensor  # weighted policy-gradient part of the loss
    is_weight_max: Tensor
    neg_is_weight_min: Tensor  # stored negated so that every extreme reduces with max

    def vectors(self) -> tuple[Tensor, Tensor]:
        """(sums, maxima) as two fp64 vectors in field order."""
        vals = [getattr(self, f.name).detach().to(torch.float64).reshape(()) for f in fields(self)]
        return torch.stack(vals[:8]), torch.stack(vals[8:])


def policy_loss(
    cfg: LossConfig,
    *,
    logp: Tensor,
    behavior_logp: Tensor,
    advantages: Tensor,
    weights: Tensor,
    proximal_logp: Tensor | None = None,
    ref_logp: Tensor | None = None,
    entropy: Tensor | None = None,
) -> tuple[Tensor, Tensor, TokenStats]:
    """The aggregated RL loss (to backpropagate), the per-token loss, and statistics.

    ``weights`` are :func:`aggregation_weights` times per-sample weights. ``proximal_logp`` None: the
    current logprobs, detached, stand in for it (``proximal: current``, or one update per step, where they
    are the same policy). ``ref_logp`` is needed when ``cfg.kl_coef > 0``; ``entropy`` (with grad) when
    ``cfg.entropy_coef > 0``.
    """
    live = weights != 0
    # Neutral values at masked positions, so that no inf/NaN there can reach a gradient (0 * inf = NaN).
    current = logp.detach()
    behavior_logp = torch.where(live, behavior_logp, current)
    advantages = torch.where(live, advantages, 0.0)
    prox = current if proximal_logp is None else torch.where(live, proximal_logp, current)
    if ref_logp is not None:
        ref_logp = torch.where(live, ref_logp, current)
    old = behavior_logp if cfg.correction == "none" else prox
    pg, _, clipped = ppo_surrogate(logp, old, advantages, cfg.clip_eps_low, cfg.clip_eps_high)
    w, keep = behaviour_weights(prox, behavior_logp, cfg.correction, cfg)
    pg_w = torch.where(keep, w * pg, 0.0)
    token_loss = pg_w
    kl = None
    if ref_logp is not None:
        kl = kl_penalty(logp, ref_logp, cfg.kl_estimator)
        if cfg.kl_coef > 0:
            token_loss = token_loss + cfg.kl_coef * kl
    elif cfg.kl_coef > 0:
        raise ConfigError("kl_coef > 0 needs reference logprobs (ref_logp)")
    if entropy is not None and cfg.entropy_coef > 0:
        token_loss = token_loss - cfg.entropy_coef * entropy
    elif entropy is None and cfg.entropy_coef > 0:
        raise ConfigError("entropy_coef > 0 needs the per-token entropy")
    loss = aggregate(token_loss, weights)

    def total(x: Tensor) -> Tensor:
        return torch.where(live, x.detach().float(), 0.0).sum()

    zero = torch.zeros((), device=logp.device)
    w_live = torch.where(live, torch.exp((prox - behavior_logp).detach().clamp(max=LOG_RATIO_CLAMP)), 0.0)
    stats = TokenStats(
        tokens=live.sum(),
        clipped=(clipped & live & keep).sum(),
        masked=(~keep & live).sum(),
        is_weight_sum=w_live.sum(),
        kl_sum=total(kl) if kl is not None else zero,
        entropy_sum=total(entropy) if entropy is not None else zero,
        behav_kl_sum=total(behavior_logp - prox),
        pg_loss=aggregate(pg_w.detach(), weights),
        is_weight_max=torch.where(live, w_live, -math.inf).max() if live.any() else -math.inf + zero,
        neg_is_weight_min=-torch.where(live, w_live, math.inf).min() if live.any() else -math.inf + zero,
    )
    return loss, token_loss, stats


def sft_loss(logp: Tensor, weights: Tensor) -> Tensor:
    """Masked next-token negative log-likelihood, aggregated with ``weights``."""
    return aggregate(-logp, weights)
