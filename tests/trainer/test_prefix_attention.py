"""The shared-prefix attention: each unit computed apart gives the masked SDPA call's outputs and gradients at every
real token, padding and grouped-query heads included, and the trainer's models really use it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from trainer_helpers import grouped_batch, random_batch

from agentrl.trainer import LossConfig
from agentrl.trainer import prefix_attention as pa
from agentrl.trainer.collate import plan_micro_batches, prepare_rl


def _micro_batches(budget: int):
    batch = grouped_batch(7, groups=3, group_size=4) + random_batch(8, n=5, group_size=1)
    samples = prepare_rl(batch, current_version=0, cfg=LossConfig()).samples
    return plan_micro_batches(samples, mode="token_mean", token_budget=budget, layout="shared_prefix")


def _real(mb) -> torch.Tensor:
    """Flat positions of the real (non-padding) tokens: those some unit's prefix or continuation covers."""
    layout = mb.prefix_attention
    return layout.dst.sort().values


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (3, 3)])
@pytest.mark.parametrize("budget", [40, 100, 10_000])
def test_unitwise_attention_equals_the_masked_call(heads: int, kv_heads: int, budget: int) -> None:
    mbs = _micro_batches(budget)
    if budget > 40:  # several rows, padding, several units in a row
        assert any(mb.num_tokens < mb.input_ids.numel() for mb in mbs)
        assert any(mb.prefix_attention.prefix_index.shape[0] > mb.input_ids.shape[0] for mb in mbs)
    torch.manual_seed(0)
    for mb in mbs:
        layout = mb.prefix_attention
        assert layout is not None
        rows, width = mb.input_ids.shape
        real = _real(mb)
        assert real.numel() == mb.num_tokens and real.unique().numel() == real.numel()  # each real token once
        q = torch.randn(rows, heads, width, 8, dtype=torch.float64, requires_grad=True)
        k = torch.randn(rows, kv_heads, width, 8, dtype=torch.float64, requires_grad=True)
        v = torch.randn(rows, kv_heads, width, 8, dtype=torch.float64, requires_grad=True)
        weight = torch.randn(rows * width, heads, 8, dtype=torch.float64)

        got = pa.prefix_attention_forward(q, k, v, layout, scaling=0.3).reshape(rows * width, heads, 8)
        rep = heads // kv_heads
        want = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                              attn_mask=mb.attention_mask, scale=0.3)
        want = want.transpose(1, 2).reshape(rows * width, heads, 8)
        torch.testing.assert_close(got[real], want[real])
        pad = torch.ones(rows * width, dtype=torch.bool)
        pad[real] = False
        assert not got[pad].any()  # padding: zeros, never NaN

        g_got = torch.autograd.grad((got[real] * weight[real]).sum(), (q, k, v))
        g_want = torch.autograd.grad((want[real] * weight[real]).sum(), (q, k, v))
        for a, b in zip(g_got, g_want):
            torch.testing.assert_close(a, b)


def test_the_attention_function_falls_back_to_sdpa_where_a_mask_is_not_enough(monkeypatch) -> None:
    """Softcapping (and sinks, short windows, dropout) is more than a mask: HF's SDPA with the 4D mask runs."""
    mb = _micro_batches(10_000)[0]
    rows, width = mb.input_ids.shape
    q = torch.randn(rows, 2, width, 8)
    k, v = torch.randn(rows, 2, width, 8), torch.randn(rows, 2, width, 8)
    calls: list[str] = []
    real_forward = pa.prefix_attention_forward
    monkeypatch.setattr(pa, "prefix_attention_forward", lambda *a, **kw: calls.append("unit") or real_forward(*a, **kw))
    module = torch.nn.Module()
    pa.attention(module, q, k, v, mb.attention_mask, scaling=0.5, prefix_attention=mb.prefix_attention)
    assert calls == ["unit"]
    out, _ = pa.attention(module, q, k, v, mb.attention_mask, scaling=0.5, prefix_attention=mb.prefix_attention,
                          sliding_window=4)
    assert calls == ["unit"]  # a window shorter than the row: the masked path (which ignores it, as HF's SDPA does)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mb.attention_mask, scale=0.5).transpose(1, 2)
    real = _real(mb)
    torch.testing.assert_close(out.reshape(rows * width, 2, 8)[real], want.reshape(rows * width, 2, 8)[real])
    pa.attention(module, q, k, v, mb.attention_mask, scaling=0.5, prefix_attention=None)
    assert calls == ["unit"]


def test_the_trainers_models_attend_unit_by_unit(tiny_model_path, monkeypatch) -> None:
    """``load_lm`` selects the attention function, and a ScoredLM forward over shared-prefix micro-batches reaches
    the unit-wise path in every layer (the logprobs' equality with the plain path is in test_trainer_model)."""
    from agentrl.trainer.model import ScoredLM, load_lm

    lm = load_lm(tiny_model_path)
    assert lm.config._attn_implementation == pa.ATTENTION
    calls = []
    real_forward = pa.prefix_attention_forward
    monkeypatch.setattr(pa, "prefix_attention_forward", lambda *a, **kw: calls.append(1) or real_forward(*a, **kw))
    mb = _micro_batches(10_000)[0]
    with torch.no_grad():
        ScoredLM(lm)(mb.input_ids, mb.position_ids, mb.attention_mask, mb.score_index, mb.targets,
                     prefix_attention=mb.prefix_attention)
    assert len(calls) == lm.config.num_hidden_layers


def test_bf16_attention_upcast_by_the_measured_choice_on_both_paths(monkeypatch) -> None:
    """In bf16 on a CPU, under the measured key-length limit, the unit-wise path and the masked fallback (a float
    mask included) compute in fp32: each equals fp32 attention of the same bf16 inputs, rounded once to bf16; over
    the limit both stay in bf16."""
    from agentrl.trainer import sdpa_precision

    mb = _micro_batches(10_000)[0]
    rows, width = mb.input_ids.shape
    real = _real(mb)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(rows, 4, width, 8, generator=g).to(torch.bfloat16) for _ in range(3))
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mb.attention_mask,
                                          scale=0.5).transpose(1, 2).reshape(rows * width, 4, 8)[real]
    float_mask = torch.zeros(mb.attention_mask.shape, dtype=torch.bfloat16).masked_fill(~mb.attention_mask,
                                                                                          float("-inf"))
    module = torch.nn.Module()
    monkeypatch.setattr(sdpa_precision, "_limit", 10_000)
    said: list[bool] = []
    real_upcasts = sdpa_precision.upcasts
    monkeypatch.setattr(sdpa_precision, "upcasts", lambda *a: said.append(real_upcasts(*a)) or said[-1])
    unit = pa.attention(module, q, k, v, mb.attention_mask, scaling=0.5, prefix_attention=mb.prefix_attention)[0]
    assert said == [True, True]  # the prefixes' call and the continuations'
    masked = pa.attention(module, q, k, v, float_mask, scaling=0.5, prefix_attention=None)[0]
    assert said == [True, True, True] and unit.dtype == masked.dtype == torch.bfloat16
    # the masked path is fp32 attention rounded once; the unit-wise one sums in another order (an ulp of bf16)
    torch.testing.assert_close(masked.reshape(rows * width, 4, 8)[real], want.to(torch.bfloat16), rtol=0, atol=0)
    torch.testing.assert_close(unit.reshape(rows * width, 4, 8)[real].float(), want, atol=8e-3, rtol=8e-3)
    monkeypatch.setattr(sdpa_precision, "_limit", 0)
    masked_bf16 = pa.attention(module, q, k, v, float_mask, scaling=0.5, prefix_attention=None)[0]
    direct = F.scaled_dot_product_attention(q, k, v, attn_mask=float_mask, scale=0.5).transpose(1, 2)
    torch.testing.assert_close(masked_bf16, direct, rtol=0, atol=0)
