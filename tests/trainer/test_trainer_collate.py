"""Collate: next-token shift, staleness, drops, advantages, token budget, packing, rank split."""

from __future__ import annotations

import math

import pytest
import torch
from trainer_helpers import make_traj, random_batch

from agentrl.queue.codec import from_msgpack, to_msgpack
from agentrl.trainer import LossConfig, Trace, plan_micro_batches, prepare_rl, prepare_sft


def scored(mbs):
    """(sample, context-last-token, target, behaviour logprob, advantage, weight) for every live token."""
    out = []
    for mb in mbs:
        flat_ids = mb.input_ids.reshape(-1)
        for i in range(mb.targets.numel()):
            if mb.weights[i] != 0:
                out.append(
                    (
                        int(mb.seq_index[i]),
                        int(flat_ids[mb.score_index[i]]),
                        int(mb.targets[i]),
                        round(float(mb.behavior_logprobs[i]), 5),
                        round(float(mb.advantages[i]), 5),
                        round(float(mb.weights[i]), 7),
                    )
                )
    return sorted(out)


def test_shift_aligns_targets_context_and_behaviour_logprobs() -> None:
    ids = [50, 51, 52, 53, 54, 55, 56, 57]
    mask = [0, 0, 1, 1, 0, 0, 1, 0]  # prompt 50 51 | model 52 53 | observation 54 55 | model 56 | tail 57
    behav = [0.0, 0.0, -0.2, -0.3, 0.0, 0.0, -0.6, 0.0]
    prep = prepare_rl([make_traj(ids, 2, mask, behav=behav)], current_version=0, cfg=LossConfig())
    (s,) = prep.samples
    assert s.input_ids.tolist() == [50, 51, 52, 53, 54, 55]  # nothing after the last scored token is fed
    assert s.targets.tolist() == [52, 53, 56]
    assert s.score_pos.tolist() == [1, 2, 5]  # token t is predicted at position t - 1
    assert s.input_ids[s.score_pos].tolist() == [51, 52, 55]
    torch.testing.assert_close(s.behavior_logprobs, torch.tensor([-0.2, -0.3, -0.6]))
    (mb,) = plan_micro_batches(prep.samples, mode="token_mean", token_budget=64, layout="packed")
    assert scored([mb]) == [
        (0, 51, 52, -0.2, 0.0, 0.3333333),
        (0, 52, 53, -0.3, 0.0, 0.3333333),
        (0, 55, 56, -0.6, 0.0, 0.3333333),
    ]


def test_staleness_is_current_minus_oldest_model_token_version() -> None:
    t = make_traj([1, 2, 3, 4, 5, 6], 2, [0, 0, 1, 1, 0, 1], versions=[-1, -1, 3, 4, -1, 5])
    prep = prepare_rl([t], current_version=7, cfg=LossConfig())
    assert prep.samples[0].staleness == 4 and prep.staleness_max == 4


@pytest.mark.parametrize("policy", ["drop", "downweight"])
def test_stale_samples_dropped_or_downweighted_and_counted(policy: str) -> None:
    trajs = [
        make_traj([1, 2, 3, 4], 1, [0, 1, 1, 1], versions=[-1, v, v, v], reward=float(v), tid=str(v))
        for v in (10, 9, 7, 5)
    ]
    cfg = LossConfig(max_staleness=2, stale_policy=policy, stale_decay=0.5, loss_agg="seq_mean_token_sum")
    prep = prepare_rl(trajs, current_version=10, cfg=cfg)
    if policy == "drop":
        assert (prep.dropped_stale, prep.downweighted_stale) == (2, 0)
        assert [s.staleness for s in prep.samples] == [0, 1]
    else:
        assert (prep.dropped_stale, prep.downweighted_stale) == (0, 2)
        assert [s.weight for s in prep.samples] == [1.0, 1.0, 0.5, 0.5**3]
        (mb,) = plan_micro_batches(prep.samples, mode=cfg.loss_agg, token_budget=64, layout="padded")
        per_sample = {int(i): float(mb.weights[mb.seq_index == i][0]) for i in mb.seq_index.unique()}
        assert per_sample == pytest.approx({0: 0.25, 1: 0.25, 2: 0.125, 3: 0.25 * 0.125})
    # advantages were computed over the whole group, stale members included
    assert prep.samples[0].advantage == pytest.approx(
        (10 - 7.75) / torch.tensor([10.0, 9, 7, 5]).std().item(), rel=1e-5
    )


def test_trajectories_without_a_score_are_never_trained_on() -> None:
    ok = make_traj([1, 2, 3], 1, [0, 1, 1], reward=1.0)
    bad = make_traj([1, 2, 3], 1, [0, 1, 1], reward=math.nan)
    prep = prepare_rl([ok, bad], current_version=0, cfg=LossConfig())
    assert prep.dropped_invalid == 1 and len(prep.samples) == 1
    assert prep.samples[0].advantage == 0.0  # the unscored sample is no part of the group baseline


def test_a_group_cut_from_a_pool_is_centred_on_the_pools_mean_after_the_queue() -> None:
    """Adaptive sampling's groups carry their pool's reward statistics (``metadata["reward_pool"]``) through the
    queue's codec; the advantage is taken against the pool, another group's against its own members."""
    pool = {"n": 8, "mean": 0.125, "std": 0.35355}
    cut = [make_traj([1, 2, 3], 1, [0, 1, 1], reward=r, group="a", tid=f"a{i}") for i, r in enumerate([1.0, 0.0])]
    for t in cut:
        t.metadata["reward_pool"] = dict(pool)
    own = [make_traj([1, 2, 3], 1, [0, 1, 1], reward=r, group="b", tid=f"b{i}") for i, r in enumerate([1.0, 0.0])]
    trajs = [from_msgpack(to_msgpack(t)) for t in cut + own]
    prep = prepare_rl(trajs, current_version=0, cfg=LossConfig(advantage="dr_grpo"))
    assert [s.advantage for s in prep.samples] == pytest.approx([0.875, -0.125, 0.5, -0.5])


@pytest.mark.parametrize("bad", [{"n": 8, "mean": 0.125}, {"n": 0, "mean": 0.1, "std": 0.1}, "pool",
                                 {"n": 8, "mean": math.nan, "std": 0.1}, {"n": 8, "mean": "x", "std": 0.1}])
def test_a_malformed_reward_pool_is_ignored_with_a_warning(bad, caplog) -> None:
    """The queue may hold trajectories from other producers: a reward_pool that is not {n, mean, std} leaves the
    trajectory on its own group's statistics (the trainer goes on)."""
    trajs = [make_traj([1, 2, 3], 1, [0, 1, 1], reward=r, group="a", tid=f"a{i}") for i, r in enumerate([1.0, 0.0])]
    trajs[0].metadata["reward_pool"] = bad
    prep = prepare_rl(trajs, current_version=0, cfg=LossConfig(advantage="dr_grpo"))
    assert [s.advantage for s in prep.samples] == pytest.approx([0.5, -0.5])
    assert "reward_pool" in caplog.text and "a0" in caplog.text


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_budget_respected_and_layouts_score_the_same_tokens(layout: str) -> None:
    prep = prepare_rl(
        random_batch(3, n=16), current_version=0, cfg=LossConfig(loss_agg="seq_mean_token_mean")
    )
    mbs = plan_micro_batches(prep.samples, mode="seq_mean_token_mean", token_budget=64, layout=layout)
    assert len(mbs) > 2
    longest = max(s.length for s in prep.samples)
    for mb in mbs:
        assert mb.input_ids.numel() <= max(64, longest)
        assert (mb.attention_mask is None) == (layout == "packed" or mb.num_tokens == mb.input_ids.numel())
    reference = plan_micro_batches(
        prep.samples, mode="seq_mean_token_mean", token_budget=10_000, layout="padded"
    )
    assert scored(mbs) == scored(reference)
    assert sum(float(mb.weights.sum()) for mb in mbs) == pytest.approx(1.0)


@pytest.mark.parametrize("layout", ["packed", "padded", "shared_prefix"])
def test_rows_padded_to_a_multiple_stay_within_the_budget_and_score_the_same_tokens(layout: str) -> None:
    """``pad_to_multiple_of``: widths are multiples of it, planned with the padding counted (a micro-batch stays
    within ``micro_batch_tokens``), and the same tokens are scored as without it."""
    from trainer_helpers import grouped_batch

    prep = prepare_rl(random_batch(3, n=16) + grouped_batch(3), current_version=0, cfg=LossConfig())
    longest = max(s.length for s in prep.samples)
    mbs = plan_micro_batches(prep.samples, mode="token_mean", token_budget=96, layout=layout, pad_to_multiple_of=16)
    plain = plan_micro_batches(prep.samples, mode="token_mean", token_budget=96, layout=layout)
    assert any(mb.input_ids.shape[-1] % 16 for mb in plain)  # the premise: widths that are not multiples
    for mb in mbs:
        assert mb.input_ids.shape[-1] % 16 == 0
        assert mb.input_ids.numel() <= max(96, -(-longest // 16) * 16)
    assert scored(mbs) == scored(plain)


def test_packed_rows_restart_positions_per_sequence() -> None:
    trajs = [make_traj(list(range(100, 100 + n)), 1, [0] + [1] * (n - 1), tid=str(n)) for n in (9, 4, 3, 2)]
    prep = prepare_rl(trajs, current_version=0, cfg=LossConfig())
    (mb,) = plan_micro_batches(prep.samples, mode="token_mean", token_budget=64, layout="packed")
    assert mb.input_ids.shape == (2, 8)  # rows as long as the longest input (8): [8], [3 + 2 + 1 + pad 2]
    assert mb.position_ids[0].tolist() == list(range(8))
    assert mb.position_ids[1].tolist() == [0, 1, 2, 0, 1, 0, 0, 1]  # the tail padding is a segment of its own
    assert mb.input_ids[1, :6].tolist() == [100, 101, 102, 100, 101, 100]
    assert mb.num_tokens == 8 + 3 + 2 + 1 and mb.attention_mask is None


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_get_equal_micro_batch_counts_and_cover_the_batch(world: int) -> None:
    prep = prepare_rl(random_batch(5, n=7), current_version=0, cfg=LossConfig())
    per_rank = [
        plan_micro_batches(
            prep.samples, mode="token_mean", token_budget=40, layout="packed", rank=r, world_size=world
        )
        for r in range(world)
    ]
    assert len({len(p) for p in per_rank}) == 1
    seen = sorted(int(i) for p in per_rank for mb in p for i in mb.seq_index.unique() if i >= 0)
    assert seen == list(range(len(prep.samples)))
    assert sum(float(mb.weights.sum()) for p in per_rank for mb in p) == pytest.approx(1.0)
    single = plan_micro_batches(prep.samples, mode="token_mean", token_budget=40, layout="packed")
    assert sorted(x for p in per_rank for x in scored(p)) == scored(single)


def test_world_larger_than_batch_gives_dummies() -> None:
    prep = prepare_rl([make_traj([1, 2, 3], 1, [0, 1, 1])], current_version=0, cfg=LossConfig())
    (mb,) = plan_micro_batches(
        prep.samples, mode="token_mean", token_budget=40, layout="packed", rank=1, world_size=2
    )
    assert mb.is_dummy and float(mb.weights.sum()) == 0.0


def test_sft_traces_skip_sequences_with_nothing_to_learn() -> None:
    prep = prepare_sft([Trace([1, 2, 3], [0, 0, 0]), Trace([4, 5, 6], [0, 1, 1]), Trace([7], [1])])
    assert [s.source for s in prep.samples] == [1] and prep.model_tokens == 2


def test_shared_prefix_rows_hold_each_prompt_once() -> None:
    from trainer_helpers import grouped_batch

    batch = grouped_batch(3, groups=3, group_size=4)
    prep = prepare_rl(batch, current_version=0, cfg=LossConfig())
    mbs = plan_micro_batches(prep.samples, mode="token_mean", token_budget=10_000, layout="shared_prefix")
    padded = plan_micro_batches(prep.samples, mode="token_mean", token_budget=10_000, layout="padded")
    prompts = {t.group_id: t.prompt_len for t in batch}
    fed = sum(s.length for s in prep.samples)
    assert sum(mb.num_tokens for mb in mbs) == fed - 3 * sum(prompts.values())  # 4 copies -> 1 per group
    assert sum(int(mb.targets.numel()) for mb in mbs) == sum(int(mb.targets.numel()) for mb in padded)
    for mb in mbs:
        rows, width = mb.input_ids.shape
        assert mb.attention_mask is not None and mb.attention_mask.shape == (rows, 1, width, width)
        assert mb.attention_mask.diagonal(dim1=-2, dim2=-1).all()  # no query row is empty (padding included)
        # every scored entry reads the hidden state at its index and predicts its own target
        assert int(mb.score_index.max()) < rows * width
    # the first response token of every member of a group is predicted from the same (prefix) position
    mb = mbs[0]
    firsts: dict[int, set[int]] = {}
    for s in prep.samples:
        sel = (mb.seq_index == s.index).nonzero().flatten()
        if sel.numel():
            firsts.setdefault(int(s.input_ids[: int(s.score_pos[0]) + 1].sum()), set()).add(int(mb.score_index[sel[0]]))
    assert firsts and all(len(v) == 1 for v in firsts.values())


def test_shared_prefix_splits_units_between_ranks() -> None:
    from trainer_helpers import grouped_batch

    prep = prepare_rl(grouped_batch(5, groups=5), current_version=0, cfg=LossConfig())
    per_rank = [plan_micro_batches(prep.samples, mode="token_mean", token_budget=60, layout="shared_prefix",
                                   rank=r, world_size=2) for r in range(2)]
    assert len(per_rank[0]) == len(per_rank[1])  # dummies fill the gap: FSDP needs every rank in every step
    seen = [int(i) for mbs in per_rank for mb in mbs for i in mb.seq_index.unique() if i >= 0]
    assert sorted(seen) == list(range(len(prep.samples)))


def test_a_rank_without_samples_gets_a_dummy_micro_batch_to_match_the_others():
    """The premise of the world-2 test's one-trace batch (test_trainer_distributed.py): rank 1 holds only a dummy,
    whose forward Trainer.logprobs must still run."""
    prep = prepare_sft(random_batch(101, n=1))
    plans = [plan_micro_batches(prep.samples, mode="token_mean", token_budget=48, layout="packed", rank=r,
                                world_size=2) for r in (0, 1)]
    assert [len(p) for p in plans] == [1, 1]
    assert not plans[0][0].is_dummy and plans[1][0].is_dummy
