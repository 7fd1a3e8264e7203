"""The Trainer on the real tiny model, in this process (FSDP2 over gloo, world size 1)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from trainer_helpers import grouped_batch, hf_logprobs, make_traj, random_batch
from transformers import AutoModelForCausalLM, AutoTokenizer

from agentrl.trainer import Trace, Trainer, latest_checkpoint


@pytest.mark.parametrize("layout", ["packed", "padded", "shared_prefix"])
def test_logprobs_match_plain_hf_forward(tiny_config, hf_tiny, layout: str) -> None:
    batch = random_batch(7, n=9) + grouped_batch(7)
    with Trainer(tiny_config(layout=layout, micro_batch_tokens=48)) as tr:
        got = tr.logprobs(batch)
    for traj, lp in zip(batch, got):
        torch.testing.assert_close(
            lp, hf_logprobs(hf_tiny, traj.token_ids, traj.loss_mask), atol=2e-5, rtol=0
        )
        assert lp[torch.tensor(traj.loss_mask) == 0].abs().sum() == 0


def _group(trainer: Trainer) -> list:
    prompt = [100, 200, 300, 400]
    good = make_traj(prompt + [11, 12, 13, 14], 4, [0] * 4 + [1] * 4, reward=1.0, group="p", tid="good")
    bad = make_traj(prompt + [21, 22, 23, 24], 4, [0] * 4 + [1] * 4, reward=0.0, group="p", tid="bad")
    on_policy = trainer.logprobs([good, bad])  # behaviour = current policy
    return [
        make_traj(
            t.token_ids, 4, t.loss_mask, reward=t.reward, group="p", tid=t.trajectory_id, behav=lp.tolist()
        )
        for t, lp in zip([good, bad], on_policy)
    ]


@pytest.mark.parametrize("correction", ["none", "decoupled", "tis", "icepop"])
def test_rl_step_raises_rewarded_answer_and_lowers_the_other(tiny_config, correction: str) -> None:
    with Trainer(tiny_config(lr=3e-3, loss={"correction": correction})) as tr:
        batch = _group(tr)
        before = [float(x.sum()) for x in tr.logprobs(batch)]
        m = tr.rl_step(batch, current_version=0)
        for v in range(1, 3):
            tr.rl_step(batch, current_version=v)
        after = [float(x.sum()) for x in tr.logprobs(batch)]
    assert after[0] > before[0] + 0.05 and after[1] < before[1] - 0.05, (before, after)
    assert (m.step, m.weight_version, m.num_trajectories, m.model_tokens, m.tokens) == (1, 1, 2, 8, 16)
    assert m.is_weight_mean == pytest.approx(1.0, abs=1e-4) and m.masked_frac == 0.0 and not m.skipped
    assert m.grad_norm > 0 and m.entropy > 5 and m.kl is None and m.reward_mean == 0.5


def test_observation_tokens_and_their_fields_contribute_nothing(tiny_config) -> None:
    batch = random_batch(11, n=8)
    garbage = [
        make_traj(
            t.token_ids,
            t.prompt_len,
            t.loss_mask,
            reward=t.reward,
            group=t.group_id,
            tid=t.trajectory_id,
            behav=[b if m else 1e6 for b, m in zip(t.behavior_logprobs, t.loss_mask)],
            versions=[v if m else 10**6 for v, m in zip(t.weight_versions, t.loss_mask)],
        )
        for t in batch
    ]
    results = []
    for b in (batch, garbage):
        with Trainer(tiny_config(lr=1e-2, loss={"correction": "tis"})) as tr:
            m = tr.rl_step(b, current_version=0)
            results.append((m.loss, m.grad_norm, tr.logprobs(random_batch(1))))
    assert results[0][0] == results[1][0] and results[0][1] == results[1][1]
    for x, y in zip(results[0][2], results[1][2]):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_sft_step_first_loss_is_masked_nll_and_training_lowers_it(tiny_config, hf_tiny) -> None:
    trajs = random_batch(4, n=6)
    traces = [Trace(t.token_ids, t.loss_mask) for t in trajs]
    lp = [hf_logprobs(hf_tiny, t.token_ids, t.loss_mask) for t in traces]
    expected = -sum(float(x.sum()) for x in lp) / sum(sum(t.loss_mask[1:]) for t in traces)
    with Trainer(tiny_config(lr=1e-2, micro_batch_tokens=32)) as tr:
        losses = [tr.sft_step(traces) for _ in range(6)]
    assert losses[0].loss == pytest.approx(expected, rel=1e-5)
    assert losses[-1].loss < losses[0].loss - 0.5
    assert losses[0].num_sequences == 6 and losses[0].model_tokens == sum(
        sum(t.loss_mask[1:]) for t in traces
    )


def test_export_hf_is_loadable_with_identical_logits(
    tiny_config, tiny_model_path: Path, tmp_path: Path
) -> None:
    batch = random_batch(2, n=6)
    out = tmp_path / "weights" / "v1"
    with Trainer(tiny_config(lr=1e-2)) as tr:
        tr.rl_step(batch, current_version=0)
        tr.export_hf(out)
        tr.export_hf(out)  # publishing the same version twice replaces the folder atomically
        mine = tr.logprobs(batch)
    names = sorted(p.name for p in (tmp_path / "weights").iterdir())
    assert names == ["v1"], names
    files = {p.name for p in out.iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json"} <= files
    assert "chat_template.jinja" in files
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert AutoTokenizer.from_pretrained(str(out)).chat_template is not None
    original = AutoModelForCausalLM.from_pretrained(str(tiny_model_path), dtype=torch.float32)
    assert not torch.equal(model.model.embed_tokens.weight, original.model.embed_tokens.weight)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # still tied
    for t, lp in zip(batch, mine):
        torch.testing.assert_close(hf_logprobs(model, t.token_ids, t.loss_mask), lp, atol=2e-5, rtol=0)


def test_activation_checkpointing_changes_nothing_but_memory(tiny_config) -> None:
    batch = random_batch(3)
    runs = []
    for ac in (False, True):
        with Trainer(tiny_config(lr=1e-2, activation_checkpointing=ac)) as tr:
            m = tr.rl_step(batch, current_version=0)
            runs.append((m.loss, m.grad_norm, tr.logprobs(batch)))
    assert runs[0][0] == pytest.approx(runs[1][0], abs=1e-7)
    assert runs[0][1] == pytest.approx(runs[1][1], rel=1e-5)
    for x, y in zip(runs[0][2], runs[1][2]):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=0)


def test_bf16_mixed_precision_tracks_fp32(tiny_config) -> None:
    batch = random_batch(3)
    with Trainer(tiny_config(dtype="bf16")) as tr:
        lp16 = tr.logprobs(batch)
        m = tr.rl_step(batch, current_version=0)
    with Trainer(tiny_config()) as tr:
        lp32 = tr.logprobs(batch)
    assert m.grad_norm > 0 and m.loss == m.loss
    for a, b in zip(lp16, lp32):
        torch.testing.assert_close(a, b, atol=0.1, rtol=0)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_kl_to_reference_starts_at_zero_and_grows(tiny_config, dtype: str) -> None:
    batch = random_batch(5)
    with Trainer(tiny_config(dtype=dtype, lr=1e-2, loss={"kl_coef": 0.1, "kl_estimator": "k3"})) as tr:
        # in bf16 the frozen reference is stored in bf16 (no fp32 master): it must score exactly as the policy does
        ref_dtypes = {p.dtype for p in tr._ref.parameters()}
        assert ref_dtypes == {torch.bfloat16 if dtype == "bf16" else torch.float32}
        assert {p.dtype for p in tr._policy.parameters()} == {torch.float32}
        first = tr.rl_step(batch, current_version=0)
        tr.rl_step(batch, current_version=1)
        third = tr.rl_step(batch, current_version=2)
    assert first.kl == pytest.approx(0.0, abs=1e-9)
    assert third.kl is not None and third.kl > 1e-6


def test_stale_and_unscored_trajectories_counted(tiny_config) -> None:
    batch = random_batch(6, n=8, version=0)  # staleness 5 at version 5
    fresh = random_batch(7, n=4, version=5)  # versions 4 and 5: staleness 0 or 1
    failed = make_traj([1, 2, 3], 1, [0, 1, 1], reward=math.nan)
    with Trainer(tiny_config(loss={"max_staleness": 1})) as tr:
        m = tr.rl_step(batch + fresh + [failed], current_version=5)
        empty = tr.rl_step(batch, current_version=6)
    assert (m.dropped_stale, m.dropped_invalid, m.num_trajectories, m.staleness_max) == (8, 1, 4, 1)
    assert m.tokens == sum(t.num_tokens for t in fresh)
    assert empty.skipped and empty.num_trajectories == 0 and empty.weight_version == 7


def test_mini_batches_make_several_optimizer_updates(tiny_config) -> None:
    cfg = tiny_config(lr=1e-3, mini_batches=2, optimizer={"warmup_steps": 10})
    with Trainer(cfg) as tr:
        m = tr.rl_step(random_batch(8), current_version=0)
    assert m.lr == pytest.approx(1e-3 * 3 / 11)  # two updates done: the next one is update 2


def test_checkpoint_round_trip_in_process(tiny_config, tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    (root / ".step_9.partial").mkdir(parents=True)  # what a kill during save leaves behind
    (root / "step_8").mkdir()  # incomplete: no trainer_state.json
    with Trainer(tiny_config(lr=1e-2)) as tr:
        for v in range(2):
            tr.rl_step(random_batch(v), current_version=v)
        tr.save_checkpoint(root / "step_2", extra={"queue": {"last_id": "17-3"}, "n": 5})
        expected = tr.logprobs(random_batch(9))
    assert latest_checkpoint(root) == root / "step_2"
    assert not (root / ".step_2.partial").exists()
    state = json.loads((root / "step_2" / "trainer_state.json").read_text())
    assert (state["step"], state["weight_version"]) == (2, 2)
    with Trainer(tiny_config(lr=1e-2)) as tr:
        extra = tr.load_checkpoint(root / "step_2")
        got = tr.logprobs(random_batch(9))
        assert (tr.step, tr.weight_version) == (2, 2)
    assert extra == {"queue": {"last_id": "17-3"}, "n": 5}
    for x, y in zip(expected, got):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_shared_prefix_steps_equal_padded_steps(tiny_config, kl_coef: float) -> None:
    """The prompt run once per group gives the same losses, gradients and updated weights as running it per
    sequence (fp32 round-off), with the reference pass too."""
    results = {}
    for layout in ("padded", "shared_prefix"):
        with Trainer(tiny_config(lr=1e-3, layout=layout, micro_batch_tokens=64, loss={"kl_coef": kl_coef})) as tr:
            ms = [tr.rl_step(grouped_batch(s), current_version=0) for s in range(2)]
            results[layout] = (ms, tr.logprobs(grouped_batch(9)))
    (pad_m, pad_lp), (sh_m, sh_lp) = results["padded"], results["shared_prefix"]
    for a, b in zip(pad_m, sh_m):
        assert a.tokens == b.tokens and a.model_tokens == b.model_tokens
        assert b.loss == pytest.approx(a.loss, abs=1e-5) and b.grad_norm == pytest.approx(a.grad_norm, rel=1e-4)
        assert (b.kl is None) == (kl_coef == 0) and (b.kl or 0) == pytest.approx(a.kl or 0, abs=1e-6)
    for a, b in zip(pad_lp, sh_lp):
        torch.testing.assert_close(b, a, atol=5e-5, rtol=0)


def test_the_attention_fp32_limit_is_fixed_at_the_trainers_start(tiny_config, monkeypatch) -> None:
    """bf16 on a CPU: ``auto`` measures once, at the start; a number pins it without measuring; fp32 trainers set 0.
    The limit then holds whatever the thread count of a pass (a reference pass scores as the gradient pass)."""
    from agentrl.trainer import sdpa_precision

    measured = []
    monkeypatch.setattr(sdpa_precision, "measure_limit", lambda *a: measured.append(a) or 192)
    with Trainer(tiny_config(dtype="bf16")) as tr:
        assert tr.attention_fp32_max_keys == sdpa_precision.limit() == 192
        cfg = tr._policy.lm.config
        assert measured == [(cfg.num_attention_heads, cfg.num_key_value_heads,
                             cfg.hidden_size // cfg.num_attention_heads)]
        threads = torch.get_num_threads()
        try:  # a pass on more threads (a borrowed core) neither measures again nor changes the limit
            torch.set_num_threads(threads + 1)
            tr.logprobs(random_batch(3))
        finally:
            torch.set_num_threads(threads)
        tr.rl_step(random_batch(3), current_version=0)
        assert sdpa_precision.limit() == 192 and len(measured) == 1
    with Trainer(tiny_config(dtype="bf16", attention_fp32_max_keys=64)) as tr:
        assert tr.attention_fp32_max_keys == sdpa_precision.limit() == 64 and len(measured) == 1
    with Trainer(tiny_config(dtype="fp32", attention_fp32_max_keys=64)) as tr:
        assert tr.attention_fp32_max_keys == sdpa_precision.limit() == 0


def test_a_resumed_trainer_keeps_the_attention_limit_of_its_checkpoint(tiny_config, monkeypatch, tmp_path) -> None:
    """``auto`` measures at every start; a resumed run takes the limit its checkpoint was trained with (another
    measurement could pick another path for the same shapes), a pinned setting stays pinned."""
    from agentrl.trainer import sdpa_precision

    monkeypatch.setattr(sdpa_precision, "measure_limit", lambda *a: 192)
    with Trainer(tiny_config(dtype="bf16")) as tr:
        tr.save_checkpoint(tmp_path / "ck")
    monkeypatch.setattr(sdpa_precision, "measure_limit", lambda *a: 128)
    with Trainer(tiny_config(dtype="bf16")) as tr:
        assert tr.attention_fp32_max_keys == 128
        tr.load_checkpoint(tmp_path / "ck")
        assert tr.attention_fp32_max_keys == sdpa_precision.limit() == 192
    with Trainer(tiny_config(dtype="bf16", attention_fp32_max_keys=64)) as tr:
        tr.load_checkpoint(tmp_path / "ck")
        assert tr.attention_fp32_max_keys == sdpa_precision.limit() == 64
    with Trainer(tiny_config(dtype="fp32")) as tr:  # an fp32 checkpoint says nothing about bf16 attention
        tr.save_checkpoint(tmp_path / "fp32")
    with Trainer(tiny_config(dtype="bf16")) as tr:
        tr.load_checkpoint(tmp_path / "fp32")
        assert tr.attention_fp32_max_keys == sdpa_precision.limit() == 128


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_weights_kept_gathered_through_a_step_change_nothing_but_the_gathers(tiny_config, dtype: str,
                                                                               monkeypatch) -> None:
    """``keep_gathered``: the same losses, gradients and weights as re-gathering for every pass (several
    micro-batches, two updates a step with a proximal pass, the reference pass), with fewer all-gathers, and every
    unit sharded again when the step ends (nothing gathered is kept past it)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group_mod

    gathers = [0]  # a unit's weights gathered (at world size 1: copied, and cast in bf16) from its shards
    real = group_mod.FSDPParamGroup._to_unsharded

    def counting(self: Any) -> None:
        gathers[0] += not self.is_unsharded
        real(self)

    monkeypatch.setattr(group_mod.FSDPParamGroup, "_to_unsharded", counting)
    # recomputation too (checkpointing on), micro-batches of at most 48 tokens: ~6 per update
    cfg: dict[str, Any] = dict(lr=1e-2, dtype=dtype, micro_batch_tokens=48, mini_batches=2, pad_to_multiple_of=1,
                               activation_checkpointing=True, loss={"correction": "decoupled", "kl_coef": 0.05})
    runs = {}
    for keep in (False, True):
        with Trainer(tiny_config(keep_gathered=keep, **cfg)) as tr:
            assert tr.keep_gathered is keep
            units = sum(isinstance(m, FSDPModule) for m in tr._policy.modules())
            ref_units = sum(isinstance(m, FSDPModule) for m in tr._ref.modules())
            ms, step_gathers = [], []
            for s in range(2):
                gathers[0] = 0
                ms.append(tr.rl_step(random_batch(s), current_version=s))
                step_gathers.append(gathers[0])
            sft = tr.sft_step(random_batch(5))
            assert all(m._get_fsdp_state()._fsdp_param_group.is_sharded
                       for m in tr._policy.modules() if isinstance(m, FSDPModule))
            runs[keep] = (ms, sft, step_gathers, tr.logprobs(random_batch(9)))
    (ms0, sft0, g0, lp0), (ms1, sft1, g1, lp1) = runs[False], runs[True]
    # kept: each unit gathered once per block (the proximal pass, the reference pass, each of the two updates)
    assert g1 == [3 * units + ref_units] * 2
    assert min(g0) > 3 * g1[0]  # re-gathered per micro-batch's forward, recomputation and backward
    for a, b in zip(ms0, ms1):
        assert a.num_trajectories == b.num_trajectories
        assert b.loss == pytest.approx(a.loss, abs=1e-6) and b.grad_norm == pytest.approx(a.grad_norm, rel=1e-5)
        assert b.kl == pytest.approx(a.kl, abs=1e-7)
    assert sft1.loss == pytest.approx(sft0.loss, abs=1e-6)
    for x, y in zip(lp0, lp1):
        torch.testing.assert_close(y, x, atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_keep_gathered_auto_is_on_for_one_rank_in_bf16(tiny_config, dtype: str) -> None:
    assert tiny_config().keep_gathered is False  # the default: off (docs/results.md)
    with Trainer(tiny_config(dtype=dtype, attention_fp32_max_keys=0, keep_gathered="auto")) as tr:
        assert tr.world_size == 1 and tr.keep_gathered is (dtype == "bf16")


@pytest.mark.parametrize("layout", ["packed", "padded", "shared_prefix"])
def test_padding_to_a_multiple_changes_nothing_but_the_shapes(tiny_config, layout: str, monkeypatch) -> None:
    """``pad_to_multiple_of``: every micro-batch's rows and every LM-head chunk come in multiples of it (a few
    shapes, not one per micro-batch), and the losses, gradients, updated weights and logprobs are those without it
    (fp32 round-off); entropy and the token counts too."""
    from agentrl.trainer.model import ScoredLM

    widths: list[int] = []
    head_rows: list[int] = []
    real_forward, real_score = ScoredLM.forward, ScoredLM._score

    def forward(self: ScoredLM, input_ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        widths.append(input_ids.shape[-1])
        return real_forward(self, input_ids, *args, **kwargs)

    def score(self: ScoredLM, h: torch.Tensor, *args: Any) -> Any:
        head_rows.append(h.shape[0])
        return real_score(self, h, *args)

    monkeypatch.setattr(ScoredLM, "forward", forward)
    monkeypatch.setattr(ScoredLM, "_score", score)
    runs = {}
    for multiple in (1, 16):
        widths.clear()
        head_rows.clear()
        cfg = tiny_config(lr=1e-2, layout=layout, micro_batch_tokens=48, logits_chunk_tokens=40,
                          pad_to_multiple_of=multiple, loss={"kl_coef": 0.05, "entropy_coef": 0.01})
        with Trainer(cfg) as tr:
            assert tr.pad_to_multiple_of == multiple
            ms = [tr.rl_step(grouped_batch(s) + random_batch(s, n=3), current_version=s) for s in range(2)]
            runs[multiple] = (ms, tr.logprobs(random_batch(9) + grouped_batch(9)))
        if multiple == 16:
            assert widths and all(w % 16 == 0 for w in widths)
            assert head_rows and all(n % 16 == 0 for n in head_rows)
        else:
            assert any(w % 16 for w in widths) and any(n % 16 for n in head_rows)  # the premise: odd shapes
    (ms0, lp0), (ms1, lp1) = runs[1], runs[16]
    for a, b in zip(ms0, ms1):
        assert (a.tokens, a.model_tokens, a.num_trajectories) == (b.tokens, b.model_tokens, b.num_trajectories)
        assert b.loss == pytest.approx(a.loss, abs=1e-6) and b.grad_norm == pytest.approx(a.grad_norm, rel=1e-5)
        assert b.kl == pytest.approx(a.kl, abs=1e-7) and b.entropy == pytest.approx(a.entropy, abs=1e-6)
    for x, y in zip(lp0, lp1):
        torch.testing.assert_close(y, x, atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_pad_to_multiple_of_auto_pads_bf16_on_a_cpu(tiny_config, dtype: str) -> None:
    with Trainer(tiny_config(dtype=dtype, attention_fp32_max_keys=0)) as tr:
        assert tr.pad_to_multiple_of == (64 if dtype == "bf16" else 1)
        assert tr._policy.pad_scored_to == tr.pad_to_multiple_of
