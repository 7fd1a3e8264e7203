"""bf16 attention computed in fp32 where this CPU is faster so: the measured choice and its results."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from agentrl.trainer import sdpa_precision


def _timer(gains: dict[int, float]):
    """A fake timer: bf16 takes ``gain`` times fp32's time at each key length."""
    calls = []

    def timer(heads, kv_heads, dim, keys):
        calls.append(keys)
        return gains[keys], 1.0

    return timer, calls


ALL = sdpa_precision.LENGTHS


@pytest.mark.parametrize(("gains", "limit", "timed"), [
    ({64: 2.5, 128: 2.2, 192: 1.5, 256: 1.7, 384: 1.05, 512: 3, 768: 3, 1024: 3}, 256,
     [64, 128, 192, 256, 384]),  # stops at the first length fp32 loses
    (dict.fromkeys(ALL, 3.0) | {64: 1.0}, 0, [64]),  # not faster by MIN_GAIN at the shortest: never
    (dict.fromkeys(ALL, 2.0), 1024, list(ALL)),
])
def test_the_limit_is_the_longest_key_length_up_to_which_fp32_won(gains, limit, timed) -> None:
    timer, calls = _timer(gains)
    assert sdpa_precision.measure_limit(9, 3, 64, timer=timer) == limit
    assert calls == timed


def test_timing_a_pair_runs_both_ways() -> None:
    bf16_s, fp32_s = sdpa_precision.time_pair(2, 1, 16, 128, rounds=1)
    assert 0 < bf16_s < 10 and 0 < fp32_s < 10


def _qkv(dtype=torch.bfloat16, keys: int = 40, grad: bool = True):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, keys, 16, generator=g).to(dtype).requires_grad_(grad) for h in (4, 2, 2))
    return q, k, v


def test_only_bf16_cpu_attention_over_few_enough_keys_is_upcast_with_or_without_gradients(monkeypatch) -> None:
    monkeypatch.setattr(sdpa_precision, "_limit", 64)
    q, k, _ = _qkv()
    assert sdpa_precision.upcasts(q, k)
    assert not sdpa_precision.upcasts(q, torch.zeros(2, 2, 65, 16, dtype=torch.bfloat16))  # over the limit
    with torch.no_grad():
        assert sdpa_precision.upcasts(q, k)  # a reference pass scores as the policy's gradient pass does
    q32, k32, _ = _qkv(torch.float32)
    assert not sdpa_precision.upcasts(q32, k32)
    monkeypatch.setattr(sdpa_precision, "_limit", 0)
    assert not sdpa_precision.upcasts(q, k)


def test_measuring_leaves_the_global_generator_and_works_under_no_grad_and_inference_mode() -> None:
    state = torch.random.get_rng_state()
    with torch.no_grad():
        sdpa_precision.time_pair(2, 1, 16, 64, rounds=1)
    with torch.inference_mode():
        sdpa_precision.time_pair(2, 1, 16, 64, rounds=1)
    assert torch.equal(torch.random.get_rng_state(), state)


def test_upcast_attention_is_fp32_attention_of_the_bf16_inputs_rounded_once(monkeypatch) -> None:
    """Same inputs, fp32 softmax and sums, one rounding of the output to bf16; gradients arrive in bf16."""
    mask = torch.ones(40, 40, dtype=torch.bool).tril()[None, None].expand(2, 1, 40, 40)
    monkeypatch.setattr(sdpa_precision, "_limit", 1024)
    q, k, v = _qkv()
    out = sdpa_precision.sdpa(q, k, v, attn_mask=mask, enable_gqa=True)
    ref = F.scaled_dot_product_attention(q.detach().float(), k.detach().float(), v.detach().float(), attn_mask=mask,
                                         enable_gqa=True).to(torch.bfloat16)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    out.float().sum().backward()
    assert q.grad is not None and q.grad.dtype == torch.bfloat16 and k.grad.abs().sum() > 0
    monkeypatch.setattr(sdpa_precision, "_limit", 0)  # over the limit: bf16's own kernel
    q2, k2, v2 = _qkv()
    direct = F.scaled_dot_product_attention(q2, k2, v2, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(sdpa_precision.sdpa(q2, k2, v2, attn_mask=mask, enable_gqa=True), direct,
                               rtol=0, atol=0)
    torch.testing.assert_close(out, direct, atol=2e-2, rtol=0)  # both bf16 attention: round-off apart
