"""The queue contracts: what rollout workers put, what the trainer reads and acknowledges, and weight versions.

Errors (all :class:`agentrl.errors.QueueError`, an infrastructure error)::

    QueueError                 Redis unreachable, too old, or an operation failed after its retries
    ├── QueueFullError         put() waited longer than its timeout for the trainer to acknowledge entries
    └── WeightVersionError     a version is unknown (never published, or rewound) or was published twice

Delivery contract of a :class:`TrajectoryConsumer` (see ``trajectory_queue.py`` for the Redis realisation):
an entry is delivered to one consumer at a time and stays pending until acknowledged; ``ack`` is idempotent;
a consumer that died is restarted under the same name and gets its own unacknowledged entries back from its
first ``read`` calls (the trainer's recovery: one reader, rank 0, with a stable name).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from agentrl.errors import QueueError
from agentrl.types import Trajectory


class QueueFullError(QueueError):
    """The queue stayed at capacity for longer than the producer's timeout.

    ``enqueued_ids`` are the entry ids of the trajectories of the same ``put`` call that did get in (a prefix of
    the batch); the others were not enqueued and may be put again.
    """

    def __init__(self, message: str, enqueued_ids: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.enqueued_ids = list(enqueued_ids)


class WeightVersionError(QueueError):
    """A weight version is unknown (never published, or rewound), or was published twice with different content."""


@dataclass(frozen=True, slots=True)
class QueueEntry:
    """One delivered trajectory and the stream entry id to acknowledge it with."""

    entry_id: str
    trajectory: Trajectory


@dataclass(frozen=True, slots=True)
class QueueStats:
    """A consistent snapshot of one queue.

    ``length`` = entries not yet acknowledged = ``waiting`` (never delivered) + ``pending`` (delivered, not yet
    acknowledged). ``per_version`` counts those entries by their oldest weight version (``Trajectory.min_version``).
    """

    length: int
    pending: int
    capacity: int
    oldest_age_s: float | None
    per_version: Mapping[int, int] = field(default_factory=dict)
    pending_per_consumer: Mapping[str, int] = field(default_factory=dict)
    dead_letters: int = 0

    @property
    def waiting(self) -> int:
        return self.length - self.pending


@dataclass(frozen=True, slots=True)
class WeightVersion:
    """One published set of weights: where they are, which trainer step made them, when, and its metrics.

    ``transport`` says how the rollout side gets them: ``disk`` (load the HF folder ``path``), ``distributed`` (ask
    the trainer for a broadcast, :mod:`agentrl.queue.weight_sync`; ``path`` is where the trainer would write them),
    ``tensor`` (the same, but ask for its shared memory: servers on the trainer's host) or ``base`` (the weights the servers were started with: nothing to load)."""

    version: int
    path: str
    step: int
    created_at: float
    metrics: Mapping[str, float] = field(default_factory=dict)
    transport: str = "disk"


@runtime_checkable
class TrajectoryProducer(Protocol):
    """The rollout side: put finished trajectories, waiting while the queue is full (never dropping)."""

    async def put(self, trajectories: Sequence[Trajectory], *, timeout_s: float | None = None) -> list[str]: ...

    async def aclose(self) -> None: ...


@runtime_checkable
class TrajectoryConsumer(Protocol):
    """The trainer side: read a batch, train, commit, then acknowledge."""

    async def read(self, count: int, *, timeout_s: float) -> list[QueueEntry]: ...

    async def ack(self, entry_ids: Sequence[str]) -> int: ...

    async def aclose(self) -> None: ...
