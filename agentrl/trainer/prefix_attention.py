"""Attention for the ``shared_prefix`` layout that computes only what its mask lets through.

A shared-prefix row (:mod:`agentrl.trainer.shared_prefix`) holds units ``P S1 S2 … Sn`` side by side; its 4D mask
lets a token of ``Si`` see ``P`` and the earlier tokens of ``Si``, and nothing else. Scaled dot-product attention
with that mask still computes every ``T x T`` score of the row and throws most away: in the demo (rows of 1,024
tokens holding two units of a ~90-token prompt and eight ~55-token responses) less than a tenth of them count, and
the masked call took as long as a causal one over the whole row (~11 % of the demo's fp32 RL step on an AVX2 core).
Here each unit is computed as what it is:

    prefixes:       [U, heads, Pmax, d]  causal (keys past a prefix's length masked)
    continuations:  [C, heads, Smax, d]  against [its unit's prefix ; itself], causal in the second part

so a row of two units costs ``Σ P² / 2 + Σ S·(P + S)`` scores instead of ``T²`` (~5x fewer attention FLOPs in the
demo; on one AVX2 core 37 ms instead of 198 ms for a layer's forward and backward of such a row in isolation, 4.3 s
instead of 10.7 s of attention in a whole demo step, docs/results.md). Each
output equals the masked call's to round-off: same queries, same visible keys, same softmax (tested against it).

It runs as a Hugging Face attention function (:data:`ATTENTION`, registered by :mod:`agentrl.trainer.model`):
the trainer passes the layout as the ``prefix_attention`` keyword, which HF forwards from the decoder to every
attention call. Without it — other layouts, a reference pass of a model whose attention needs more than a mask
(softcapping, a sliding window shorter than the row, attention sinks, dropout) — the call is Hugging Face's own SDPA
with the 4D mask, which every shared-prefix micro-batch still carries.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor

from agentrl.trainer import sdpa_precision

ATTENTION = "agentrl_sdpa"  # the attn_implementation name the trainer loads its models with


@dataclass(slots=True)  # not frozen: FSDP2's input casting rebuilds dataclasses field by field
class PrefixAttention:
    """Where a micro-batch's units sit in its flattened ``[R * T]`` positions (built by ``shared_prefix.build``).

    Padded entries of the index tensors point at position 0; the masks keep them out of every real token's
    attention, and their outputs are dropped (``src``/``dst`` list the real tokens only).
    """

    prefix_index: Tensor  # [U, Pmax] long
    prefix_mask: Tensor  # [U, 1, Pmax, Pmax] bool: causal, keys < the prefix's length
    cont_index: Tensor  # [C, Smax] long
    cont_unit: Tensor  # [C] long: the unit a continuation extends
    cont_mask: Tensor  # [C, 1, Smax, Pmax + Smax] bool: its unit's prefix, then causal over itself
    src: Tensor  # [V] long: rows of cat(prefix outputs [U*Pmax], continuation outputs [C*Smax]) that are real
    dst: Tensor  # [V] long: their flat positions in the micro-batch

    def to(self, device: torch.device) -> PrefixAttention:
        return PrefixAttention(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})

    @classmethod
    def from_units(cls, units: list[tuple[int, int, list[int]]]) -> PrefixAttention:
        """``units``: ``(flat start, prefix length, continuation lengths)`` per unit, continuations laid out after
        the prefix in order (the layout of ``shared_prefix.build``)."""
        p_max = max(p for _, p, _ in units)
        conts = [(u, start + p + sum(lens[:i]), n) for u, (start, p, lens) in enumerate(units)
                 for i, n in enumerate(lens)]
        s_max = max((n for _, _, n in conts), default=1)
        prefix_len = torch.tensor([p for _, p, _ in units])
        starts = torch.tensor([s for s, _, _ in units])
        col = torch.arange(p_max)
        prefix_valid = col[None, :] < prefix_len[:, None]  # [U, Pmax]
        prefix_index = torch.where(prefix_valid, starts[:, None] + col[None, :], 0)
        causal_p = torch.ones((p_max, p_max), dtype=torch.bool).tril()
        prefix_mask = (causal_p[None] & prefix_valid[:, None, :])[:, None]

        cont_unit = torch.tensor([u for u, _, _ in conts], dtype=torch.long)
        cont_start = torch.tensor([s for _, s, _ in conts], dtype=torch.long)
        cont_len = torch.tensor([n for _, _, n in conts], dtype=torch.long)
        scol = torch.arange(s_max)
        cont_valid = scol[None, :] < cont_len[:, None]  # [C, Smax]
        cont_index = torch.where(cont_valid, cont_start[:, None] + scol[None, :], 0)
        sees_prefix = prefix_valid[cont_unit][:, None, :].expand(-1, s_max, -1)  # [C, Smax, Pmax]
        causal_s = torch.ones((s_max, s_max), dtype=torch.bool).tril()[None].expand(len(conts), -1, -1)
        cont_mask = torch.cat([sees_prefix, causal_s], dim=2)[:, None]

        src = torch.cat([prefix_valid.reshape(-1), cont_valid.reshape(-1)]).nonzero().squeeze(1)
        dst = torch.cat([prefix_index.reshape(-1), cont_index.reshape(-1)])[src]
        return cls(prefix_index, prefix_mask, cont_index, cont_unit, cont_mask, src, dst)


def _gather(x: Tensor, index: Tensor) -> Tensor:
    """``x`` ``[R*T, heads, d]`` at ``index`` ``[N, L]`` → ``[N, heads, L, d]``."""
    return x.index_select(0, index.reshape(-1)).view(*index.shape, *x.shape[1:]).transpose(1, 2)


def prefix_attention_forward(query: Tensor, key: Tensor, value: Tensor, layout: PrefixAttention,
                             scaling: float | None) -> Tensor:
    """``query`` ``[R, H, T, d]``, ``key``/``value`` ``[R, KV, T, d]`` (rotary applied) → ``[R, T, H, d]``, the
    layout of Hugging Face's attention functions' output. Padding positions get zeros."""
    rows, heads, width, dim = query.shape
    gqa = heads != key.shape[1]

    def flat(x: Tensor) -> Tensor:
        return x.transpose(1, 2).reshape(rows * width, x.shape[1], dim)

    q, k, v = flat(query), flat(key), flat(value)
    kp, vp = _gather(k, layout.prefix_index), _gather(v, layout.prefix_index)
    out_p = sdpa_precision.sdpa(_gather(q, layout.prefix_index), kp, vp, attn_mask=layout.prefix_mask,
                                scale=scaling, enable_gqa=gqa)
    kc = torch.cat([kp.index_select(0, layout.cont_unit), _gather(k, layout.cont_index)], dim=2)
    vc = torch.cat([vp.index_select(0, layout.cont_unit), _gather(v, layout.cont_index)], dim=2)
    out_c = sdpa_precision.sdpa(_gather(q, layout.cont_index), kc, vc, attn_mask=layout.cont_mask,
                                scale=scaling, enable_gqa=gqa)
    done = torch.cat([out_p.transpose(1, 2).reshape(-1, heads, dim), out_c.transpose(1, 2).reshape(-1, heads, dim)])
    out = query.new_zeros(rows * width, heads, dim).index_copy(0, layout.dst, done.index_select(0, layout.src))
    return out.view(rows, width, heads, dim)


def attention(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
              dropout: float = 0.0, scaling: float | None = None, prefix_attention: PrefixAttention | None = None,
              **kwargs: Any) -> tuple[Tensor, None]:
    """The Hugging Face attention function registered as :data:`ATTENTION`: :func:`prefix_attention_forward` when
    the trainer passes a shared-prefix layout and the model's attention is plain masked softmax attention, else
    Hugging Face's SDPA."""
    window = kwargs.get("sliding_window")
    plain = (
        prefix_attention is not None
        and not dropout
        and kwargs.get("softcap") is None
        and kwargs.get("s_aux") is None
        and (window is None or window >= query.shape[2])
        and getattr(module, "is_causal", True)
    )
    if plain:
        assert prefix_attention is not None
        return prefix_attention_forward(query, key, value, prefix_attention, scaling), None
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if not sdpa_precision.upcasts(query, key):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if attention_mask is not None and attention_mask.is_floating_point():
        attention_mask = attention_mask.float()
    if isinstance(kwargs.get("position_bias"), torch.Tensor):  # T5-style biases join the mask: in fp32 too
        kwargs["position_bias"] = kwargs["position_bias"].float()
    out, _ = sdpa_attention_forward(module, query.float(), key.float(), value.float(), attention_mask,
                                    dropout=dropout, scaling=scaling, **kwargs)
    return out.to(query.dtype), None


def register() -> None:
    """Make :data:`ATTENTION` a valid ``attn_implementation`` (idempotent): the function above, and SDPA's mask
    builder for the masks Hugging Face builds itself (2D padding masks)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(ATTENTION, attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, sdpa_mask)
