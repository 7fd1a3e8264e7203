"""bf16 training's attention on a CPU, computed in fp32 where that is faster on this machine (measured at run time).

PyTorch's CPU scaled dot-product attention (its flash kernel, the one SDPA picks on a CPU) is slower in bf16 than
in fp32 for the short sequences of agentic RL: on a Zen 4 EPYC core (``avx512_bf16``, torch 2.14) the forward and
backward of 8 responses of 70 tokens against 156 keys took 22.5 ms in bf16 and 13.1 ms with the queries, keys and
values cast to fp32 and the output cast back (1.7x; 2.2x for one 86-token prompt), where at 1,024 keys bf16 was
the faster (0.81x); forward alone the two were within 3-13 %. Attention was ~13 % of the demo's bf16 RL step there
(py-spy). Other CPUs differ (AMX computes bf16 natively), so nothing here is fixed to one: a bf16 Trainer on a CPU fixes
the limit once, at its start, before any forward (``trainer.attention_fp32_max_keys``: ``auto`` measures it with
:func:`measure_limit` on rank 0, which every rank then uses; a number pins it; 0 turns the upcast off): both ways
are timed for the model's heads at key lengths from 64 to 1,024 (:data:`LENGTHS`; queries half the keys, as a
response attending to its prompt and itself; alternating, best of 3, by CPU time; ~1-2 s) and the limit is the
longest length up to which fp32 won by :data:`MIN_GAIN`. Calls with more keys, or not in bf16 on a CPU, are left as
they are. The limit stays for the trainer's life: passes without gradients (reference, proximal, scoring) take the
path of the gradient pass over the same shapes, whatever their thread count (forward alone, fp32 was as fast or
3-13 % faster), so the policy and its reference at the same weights score identically (the KL term starts at 0, an
on-policy ratio is 1). Nothing is upcast until a Trainer sets a limit (:func:`set_limit`).

The fp32 path is no less exact: the same bf16 inputs, a softmax and sums in fp32, the output rounded to bf16 as the
bf16 kernel's is; gradients reach the inputs in their own dtype through the casts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

logger = logging.getLogger(__name__)

LENGTHS = (64, 128, 192, 256, 384, 512, 768, 1024)  # key lengths measured, in order: bf16 gains as they grow
MIN_GAIN = 1.1  # fp32 must be this much faster at a length to be used up to it
_limit = 0  # the longest key length computed in fp32 in this process (set_limit); 0: none


def set_limit(keys: int) -> None:
    """bf16 CPU attention over at most ``keys`` keys is computed in fp32 from now on in this process (0: none)."""
    global _limit
    _limit = max(0, int(keys))


def limit() -> int:
    return _limit


def _attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, up: bool) -> None:
    gqa = q.shape[1] != k.shape[1]
    if up:
        out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=gqa)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    out.to(q.dtype).float().sum().backward()


def time_pair(heads: int, kv_heads: int, dim: int, keys: int, rounds: int = 3) -> tuple[float, float]:
    """CPU seconds of this process for one forward and backward of attention of ``keys // 2`` queries over ``keys``
    keys (causal in the queries' own part; ~512 queries in all) in bf16 and with an fp32 upcast: the best of
    ``rounds``, alternating. CPU time, not wall time: another process time-slicing the core (a server starting
    beside the trainer) stretches the latter only. Its own random generator (the global one feeds dropout) and
    autograd outside any enclosing context (no_grad, inference mode, checkpointing's saved-tensor hooks)."""
    queries = max(1, keys // 2)
    n = max(1, 512 // queries)
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode(False), torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(
            lambda t: t, lambda t: t):
        q = torch.randn(n, heads, queries, dim, generator=gen).to(torch.bfloat16).requires_grad_()
        k = torch.randn(n, kv_heads, keys, dim, generator=gen).to(torch.bfloat16).requires_grad_()
        v = torch.randn(n, kv_heads, keys, dim, generator=gen).to(torch.bfloat16).requires_grad_()
        mask = torch.ones(queries, keys, dtype=torch.bool).tril(keys - queries)[None, None].expand(n, 1, -1, -1)
        best = [float("inf"), float("inf")]
        for r in range(rounds + 1):  # the first round warms both up
            for up in (False, True) if r % 2 else (True, False):
                t = time.process_time()
                _attend(q, k, v, mask, up)
                if r:
                    best[up] = min(best[up], time.process_time() - t)
                q.grad = k.grad = v.grad = None
    return best[0], best[1]


def measure_limit(heads: int, kv_heads: int, dim: int,
                  timer: Callable[[int, int, int, int], tuple[float, float]] = time_pair) -> int:
    """The longest of :data:`LENGTHS` up to which fp32 attention beat bf16 by :data:`MIN_GAIN` (0: at none),
    stopping at the first length where it did not."""
    found, seen = 0, []
    for keys in LENGTHS:
        bf16_s, fp32_s = timer(heads, kv_heads, dim, keys)
        seen.append(f"{keys}: {bf16_s / fp32_s:.2f}x")
        if bf16_s < MIN_GAIN * fp32_s:
            break
        found = keys
    logger.info("bf16 attention computed in fp32 up to %d keys on this CPU (forward and backward at %d threads, bf16 "
                "time / fp32 time at %s)", found, torch.get_num_threads(), ", ".join(seen))
    return found


def upcasts(query: Tensor, key: Tensor) -> bool:
    """Whether attention over ``query`` ``[..., heads, T, d]`` and ``key`` ``[..., kv_heads, S, d]`` is computed in
    fp32 here: bf16 on a CPU with no more keys than the limit (with or without gradients: the same shapes always take
    the same path)."""
    return query.dtype == torch.bfloat16 and query.device.type == "cpu" and key.shape[-2] <= _limit


def sdpa(query: Tensor, key: Tensor, value: Tensor, **kwargs: object) -> Tensor:
    """``F.scaled_dot_product_attention``, in fp32 where :func:`upcasts` says so (a floating-point mask follows)."""
    if not upcasts(query, key):
        return F.scaled_dot_product_attention(query, key, value, **kwargs)  # type: ignore[arg-type]
    mask = kwargs.get("attn_mask")
    if isinstance(mask, Tensor) and mask.is_floating_point():
        kwargs["attn_mask"] = mask.float()
    out = F.scaled_dot_product_attention(query.float(), key.float(), value.float(), **kwargs)  # type: ignore[arg-type]
    return out.to(query.dtype)
