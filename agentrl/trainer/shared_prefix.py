"""The ``shared_prefix`` layout: a prompt is run once for all the responses that continue it.

A GRPO group holds n responses to one prompt; the ``padded`` and ``packed`` layouts run that prompt n times (in
the demo the prompt is ~60 % of a sequence's tokens). Here a row holds a prompt P once, then its continuations:

    tokens:    P  P  P  P | S1 S1 S1 | S2 S2 | … | pad
    positions: 0  1  2  3 | 4  4+1 … | 4  5  | … | 0

A token of ``S_i`` attends to P and to the earlier tokens of ``S_i``, never to another ``S_j``; P attends causally
within P. Each hidden state is then exactly that of ``P + S_i`` run alone (positions continue at ``len(P)``), so
logprobs and gradients equal the other layouts' to round-off (tested). The shared prefix of a sequence is the part
before its first scored token; its last position predicts each response's first token, so several scored entries
may point at that one position (the LM head runs once per entry, gradients add up).

The trainer's models attend through :mod:`agentrl.trainer.prefix_attention`, which computes each unit's prefix and
continuations apart (``Σ P² / 2 + Σ S·(P + S)`` scores instead of a row's ``T²``). Every micro-batch also carries
the equivalent 4D mask (``[rows, 1, T, T]`` bool, True = attend), which Hugging Face's SDPA uses where that
attention does not apply (attention with softcapping, sinks, a short sliding window, dropout). Rows pack whole units (a prefix and its continuations) first-fit
decreasing up to the longest unit; ranks get whole units, balanced by tokens (the planners of
:mod:`agentrl.trainer.collate`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from agentrl.trainer.collate import MicroBatch, ScoredTokens, SeqSample, assign_ranks, pack_rows, padded_width
from agentrl.trainer.prefix_attention import PrefixAttention


@dataclass(frozen=True, slots=True)
class Unit:
    """Samples sharing their first ``prefix_len`` tokens (everything before their first scored token)."""

    prefix_len: int
    samples: tuple[SeqSample, ...]

    @property
    def length(self) -> int:
        return self.prefix_len + sum(s.length - self.prefix_len for s in self.samples)

    @property
    def index(self) -> int:  # a stable tie-break for the planners: the first sample's
        return self.samples[0].index


def make_units(samples: Sequence[SeqSample]) -> list[Unit]:
    """Samples grouped by their unscored prefix (identical token ids), in order of first appearance."""
    by_prefix: dict[bytes, list[SeqSample]] = {}
    lengths: dict[bytes, int] = {}
    for s in samples:
        p = int(s.score_pos[0]) + 1  # the first scored token; score positions are ascending
        key = s.input_ids[:p].numpy().tobytes()
        by_prefix.setdefault(key, []).append(s)
        lengths[key] = p
    return [Unit(lengths[k], tuple(v)) for k, v in by_prefix.items()]


def build(rows: list[list[Unit]], weights: dict[int, Tensor], pad_id: int, multiple: int = 1) -> MicroBatch:
    """One micro-batch of shared-prefix rows (padded to a multiple of ``multiple`` tokens), with its 4D attention
    mask."""
    width = padded_width(max(sum(u.length for u in row) for row in rows), multiple)
    n_rows = len(rows)
    ids = torch.full((n_rows, width), pad_id, dtype=torch.long)
    pos = torch.zeros((n_rows, width), dtype=torch.long)
    # seg: which unit of the row a position belongs to (padding: a distinct negative id per position, so a pad
    # token attends to itself only and no attention row is empty); branch: 0 = the prefix, i = continuation i
    seg = -1 - torch.arange(width).repeat(n_rows, 1)
    branch = torch.zeros((n_rows, width), dtype=torch.long)
    scored = ScoredTokens()
    real = 0
    units: list[tuple[int, int, list[int]]] = []  # (flat start, prefix length, continuation lengths)
    for r, row in enumerate(rows):
        off = 0
        for k, unit in enumerate(row):
            p = unit.prefix_len
            units.append((r * width + off, p, [s.length - p for s in unit.samples]))
            ids[r, off : off + p] = unit.samples[0].input_ids[:p]
            pos[r, off : off + p] = torch.arange(p)
            seg[r, off : off + p] = k
            start = off + p
            for i, s in enumerate(unit.samples, 1):
                n = s.length - p
                ids[r, start : start + n] = s.input_ids[p:]
                pos[r, start : start + n] = torch.arange(p, p + n)
                seg[r, start : start + n] = k
                branch[r, start : start + n] = i
                in_prefix = s.score_pos < p
                flat = torch.where(in_prefix, off + s.score_pos, start + s.score_pos - p)
                scored.add(s, r * width + flat, weights[s.index])
                start += n
            real += start - off
            off = start
    causal = torch.ones((width, width), dtype=torch.bool).tril()
    same_unit = seg[:, :, None] == seg[:, None, :]
    visible = (branch[:, None, :] == 0) | (branch[:, None, :] == branch[:, :, None])
    mask = (same_unit & visible & causal)[:, None]
    return MicroBatch(
        input_ids=ids,
        position_ids=pos,
        attention_mask=mask,
        num_tokens=real,
        prefix_attention=PrefixAttention.from_units(units) if units else None,
        **scored.tensors(),
    )


def plan(
    samples: Sequence[SeqSample], weights: dict[int, Tensor], *, token_budget: int, rank: int, world_size: int,
    pad_id: int, multiple: int = 1,
) -> tuple[list[MicroBatch], int]:
    """This rank's shared-prefix micro-batches and the largest micro-batch count over all ranks."""
    per_rank = [pack_rows(part, token_budget, multiple) for part in assign_ranks(make_units(samples), world_size)]
    mine = [build(mb, weights, pad_id, multiple) for mb in per_rank[rank]]
    return mine, max((len(p) for p in per_rank), default=0)
