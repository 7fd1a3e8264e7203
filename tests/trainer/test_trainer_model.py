"""The policy module on the real tiny model: the LM head on scored positions only (in chunks or at once) equals
the plain all-positions path, and the activation probe measures what checkpointing saves."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from trainer_helpers import grouped_batch, random_batch
from transformers import AutoModelForCausalLM

from agentrl.trainer import LossConfig, Trainer
from agentrl.trainer.collate import plan_micro_batches, prepare_rl
from agentrl.trainer.model import ScoredLM, activation_bytes_per_token, load_lm


@pytest.fixture(scope="module")
def tiny_lm(tiny_model_path: Path):
    return load_lm(tiny_model_path)  # the trainer's attention: shared-prefix units computed apart


def _all_positions(lm, batch, samples, temperature: float) -> tuple[dict[tuple[int, int], torch.Tensor], torch.Tensor]:
    """The plain path: each sequence alone, logits at EVERY position, log_softmax, the target's logprob gathered;
    returns {(sample, input position): logp} and the loss sum(w * logp + entropy) over the scored positions."""
    out, loss = {}, torch.zeros(())
    for s in samples:
        logits = lm(input_ids=s.input_ids[None]).logits[0].float() / temperature
        logp = torch.log_softmax(logits, -1)
        lp = logp[s.score_pos].gather(-1, s.targets[:, None]).squeeze(-1)
        ent = -(logp.exp() * logp).sum(-1)[s.score_pos]
        loss = loss + ((s.index + 1) * lp).sum() + ent.sum()
        for pos, v in zip(s.score_pos.tolist(), lp):
            out[(s.index, pos)] = v
    return out, loss


@pytest.mark.parametrize("layout", ["packed", "padded", "shared_prefix"])
@pytest.mark.parametrize("chunk", [None, 5])
def test_scored_positions_only_equal_the_all_positions_path(tiny_lm, layout: str, chunk: int | None) -> None:
    """Per-token logprobs, entropies and the gradients of a loss built from them equal those of full logits at
    every position (fp32), in every layout; chunk 5 splits each micro-batch's scored tokens into checkpointed
    chunks (recomputed in the backward pass)."""
    batch = random_batch(3, n=6) + grouped_batch(4, groups=2)
    samples = prepare_rl(batch, current_version=0, cfg=LossConfig()).samples
    temperature = 1.3
    ref, ref_loss = _all_positions(tiny_lm, batch, samples, temperature)
    ref_grads = torch.autograd.grad(ref_loss, list(tiny_lm.parameters()))

    scored = ScoredLM(tiny_lm, logits_chunk_tokens=chunk)
    mbs = plan_micro_batches(samples, mode="token_mean", token_budget=40, layout=layout)
    assert len(mbs) > 1
    if chunk is not None:
        assert max(mb.targets.numel() for mb in mbs) > chunk  # the chunked path really runs
    loss, got = torch.zeros(()), {}
    for mb in mbs:
        logp, ent = scored(mb.input_ids, mb.position_ids, mb.attention_mask, mb.score_index, mb.targets,
                           temperature, "grad", mb.prefix_attention)
        assert ent is not None
        loss = loss + ((mb.seq_index + 1) * logp).sum() + ent.sum()
        width = mb.input_ids.shape[1]
        for k, (seq, flat) in enumerate(zip(mb.seq_index.tolist(), mb.score_index.tolist())):
            got.setdefault(seq, []).append((logp[k].detach(), flat, width))
    grads = torch.autograd.grad(loss, list(tiny_lm.parameters()))
    assert sum(len(v) for v in got.values()) == len(ref)
    for s in samples:  # each sequence's logprobs in score-position order
        mine = torch.stack([v for v, _, _ in got[s.index]])
        theirs = torch.stack([ref[(s.index, p)] for p in s.score_pos.tolist()])
        torch.testing.assert_close(mine, theirs.detach(), atol=2e-5, rtol=0)
    torch.testing.assert_close(loss.detach(), ref_loss.detach(), atol=1e-3, rtol=1e-5)
    for g, r in zip(grads, ref_grads):  # fp32 round-off of sums over ~100 tokens in a different order
        assert r.abs().max() > 0
        torch.testing.assert_close(g, r, atol=1e-5 * float(r.abs().max()), rtol=1e-4)


def test_the_entropy_metric_equals_the_entropy_and_is_not_recomputed_in_the_backward_pass(tiny_lm, monkeypatch) -> None:
    """The metric (no gradient) is the entropy's value, from the log-probabilities' own logsumexp; a checkpointed
    chunk's recomputation in the backward pass does not compute it again (it ends at the last tensor saved for the
    backward pass, before the metric: computing the metric earlier in ``_score`` would double its cost)."""
    from agentrl.trainer import model as model_mod

    calls = []
    real = model_mod.entropy_given_lse
    monkeypatch.setattr(model_mod, "entropy_given_lse", lambda *a: calls.append(1) or real(*a))
    samples = prepare_rl(random_batch(3, n=6), current_version=0, cfg=LossConfig()).samples
    (mb,) = plan_micro_batches(samples, mode="token_mean", token_budget=1000, layout="packed")
    scored = ScoredLM(tiny_lm, logits_chunk_tokens=5)
    args = (mb.input_ids, mb.position_ids, mb.attention_mask, mb.score_index, mb.targets, 1.3)
    logp, ent = scored(*args, "grad")
    logp_m, metric = scored(*args, "metric")
    assert metric is not None and not metric.requires_grad and len(calls) == -(-mb.targets.numel() // 5)
    torch.testing.assert_close(metric, ent.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logp_m, logp)
    logp_m.sum().backward()  # recomputes every chunk
    assert len(calls) == -(-mb.targets.numel() // 5)


def test_the_activation_probe_measures_what_checkpointing_saves(tiny_model_path: Path) -> None:
    lm = AutoModelForCausalLM.from_pretrained(str(tiny_model_path), dtype=torch.float32, attn_implementation="sdpa")
    cfg = lm.config
    full = activation_bytes_per_token(lm)
    # every layer keeps at least its input, q/k/v/o inputs and the MLP's three intermediates in fp32
    assert full > cfg.num_hidden_layers * 4 * (3 * cfg.hidden_size + 3 * cfg.intermediate_size)
    lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lm.train()
    checkpointed = activation_bytes_per_token(lm)
    assert checkpointed < full / 3  # the layers' inputs only (and the final norm)


def test_the_activation_probe_leaves_nothing_alive(tiny_model_path: Path) -> None:
    """The probe's graph is freed with its output: the model goes when its last reference does (a saved tensor
    packed as itself once made a cycle that kept every trainer's unsharded model alive)."""
    import gc
    import weakref

    lm = AutoModelForCausalLM.from_pretrained(str(tiny_model_path), dtype=torch.float32, attn_implementation="sdpa")
    weight = weakref.ref(lm.get_decoder().layers[0].mlp.up_proj.weight)
    assert activation_bytes_per_token(lm) > 0
    del lm
    gc.collect()
    assert weight() is None


def test_a_closed_trainer_frees_its_models(tiny_config) -> None:
    import gc
    import weakref

    tr = Trainer(tiny_config(activation_checkpointing="auto", loss={"kl_coef": 0.1}))
    refs = [weakref.ref(p) for p in (*tr._policy.parameters(), *tr._ref.parameters())]
    tr.close()  # the trainer object stays (as `with Trainer(...) as sft:` leaves it): its models must not
    gc.collect()
    assert [r for r in refs if r() is not None] == []


def test_activation_checkpointing_auto_recomputes_exactly_the_micro_batches_over_budget(tiny_config) -> None:
    """auto: a micro-batch whose measured activations exceed activation_memory_gb runs each decoder layer twice
    (forward, then the recomputation in the backward pass); one under it runs them once; the step is the same."""
    batch = random_batch(3)
    results = {}
    for budget_gb in (1e-6, 100.0):
        with Trainer(tiny_config(lr=1e-2, activation_checkpointing="auto", activation_memory_gb=budget_gb,
                                 micro_batch_tokens=40)) as tr:
            assert tr.checkpointing == "auto"
            layer = tr._ckpt_layers[0]
            calls = []
            hook = layer.register_forward_pre_hook(lambda *_, calls=calls: calls.append(1))
            m = tr.rl_step(batch, current_version=0)
            hook.remove()
            n_mb = len(tr._plan(list(prepare_rl(batch, current_version=0, cfg=tr.config.loss).samples),
                                "token_mean", None))
            results[budget_gb] = (m, len(calls), n_mb)
    (small, calls_s, n_mb), (big, calls_b, _) = results[1e-6], results[100.0]
    assert n_mb > 1 and calls_s == 2 * n_mb and calls_b == n_mb
    assert small.loss == pytest.approx(big.loss, abs=1e-7) and small.grad_norm == pytest.approx(big.grad_norm, rel=1e-5)


def test_activation_checkpointing_auto_recomputes_as_few_layers_as_the_budget_needs(tiny_config) -> None:
    """A budget between half and all of each micro-batch's activations: the first of the tiny model's two decoder
    layers is recomputed (it runs twice a micro-batch), the second is not; the step is the one without it."""
    batch = random_batch(3)
    with Trainer(tiny_config(activation_checkpointing="auto", micro_batch_tokens=40)) as probe:
        plan = probe._plan(list(prepare_rl(batch, current_version=0, cfg=probe.config.loss).samples),
                           "token_mean", None)
        per_token = probe._act_bytes_per_token
        assert per_token and len(probe._ckpt_layers) == 2
        need = [mb.input_ids.numel() * per_token for mb in plan]
        assert max(need) / 2 < min(need), need  # one budget can fall between half and all of each
        budget_gb = (max(need) / 2 + min(need)) / 2 / 1e9
        for tokens, expected in ((1, 0), (int(budget_gb * 1e9 / per_token), 0),
                                 (int(budget_gb * 1e9 / per_token * 1.9), 1), (10**9, 2)):
            probe.config = probe.config.model_copy(update={"activation_memory_gb": budget_gb})
            assert probe.layers_to_checkpoint(tokens) == expected, (tokens, expected)
    results = {}
    for budget in (budget_gb, 100.0):
        with Trainer(tiny_config(lr=1e-2, activation_checkpointing="auto", activation_memory_gb=budget,
                                 micro_batch_tokens=40)) as tr:
            calls: list[list[int]] = [[], []]
            hooks = [layer.register_forward_pre_hook(lambda *_, c=c: c.append(1))
                     for layer, c in zip(tr._ckpt_layers, calls)]
            m = tr.rl_step(batch, current_version=0)
            for h in hooks:
                h.remove()
            results[budget] = (m, [len(c) for c in calls])
    (part, part_calls), (none, none_calls) = results[budget_gb], results[100.0]
    assert part_calls == [2 * len(plan), len(plan)] and none_calls == [len(plan), len(plan)]
    assert part.loss == pytest.approx(none.loss, abs=1e-7) and part.grad_norm == pytest.approx(none.grad_norm, rel=1e-5)


def test_activation_checkpointing_off_and_on_are_left_as_given(tiny_config) -> None:
    for setting in (False, True):
        with Trainer(tiny_config(activation_checkpointing=setting)) as tr:
            assert tr.checkpointing is setting and bool(tr._ckpt_layers) is setting


def test_no_reference_model_or_pass_without_a_kl_term(tiny_config) -> None:
    """kl_coef 0: the reference policy is neither loaded nor run (one policy forward per micro-batch)."""
    calls = {"n": 0}

    def count(*_: object) -> None:
        calls["n"] += 1

    batch = random_batch(5)
    for kl_coef, forwards in ((0.0, 1), (0.1, 2)):
        calls["n"] = 0
        with Trainer(tiny_config(micro_batch_tokens=10_000, loss={"kl_coef": kl_coef, "correction": "none"})) as tr:
            hooks = [m.register_forward_pre_hook(count) for m in (tr._policy, tr._ref) if m is not None]
            m = tr.rl_step(batch, current_version=0)
            for h in hooks:
                h.remove()
            assert (tr._ref is None) == (kl_coef == 0)
        assert calls["n"] == forwards and (m.kl is None) == (kl_coef == 0)
