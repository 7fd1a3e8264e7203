"""Each objective against a direct plain-PyTorch computation on fixed tensors: values and gradients.

The reference computations work on padded ``[B, T]`` tensors with a 0/1 mask (multiplying, as one would write
them by hand); the library works on flat scored tokens with weights. Masked positions hold garbage.
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from agentrl.trainer import LossConfig
from agentrl.trainer.objectives import (
    aggregate,
    aggregation_weights,
    entropy_from_logits,
    entropy_given_lse,
    group_advantages,
    kl_penalty,
    policy_loss,
    ppo_surrogate,
    sft_loss,
    token_logprobs,
)

MASK = torch.tensor([[1, 1, 1, 0, 0], [0, 1, 1, 1, 1], [1, 0, 1, 1, 0]], dtype=torch.float64)
LOGP = torch.tensor(
    [[-1.0, -2.0, -0.5, -3.0, -1.0], [-0.1, -1.2, -2.2, -0.7, -1.5], [-0.9, -1.0, -4.0, -0.2, -2.0]],
    dtype=torch.float64,
)
BEHAV = torch.tensor(
    [
        [-1.3, -1.1, -0.6, math.nan, -math.inf],
        [1e9, -1.0, -2.9, -0.4, -1.4],
        [-0.5, math.nan, -2.0, -0.3, 7.0],
    ],
    dtype=torch.float64,
)
PROX = torch.tensor(
    [[-1.1, -1.8, -0.4, -1e9, math.nan], [math.inf, -1.3, -2.1, -0.75, -1.6], [-0.8, -5.0, -3.0, -0.25, 0.0]],
    dtype=torch.float64,
)
REF = torch.tensor(
    [[-1.2, -1.5, -0.7, math.nan, 3.0], [0.0, -1.0, -2.5, -0.6, -1.7], [-1.0, 2.0, -3.5, -0.3, math.inf]],
    dtype=torch.float64,
)
ADV = torch.tensor([1.5, -0.7, 0.4], dtype=torch.float64)


def flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1)


def seq_index() -> torch.Tensor:
    return torch.arange(3).repeat_interleave(5)


def clean(x: torch.Tensor) -> torch.Tensor:
    """The reference only ever reads unmasked entries: zero the garbage so `x * mask` stays finite."""
    return torch.where(MASK.bool(), x, torch.zeros_like(x))


def ref_surrogate(logp, old, adv, el=0.2, eh=0.28):
    r = torch.exp(logp - old)
    return torch.max(-adv * r, -adv * torch.clamp(r, 1 - el, 1 + eh))


def ref_token_mean(per_token):
    return (per_token * MASK).sum() / MASK.sum()


def reference_loss(cfg: LossConfig, logp, with_ref=False, entropy=None):
    adv = ADV[:, None].expand_as(logp)
    behav, prox = clean(BEHAV), clean(PROX)
    old = behav if cfg.correction == "none" else prox
    surr = ref_surrogate(logp, old, adv, cfg.clip_eps_low, cfg.clip_eps_high)
    w = torch.exp(prox - behav)
    if cfg.correction == "none":
        factor = torch.ones_like(w)
    elif cfg.correction == "decoupled":
        factor = w * (w <= cfg.decoupled_weight_cap) if cfg.decoupled_weight_cap else w
    elif cfg.correction == "tis":
        factor = torch.clamp(w, max=cfg.tis_cap)
    else:
        factor = w * ((w >= cfg.icepop_low) & (w <= cfg.icepop_high))
    per_token = factor * surr
    if with_ref:
        d = clean(REF) - logp
        kl = logp - clean(REF) if cfg.kl_estimator == "k1" else torch.exp(d) - d - 1
        per_token = per_token + cfg.kl_coef * kl
    if entropy is not None:
        per_token = per_token - cfg.entropy_coef * entropy
    return ref_token_mean(per_token)


def library_loss(cfg: LossConfig, logp, with_ref=False, entropy=None, proximal=True):
    w = aggregation_weights(flat(MASK).bool(), seq_index(), cfg.loss_agg).double()
    loss, _, stats = policy_loss(
        cfg,
        logp=flat(logp),
        behavior_logp=flat(BEHAV),
        advantages=ADV.repeat_interleave(5),
        weights=w,
        proximal_logp=flat(PROX) if proximal else None,
        ref_logp=flat(REF) if with_ref else None,
        entropy=flat(entropy) if entropy is not None else None,
    )
    return loss, stats


CASES = [
    LossConfig(correction="none"),
    LossConfig(correction="none", clip_eps_low=0.1, clip_eps_high=0.1),
    LossConfig(correction="decoupled", decoupled_weight_cap=None),
    LossConfig(correction="decoupled", decoupled_weight_cap=1.3),
    LossConfig(correction="tis", tis_cap=1.2),
    LossConfig(correction="icepop", icepop_low=0.8, icepop_high=1.25),
    LossConfig(correction="tis", tis_cap=2.0, kl_coef=0.3, kl_estimator="k1"),
    LossConfig(correction="decoupled", kl_coef=0.1, kl_estimator="k3"),
]


@pytest.mark.parametrize(
    "cfg", CASES, ids=lambda c: f"{c.correction}-{c.kl_coef}-{c.kl_estimator}-{c.clip_eps_low}"
)
def test_policy_loss_matches_reference_values_and_gradients(cfg: LossConfig) -> None:
    with_ref = cfg.kl_coef > 0
    a = LOGP.clone().requires_grad_(True)
    b = LOGP.clone().requires_grad_(True)
    expected = reference_loss(cfg, a, with_ref)
    got, _ = library_loss(cfg, b, with_ref)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-9)
    (ga,) = torch.autograd.grad(expected, a)
    (gb,) = torch.autograd.grad(got, b)
    torch.testing.assert_close(gb, ga, rtol=1e-6, atol=1e-9)
    assert torch.all(gb[MASK == 0] == 0), "masked tokens must get exactly zero gradient"
    assert gb.abs().sum() > 0


def test_corrections_really_differ_on_these_tensors() -> None:
    values = {c.correction: float(library_loss(c, LOGP)[0]) for c in (CASES[0], CASES[3], CASES[4], CASES[5])}
    assert len({round(v, 9) for v in values.values()}) == len(values), values


def test_ppo_surrogate_hand_computed_clip_higher() -> None:
    logp = torch.log(torch.tensor([1.5, 1.5, 0.5, 0.5, 1.1], dtype=torch.float64)).requires_grad_(True)
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0, 2.0], dtype=torch.float64)
    loss, ratio, clipped = ppo_surrogate(logp, torch.zeros(5, dtype=torch.float64), adv, 0.2, 0.28)
    # A>0 & r above 1+eps_high: clipped to -1.28; A<0 & r=1.5: unclipped 1.5; A<0 & r below 1-eps_low: 0.8;
    # A>0 & r=0.5: unclipped -0.5; inside the band: -2.2.
    torch.testing.assert_close(loss, torch.tensor([-1.28, 1.5, 0.8, -0.5, -2.2], dtype=torch.float64))
    assert clipped.tolist() == [True, False, True, False, False]
    torch.testing.assert_close(ratio.detach(), torch.tensor([1.5, 1.5, 0.5, 0.5, 1.1], dtype=torch.float64))
    (g,) = torch.autograd.grad(loss.sum(), logp)
    torch.testing.assert_close(g, torch.tensor([0.0, 1.5, 0.0, -0.5, -2.2], dtype=torch.float64))


def test_policy_loss_stats_count_clips_masks_and_weights() -> None:
    cfg = LossConfig(correction="icepop", icepop_low=0.8, icepop_high=1.25)
    _, stats = library_loss(cfg, LOGP)
    live = MASK.bool()
    w = torch.exp(clean(PROX) - clean(BEHAV))[live]
    assert int(stats.tokens) == int(MASK.sum())
    assert int(stats.masked) == int(((w < 0.8) | (w > 1.25)).sum())
    torch.testing.assert_close(float(stats.is_weight_sum), float(w.sum()))
    torch.testing.assert_close(float(stats.is_weight_max), float(w.max()))
    torch.testing.assert_close(-float(stats.neg_is_weight_min), float(w.min()))
    r = torch.exp(LOGP - clean(PROX))[live]
    adv = ADV[:, None].expand_as(LOGP)[live]
    keep = (w >= 0.8) & (w <= 1.25)
    clipped = ((adv > 0) & (r > 1.28)) | ((adv < 0) & (r < 0.8))
    assert int(stats.clipped) == int((clipped & keep).sum())


def test_proximal_current_equals_recompute_with_proximal_equal_to_current() -> None:
    cfg = LossConfig(correction="tis", tis_cap=1.5)
    a = LOGP.clone().requires_grad_(True)
    got, _ = library_loss(cfg, a, proximal=False)
    w = aggregation_weights(flat(MASK).bool(), seq_index(), "token_mean").double()
    b = LOGP.clone().requires_grad_(True)
    exp, _, _ = policy_loss(
        cfg,
        logp=flat(b),
        behavior_logp=flat(BEHAV),
        advantages=ADV.repeat_interleave(5),
        weights=w,
        proximal_logp=flat(LOGP).clone(),
    )
    torch.testing.assert_close(got, exp)
    torch.testing.assert_close(torch.autograd.grad(got, a)[0], torch.autograd.grad(exp, b)[0])
    # with proximal == current, the ratio is 1: the gradient is -min(w, cap) * A / T per live token
    w_cur = torch.clamp(torch.exp(LOGP - clean(BEHAV)), max=1.5)
    expected = -w_cur * ADV[:, None] * MASK / MASK.sum()
    torch.testing.assert_close(torch.autograd.grad(library_loss(cfg, a, proximal=False)[0], a)[0], expected)


def test_entropy_bonus_value_and_gradient() -> None:
    cfg = LossConfig(correction="none", entropy_coef=0.05)
    ent = torch.tensor([[2.0, 1.0, 0.5, 0.7, 9.0]] * 3, dtype=torch.float64)
    ent = torch.where(MASK.bool(), ent, math.nan).requires_grad_(True)
    a = LOGP.clone().requires_grad_(True)
    b = LOGP.clone().requires_grad_(True)
    expected = reference_loss(cfg, a, entropy=clean(ent))
    got, stats = library_loss(cfg, b, entropy=ent)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(torch.autograd.grad(got, ent)[0], -0.05 * MASK / MASK.sum())
    torch.testing.assert_close(float(stats.entropy_sum), float((clean(ent.detach()) * MASK).sum()))


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
def test_aggregation_modes(mode: str) -> None:
    values = torch.randn(3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    values = torch.where(MASK.bool(), values, math.inf)
    v = clean(values)
    if mode == "token_mean":
        expected = (v * MASK).sum() / MASK.sum()
    elif mode == "seq_mean_token_mean":
        expected = ((v * MASK).sum(1) / MASK.sum(1)).mean()
    else:
        expected = (v * MASK).sum(1).mean() / 7.0
    w = aggregation_weights(
        flat(MASK).bool(), seq_index(), mode, 7.0 if mode == "seq_mean_token_sum" else None
    )
    torch.testing.assert_close(aggregate(flat(values), w.double()), expected)


def test_aggregation_ignores_sequences_without_tokens() -> None:
    mask = torch.tensor([1, 1, 0, 0, 1], dtype=torch.bool)
    seq = torch.tensor([0, 0, 1, 1, 2])
    w = aggregation_weights(mask, seq, "seq_mean_token_mean")
    torch.testing.assert_close(w, torch.tensor([0.25, 0.25, 0.0, 0.0, 0.5]))


def test_group_advantages_against_statistics_module() -> None:
    rewards = [1.0, 0.0, 1.0, 1.0, 0.5, 0.25, 2.0, 3.0, 3.0]
    groups = [0, 0, 0, 0, 1, 1, 2, 3, 3]
    by_group: dict[int, list[float]] = {}
    for r, g in zip(rewards, groups):
        by_group.setdefault(g, []).append(r)
    grpo, dr, rloo = [], [], []
    for r, g in zip(rewards, groups):
        rs = by_group[g]
        if len(rs) == 1:
            grpo.append(0.0), dr.append(0.0), rloo.append(0.0)
            continue
        m = statistics.fmean(rs)
        grpo.append((r - m) / (statistics.stdev(rs) + 1e-6))
        dr.append(r - m)
        rloo.append(r - (sum(rs) - r) / (len(rs) - 1))
    rt, gt = torch.tensor(rewards), torch.tensor(groups)
    torch.testing.assert_close(group_advantages(rt, gt, "grpo"), torch.tensor(grpo))
    torch.testing.assert_close(group_advantages(rt, gt, "dr_grpo"), torch.tensor(dr))
    torch.testing.assert_close(group_advantages(rt, gt, "rloo"), torch.tensor(rloo))


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_kl_estimators(estimator: str) -> None:
    logp = torch.tensor([-1.0, -2.0, -0.3], requires_grad=True)
    ref = torch.tensor([-1.5, -1.0, -0.3])
    kl = kl_penalty(logp, ref, estimator)  # type: ignore[arg-type]
    if estimator == "k1":
        torch.testing.assert_close(kl, torch.tensor([0.5, -1.0, 0.0]))
        torch.testing.assert_close(torch.autograd.grad(kl.sum(), logp)[0], torch.ones(3))
    else:
        d = ref - logp.detach()
        torch.testing.assert_close(kl, torch.exp(d) - d - 1)
        torch.testing.assert_close(torch.autograd.grad(kl.sum(), logp)[0], 1 - torch.exp(d))
        assert float(kl[2].detach()) == 0.0 and bool((kl >= 0).all())


def test_entropy_and_logprobs_from_logits() -> None:
    logits = torch.randn(4, 11, generator=torch.Generator().manual_seed(1))
    targets = torch.tensor([0, 3, 10, 5])
    expected_h = torch.distributions.Categorical(logits=logits).entropy()
    torch.testing.assert_close(entropy_from_logits(logits), expected_h)
    torch.testing.assert_close(entropy_given_lse(logits, torch.logsumexp(logits, -1)), expected_h)
    lp = token_logprobs(logits, targets, temperature=0.7)
    torch.testing.assert_close(lp, torch.log_softmax(logits / 0.7, -1)[torch.arange(4), targets])


def test_sft_loss_is_masked_token_mean_nll() -> None:
    logp = flat(LOGP).clone().requires_grad_(True)
    w = aggregation_weights(flat(MASK).bool(), seq_index(), "token_mean").double()
    loss = sft_loss(logp, w)
    torch.testing.assert_close(loss, -(LOGP * MASK).sum() / MASK.sum())
    torch.testing.assert_close(torch.autograd.grad(loss, logp)[0], -flat(MASK) / MASK.sum())


@pytest.mark.parametrize("method", ["grpo", "dr_grpo", "rloo"])
def test_group_advantages_take_a_pools_statistics_where_given(method):
    """A group cut from a larger pool (adaptive sampling) is centred (and scaled) by the pool's statistics; a group
    without one by its own."""
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 0.0])
    index = torch.tensor([0, 0, 0, 0, 1, 1])
    full = [1.0] + [0.0] * 7  # the pool group 0 was cut from: one solved in 8
    m, s = statistics.fmean(full), statistics.stdev(full)
    nan = float("nan")
    pool = torch.tensor([[8, m, s]] * 4 + [[nan] * 3] * 2)
    got = group_advantages(rewards, index, method, pool=pool)
    scale = {"grpo": 1 / (s + 1e-6), "dr_grpo": 1.0, "rloo": 8 / 7}[method]
    assert got[:4].tolist() == pytest.approx([(r - m) * scale for r in [1.0, 0.0, 0.0, 0.0]], rel=1e-5)
    assert got[4:].tolist() == pytest.approx(group_advantages(rewards[4:], index[4:] - 1, method).tolist())
    assert got[1] != pytest.approx(group_advantages(rewards[:4], index[:4], method)[1].item())  # not the group's


def test_group_advantages_with_a_pool_of_equal_rewards_or_a_pool_on_some_members_only():
    """A pool whose rewards were all equal gives 0 (grpo: no division blow-up); a member without a pool in a group
    whose others have one keeps its group's own statistics, and its std is its group's own spread."""
    rewards = torch.tensor([0.1, 0.1, 1.0, 0.0])
    index = torch.tensor([0, 0, 1, 1])
    nan = float("nan")
    pool = torch.tensor([[16, 0.1, 0.0]] * 2 + [[16, 0.25, 0.4472136], [nan] * 3])
    got = group_advantages(rewards, index, "grpo", pool=pool)
    assert got[:2].tolist() == [0.0, 0.0]
    assert got[2].item() == pytest.approx(0.75 / 0.4472136, rel=1e-5)
    own_std = statistics.stdev([1.0, 0.0])
    assert got[3].item() == pytest.approx((0.0 - 0.5) / own_std, rel=1e-5)
