"""From trajectories (or SFT traces) to micro-batches under a token budget; per-token arrays are derived here.

Next-token shift: the logprob of token ``t`` is predicted from position ``t - 1``; token ``t`` is *scored* iff
``loss_mask[t] == 1`` (token 0 has no context and is never scored). A sequence feeds the model only
``token_ids[:t_last]`` (``t_last`` its last scored token): nothing after it can influence a scored logprob.
Per scored token we keep the input position that predicts it (``score_index``), the target id, the behaviour
logprob, the sample's advantage and the token's loss weight (aggregation weight x sample weight).

Layouts: ``padded`` rows hold one sequence each (right-padded, with an attention mask); ``packed`` rows hold
several sequences back to back, told apart by ``position_ids`` restarting at 0 (Hugging Face's packed format:
attention never crosses a sequence boundary). Rows are at most as long as the longest sequence of the rank,
so attention cost stays that of padding while padding tokens mostly disappear. ``shared_prefix`` rows hold a
prompt once and every response that continues it (:mod:`agentrl.trainer.shared_prefix`).

Distribution: every rank receives the same global batch and computes the same plan: samples go to ranks by
longest-processing-time (balanced tokens), and every rank gets the same number of micro-batches (dummy
micro-batches with zero weight fill the gap, because FSDP needs every rank in every collective). Loss
weights use global normalisers, so summing the ranks' contributions gives exactly the global loss.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np
import numpy.typing as npt
import torch
from torch import Tensor

from agentrl.trainer.base import TokenTrace
from agentrl.trainer.config import LossAgg, LossConfig
from agentrl.trainer.objectives import aggregation_weights, group_advantages
from agentrl.trainer.prefix_attention import PrefixAttention
from agentrl.types import Trajectory

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SeqSample:
    """One sequence, shifted: ``targets[j] = token_ids[score_pos[j] + 1]``."""

    index: int  # position in the prepared batch
    source: int  # position in the list the batch was prepared from
    input_ids: Tensor  # [L] long: the tokens fed to the model
    score_pos: Tensor  # [n] long: input positions whose next-token prediction is scored
    targets: Tensor  # [n] long
    behavior_logprobs: Tensor  # [n] float32
    advantage: float
    weight: float  # per-sample loss weight (staleness down-weighting), 1.0 normally
    staleness: int

    @property
    def length(self) -> int:
        return int(self.input_ids.numel())


@dataclass(frozen=True, slots=True)
class PreparedBatch:
    """The trainable samples of a batch, and what was dropped on the way."""

    samples: tuple[SeqSample, ...]
    num_received: int
    dropped_stale: int = 0
    downweighted_stale: int = 0
    dropped_invalid: int = 0  # no score (a non-finite reward, e.g. a reward bug): never trained on
    staleness_mean: float = 0.0
    staleness_max: int = 0
    reward_mean: float = 0.0
    tokens: int = 0  # tokens of the kept sequences (full length)
    model_tokens: int = 0  # scored tokens of the kept sequences


@dataclass(frozen=True, slots=True)
class MicroBatch:
    """Model inputs for one forward/backward pass and the per-scored-token arrays (all ``[N]``)."""

    input_ids: Tensor  # [R, T]
    position_ids: Tensor  # [R, T]
    attention_mask: Tensor | None  # [R, T] padded rows with padding; [R, 1, T, T] bool shared_prefix; else None
    score_index: Tensor  # [N] flat index into the R*T positions
    targets: Tensor
    behavior_logprobs: Tensor
    advantages: Tensor
    weights: Tensor
    seq_index: Tensor  # [N] sample index in the prepared batch (-1 in dummy micro-batches)
    num_tokens: int  # real (non-padding) tokens
    prefix_attention: PrefixAttention | None = None  # shared_prefix: the units, for attention that skips the mask

    @property
    def is_dummy(self) -> bool:
        return self.num_tokens == 0


def _make_sample(
    index: int,
    source: int,
    token_ids: npt.ArrayLike,
    loss_mask: npt.ArrayLike,
    behav: npt.ArrayLike | None,
    advantage: float = 0.0,
    weight: float = 1.0,
    staleness: int = 0,
) -> SeqSample | None:
    mask = np.asarray(loss_mask, dtype=bool).copy()
    if mask.size:
        mask[0] = False
    scored = np.nonzero(mask)[0]
    if scored.size == 0:
        return None
    ids = torch.as_tensor(np.asarray(token_ids, dtype=np.int64))
    t = torch.as_tensor(scored, dtype=torch.long)
    behav_t = (
        torch.from_numpy(np.asarray(behav, dtype=np.float32)[scored])  # fancy indexing: a writable copy
        if behav is not None
        else torch.zeros(t.numel())
    )
    return SeqSample(
        index=index,
        source=source,
        input_ids=ids[: int(scored[-1])].clone(),
        score_pos=t - 1,
        targets=ids[t],
        behavior_logprobs=behav_t,
        advantage=advantage,
        weight=weight,
        staleness=staleness,
    )


def staleness_of(trajectory: Trajectory, current_version: int) -> int:
    """``current_version - min(weight_versions of model tokens)``; 0 without model tokens, never negative."""
    oldest = trajectory.min_version
    return 0 if oldest < 0 else max(current_version - oldest, 0)


def _reward_pools(trajectories: Sequence[Trajectory]) -> list[list[float] | None]:
    """Per trajectory, ``[n, mean, std]`` of the pool its group was cut from (adaptive sampling's
    ``metadata["reward_pool"]``), or None. The queue may hold trajectories from any producer: a malformed pool is
    ignored (the trajectory keeps its own group's statistics) and warned about once per batch, never a crash."""
    rows: list[list[float] | None] = []
    bad: list[tuple[str, object]] = []
    for t in trajectories:
        p = t.metadata.get("reward_pool")
        row: list[float] | None = None
        if p is not None:
            try:
                row = [float(p["n"]), float(p["mean"]), float(p["std"])]
            except (TypeError, KeyError, ValueError):
                row = None
            if row is None or not all(map(math.isfinite, row)) or row[0] < 1 or row[2] < 0:
                bad.append((t.trajectory_id, p))
                row = None
        rows.append(row)
    if bad:
        logger.warning("%d trajectories carry a metadata reward_pool that is not {n >= 1, mean, std >= 0} (finite "
                       "numbers), e.g. %s: %r: ignored, their groups' own statistics used", len(bad), *bad[0])
    return rows


def prepare_rl(trajectories: Sequence[Trajectory], *, current_version: int, cfg: LossConfig) -> PreparedBatch:
    """Filter, score staleness, compute group advantages and build shifted samples.

    Advantages use every valid trajectory of a group (stale ones too: their rewards are still unbiased
    baseline information); stale trajectories are then dropped or down-weighted by ``cfg.stale_policy``.
    """
    indexed = [(i, t) for i, t in enumerate(trajectories) if math.isfinite(t.reward)]
    valid = [t for _, t in indexed]
    if not valid:
        return PreparedBatch(samples=(), num_received=len(trajectories), dropped_invalid=len(trajectories))
    group_of: dict[str, int] = {}
    group_index = torch.tensor([group_of.setdefault(t.group_id, len(group_of)) for t in valid])
    rewards = torch.tensor([float(t.reward) for t in valid])
    pools = _reward_pools(valid)
    pool = torch.tensor([p or [math.nan] * 3 for p in pools]) if any(pools) else None
    adv = group_advantages(rewards, group_index, cfg.advantage, cfg.adv_eps, pool).tolist()
    future = [t.trajectory_id for t in valid if max(t.generated_versions, default=-1) > current_version]
    if future:
        logger.warning(
            "%d trajectories carry versions newer than %d (e.g. %s): staleness taken as 0",
            len(future),
            current_version,
            future[0],
        )
    samples: list[SeqSample] = []
    kept: list[Trajectory] = []
    dropped = downweighted = 0
    for (src, traj), a in zip(indexed, adv):
        stale = staleness_of(traj, current_version)
        weight = 1.0
        if cfg.max_staleness is not None and stale > cfg.max_staleness:
            if cfg.stale_policy == "drop":
                dropped += 1
                continue
            downweighted += 1
            weight = cfg.stale_decay ** (stale - cfg.max_staleness)
        s = _make_sample(
            len(samples),
            src,
            traj.token_ids,
            traj.loss_mask,
            traj.behavior_logprobs,
            a,
            weight,
            stale,
        )
        if s is not None:
            samples.append(s)
            kept.append(traj)
    stal = [s.staleness for s in samples]
    return PreparedBatch(
        samples=tuple(samples),
        num_received=len(trajectories),
        dropped_stale=dropped,
        downweighted_stale=downweighted,
        dropped_invalid=len(trajectories) - len(valid),
        staleness_mean=float(np.mean(stal)) if stal else 0.0,
        staleness_max=max(stal, default=0),
        reward_mean=float(rewards.mean().item()),
        tokens=sum(t.num_tokens for t in kept),
        model_tokens=sum(int(s.targets.numel()) for s in samples),
    )


def prepare_sft(traces: Sequence[TokenTrace]) -> PreparedBatch:
    """Shifted samples for masked next-token training (traces with nothing to learn are skipped)."""
    samples: list[SeqSample] = []
    tokens = 0
    for i, trace in enumerate(traces):
        s = _make_sample(len(samples), i, trace.token_ids, trace.loss_mask, None)
        if s is not None:
            samples.append(s)
            tokens += len(trace.token_ids)
    return PreparedBatch(
        samples=tuple(samples),
        num_received=len(traces),
        tokens=tokens,
        model_tokens=sum(int(s.targets.numel()) for s in samples),
    )


def split_mini_batches(samples: Sequence[SeqSample], n: int) -> list[list[SeqSample]]:
    """``n`` contiguous chunks of (nearly) equal size; empty chunks are left out."""
    bounds = np.linspace(0, len(samples), n + 1).round().astype(int)
    return [list(samples[a:b]) for a, b in itertools.pairwise(bounds) if b > a]


class Placeable(Protocol):
    """What the planners below place: a sample, or a shared-prefix unit of samples."""

    @property
    def length(self) -> int: ...

    @property
    def index(self) -> int: ...


P = TypeVar("P", bound=Placeable)


def assign_ranks(items: Sequence[P], world_size: int) -> list[list[P]]:
    """Longest-processing-time assignment: each item, longest first, goes to the least-loaded rank."""
    load = [0] * world_size
    out: list[list[P]] = [[] for _ in range(world_size)]
    for s in sorted(items, key=lambda s: (-s.length, s.index)):
        r = min(range(world_size), key=lambda i: (load[i], i))
        out[r].append(s)
        load[r] += s.length
    return out


def _group_padded(samples: list[SeqSample], budget: int, multiple: int = 1) -> list[list[list[SeqSample]]]:
    """Micro-batches of rows (one sequence per row), longest first, ``rows * longest <= budget`` (the longest
    padded to a multiple of ``multiple``)."""
    groups: list[list[list[SeqSample]]] = []
    for s in sorted(samples, key=lambda s: (-s.length, s.index)):
        if groups and (len(groups[-1]) + 1) * padded_width(groups[-1][0][0].length, multiple) <= budget:
            groups[-1].append([s])
        else:
            groups.append([[s]])
    return groups


def pack_rows(items: Sequence[P], budget: int, multiple: int = 1) -> list[list[list[P]]]:
    """First-fit-decreasing into rows as long as the longest item (padded to a multiple of ``multiple``: the
    padding's room is filled first), then rows into micro-batches of at most ``budget`` tokens (rows x width; one
    row at least)."""
    if not items:
        return []
    ordered = sorted(items, key=lambda s: (-s.length, s.index))
    cap = padded_width(ordered[0].length, multiple)
    rows: list[list[P]] = []
    fill: list[int] = []
    for s in ordered:
        for i, f in enumerate(fill):
            if f + s.length <= cap:
                rows[i].append(s)
                fill[i] += s.length
                break
        else:
            rows.append([s])
            fill.append(s.length)
    per_mb = max(budget // cap, 1)
    return [rows[i : i + per_mb] for i in range(0, len(rows), per_mb)]


class ScoredTokens:
    """The per-scored-token arrays of one micro-batch, collected sample by sample (``flat``: each scored entry's
    index into the ``rows x width`` positions)."""

    def __init__(self) -> None:
        self._parts: dict[str, list[Tensor]] = {k: [] for k in (
            "score_index", "targets", "behavior_logprobs", "advantages", "weights", "seq_index")}

    def add(self, s: SeqSample, flat: Tensor, weight: Tensor) -> None:
        n = s.targets.numel()
        for key, value in (("score_index", flat), ("targets", s.targets), ("behavior_logprobs", s.behavior_logprobs),
                           ("advantages", torch.full((n,), s.advantage, dtype=torch.float32)), ("weights", weight),
                           ("seq_index", torch.full((n,), s.index, dtype=torch.long))):
            self._parts[key].append(value)

    def tensors(self) -> dict[str, Any]:  # MicroBatch keyword arguments
        return {k: torch.cat(v) for k, v in self._parts.items()}


def padded_width(width: int, multiple: int) -> int:
    """``width`` rounded up to a multiple of ``multiple`` (see ``TrainerConfig.pad_to_multiple_of``)."""
    return -(-width // multiple) * multiple


def _build(rows: list[list[SeqSample]], weights: dict[int, Tensor], packed: bool, pad_id: int,
           multiple: int = 1) -> MicroBatch:
    width = padded_width(max(sum(s.length for s in row) for row in rows), multiple)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    pos = torch.zeros((len(rows), width), dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    scored = ScoredTokens()
    for r, row in enumerate(rows):
        off = 0
        for s in row:
            ids[r, off : off + s.length] = s.input_ids
            pos[r, off : off + s.length] = torch.arange(s.length)
            attn[r, off : off + s.length] = 1
            scored.add(s, r * width + off + s.score_pos, weights[s.index])
            off += s.length
        if packed and off < width:  # tail padding forms its own segment: positions restart at 0
            pos[r, off:] = torch.arange(width - off)
    num_tokens = int(attn.sum().item())
    return MicroBatch(
        input_ids=ids,
        position_ids=pos,
        attention_mask=None if packed or num_tokens == attn.numel() else attn,
        num_tokens=num_tokens,
        **scored.tensors(),
    )


def dummy_micro_batch(pad_id: int = 0) -> MicroBatch:
    """One padding token with zero weight: lets a rank join collectives when it has no work left."""
    one = torch.zeros(1, dtype=torch.long)
    return MicroBatch(
        input_ids=torch.full((1, 1), pad_id, dtype=torch.long),
        position_ids=torch.zeros((1, 1), dtype=torch.long),
        attention_mask=None,
        score_index=one,
        targets=torch.full((1,), pad_id, dtype=torch.long),
        behavior_logprobs=torch.zeros(1),
        advantages=torch.zeros(1),
        weights=torch.zeros(1),
        seq_index=torch.full((1,), -1, dtype=torch.long),
        num_tokens=0,
    )


def token_weights(
    samples: Sequence[SeqSample], mode: LossAgg, token_sum_norm: float | None = None
) -> dict[int, Tensor]:
    """Per-sample loss weights of each scored token: aggregation weight (global) x sample weight."""
    if not samples:
        return {}
    seq = torch.cat([torch.full((s.targets.numel(),), i, dtype=torch.long) for i, s in enumerate(samples)])
    w = aggregation_weights(torch.ones(seq.numel(), dtype=torch.bool), seq, mode, token_sum_norm)
    out: dict[int, Tensor] = {}
    for chunk, s in zip(torch.split(w, [int(s.targets.numel()) for s in samples]), samples):
        out[s.index] = chunk * s.weight
    return out


def plan_micro_batches(
    samples: Sequence[SeqSample],
    *,
    mode: LossAgg,
    token_budget: int,
    layout: str,
    rank: int = 0,
    world_size: int = 1,
    token_sum_norm: float | None = None,
    pad_id: int = 0,
    pad_to_multiple_of: int = 1,
) -> list[MicroBatch]:
    """This rank's micro-batches for one optimiser update over ``samples`` (the global mini-batch); each one's rows
    padded to a multiple of ``pad_to_multiple_of`` tokens."""
    weights = token_weights(samples, mode, token_sum_norm)
    if layout == "shared_prefix":
        from agentrl.trainer import shared_prefix  # it builds on this module's types

        shared, count = shared_prefix.plan(samples, weights, token_budget=token_budget, rank=rank,
                                           world_size=world_size, pad_id=pad_id, multiple=pad_to_multiple_of)
        return shared + [dummy_micro_batch(pad_id) for _ in range(count - len(shared))]
    group = pack_rows if layout == "packed" else _group_padded
    plans = [group(part, token_budget, pad_to_multiple_of) for part in assign_ranks(samples, world_size)]
    for mb in plans[rank]:
        size = len(mb) * padded_width(max(sum(s.length for s in row) for row in mb), pad_to_multiple_of)
        if size > token_budget:
            logger.warning(
                "a sequence of %d tokens exceeds micro_batch_tokens=%d: it gets a micro-batch of its "
                "own; raise micro_batch_tokens to silence this",
                size,
                token_budget,
            )
    mine = [_build(mb, weights, layout == "packed", pad_id, pad_to_multiple_of) for mb in plans[rank]]
    count = max((len(p) for p in plans), default=0)
    return mine + [dummy_micro_batch(pad_id) for _ in range(count - len(mine))]
