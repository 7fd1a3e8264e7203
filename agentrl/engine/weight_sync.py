"""The rollout side of weight updates: a *source* brings a set of SGLang servers to one weight version.

    FromDisk(path, version)     ``/update_weights_from_disk`` on each server (a folder every server can read)
    AsStarted(version)          the weights the servers were started with, reported as ``version``
    Broadcast(version, ...)     ask the trainer for an offer (:mod:`agentrl.weight_sync`), then on all servers at once:

        begin_weight_update ─► init_weights_update_group (server i = rank 1 + i; the trainer, rank 0, joins too)
          ─► per bucket: update_weights_from_distributed  ║ the trainer broadcasts that bucket meanwhile
          ─► end_weight_update ─► destroy_weights_update_group

    Tensors(version, ...)       ``weight_sync: tensor``, servers on the trainer's host: ask the trainer for a
                                :class:`~agentrl.weight_sync.TensorOffer` (its snapshot's shared-memory names), then
        begin_weight_update ─► update_weights_from_tensor (server i: payload i) ─► end_weight_update

A failed broadcast is torn down on the servers (the session ended, the group left). A server whose call timed out
may be stuck inside a collective (SGLang's own end of the group has torch's 30-minute timeout) and is reported
as unreachable, so the pool takes it out and restarts it. A broadcast the servers refused (a peer that never
joined, a bucket they could not load) is tried again with a fresh group (``attempts``), then falls back to disk:
the trainer writes the version (``export``) and the servers load that folder, if it is readable here; without a
shared filesystem that fails with an error that says so.

The session is opened before the trainer is asked, so a server that drains its requests first (not paused) keeps
the trainer waiting for nothing. The pool (:class:`agentrl.engine.pool.EnginePool`) keeps the last source as its
servers' target: a server it restarts gets the current weights from the same source (a broadcast to it alone).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from agentrl.engine.base import EngineTimeout, EngineUnavailable
from agentrl.engine.client import SGLangClient
from agentrl.errors import EngineError
from agentrl.weight_sync import BucketMeta, TensorOffer, WeightOffer, WeightSyncError, host_id

logger = logging.getLogger(__name__)

Outcome = list[BaseException | None]  # per server, in order: None = done


class WeightSource(Protocol):
    """Brings servers to :attr:`version` (a broadcast may bring a newer one: it sends the trainer's newest)."""

    version: int

    async def load(self, clients: Sequence[SGLangClient]) -> Outcome: ...


async def each(clients: Sequence[SGLangClient], op: Callable[[int, SGLangClient], Awaitable[Any]]) -> Outcome:
    """``op(i, client)`` on every client at once; per client None or the exception it raised."""
    results = await asyncio.gather(*(op(i, c) for i, c in enumerate(clients)), return_exceptions=True)
    return [r if isinstance(r, BaseException) else None for r in results]


class FromDisk:
    def __init__(self, path: str, version: int) -> None:
        self.path, self.version = path, version

    async def load(self, clients: Sequence[SGLangClient]) -> Outcome:
        return await each(clients, lambda _, c: c.update_weights(self.path, self.version))


class AsStarted:
    def __init__(self, version: int) -> None:
        self.version = version

    async def load(self, clients: Sequence[SGLangClient]) -> Outcome:
        return await each(clients, lambda _, c: c.set_weight_version(self.version))


OfferFn = Callable[[int], Awaitable[WeightOffer]]  # world size (servers + 1) -> the trainer's offer
ExportFn = Callable[[], Awaitable[tuple[str, int]]]  # -> (folder, version) the trainer wrote


class Broadcast:
    """Weights from the trainer's broadcast (see the module docstring)."""

    def __init__(self, version: int, offer: OfferFn, *, export: ExportFn | None = None, attempts: int = 2,
                 margin_s: float = 30.0) -> None:
        self.version = version
        self._offer, self._export = offer, export
        self.attempts = max(1, attempts)
        self.margin_s = margin_s  # each server call may take the offer's timeout plus this
        self.fell_back = False

    async def load(self, clients: Sequence[SGLangClient]) -> Outcome:
        outcome: Outcome = [EngineError("no attempt made")] * len(clients)
        for attempt in range(1, self.attempts + 1):
            outcome = await self._attempt(clients)
            if all(r is None for r in outcome) or any(_stuck(r) for r in outcome):
                return outcome  # done, or servers to restart (they rejoin through this source)
            logger.warning("weight broadcast v%d, attempt %d/%d, failed: %s", self.version, attempt, self.attempts,
                           "; ".join(f"{c.url}: {r}" for c, r in zip(clients, outcome) if r is not None))
        if self._export is None:
            return outcome
        try:
            path, version = await self._export()
        except WeightSyncError as exc:
            return [EngineError(f"weight broadcast failed and the fallback to disk too: {exc}")] * len(clients)
        if not (Path(path) / "config.json").is_file():
            return [EngineError(f"weight broadcast v{self.version} failed {self.attempts} times; the trainer wrote "
                                f"v{version} to {path} as the fallback, but that folder is not readable here (no "
                                "filesystem shared with the trainer's node?): see the server logs for why the "
                                "broadcast failed")] * len(clients)
        logger.warning("weight broadcast v%d failed %d times: loading v%d from disk (%s) instead", self.version,
                       self.attempts, version, path)
        self.fell_back, self.version = True, version
        return await FromDisk(path, version).load(clients)

    async def _attempt(self, clients: Sequence[SGLangClient]) -> Outcome:
        began = await each(clients, lambda _, c: c.begin_weight_update())
        if _failed(began):
            await _end(clients, began)
            return began
        try:
            offer = await self._offer(len(clients) + 1)
        except WeightSyncError as exc:
            await _end(clients, began)
            return [EngineError(str(exc))] * len(clients)
        timeout_s = offer.timeout_s + self.margin_s
        joined = await each(clients, lambda i, c: c.init_weight_group(
            address=offer.address, port=offer.port, rank=1 + i, world_size=offer.world_size, group=offer.group,
            backend=offer.backend, timeout_s=timeout_s))
        outcome = joined
        if not _failed(joined):
            outcome = await _receive(clients, offer, timeout_s)
        if _failed(outcome):
            await _end(clients, outcome, group=offer.group, joined=joined)
            return outcome
        ended = await each(clients, lambda _, c: c.end_weight_update())
        await _leave([c for c, r in zip(clients, ended) if not _stuck(r)], offer.group)
        if not _failed(ended):
            self.version = offer.version
        return ended


TensorOfferFn = Callable[[int], Awaitable[TensorOffer]]  # servers -> the trainer's shared-memory offer


class Tensors(Broadcast):
    """Weights from the trainer's shared memory (see the module docstring): attempts, the fallback to disk and
    the bounds are :class:`Broadcast`'s; an offer from another host fails at once (its memory is not ours)."""

    def __init__(self, version: int, offer: TensorOfferFn, *, export: ExportFn | None = None, attempts: int = 2,
                 margin_s: float = 30.0, timeout_s: float = 120.0) -> None:
        super().__init__(version, offer, export=export, attempts=attempts, margin_s=margin_s)  # type: ignore[arg-type]
        self._tensor_offer = offer
        self.timeout_s = timeout_s  # each server's load, plus margin_s

    async def _attempt(self, clients: Sequence[SGLangClient]) -> Outcome:
        began = await each(clients, lambda _, c: c.begin_weight_update())
        if _failed(began):
            await _end(clients, began)
            return began
        try:
            offer = await self._tensor_offer(len(clients))
            if offer.host != host_id():
                raise WeightSyncError(f"weight_sync: tensor needs the trainer on the servers' host, but the trainer "
                                      f"is on {offer.host} and this process on {host_id()}: use weight_sync: "
                                      "distributed across hosts")
        except WeightSyncError as exc:
            await _end(clients, began)
            return [EngineError(str(exc))] * len(clients)
        loaded = await each(clients, lambda i, c: c.load_weight_tensors(
            offer.payloads[i], version=offer.version, timeout_s=self.timeout_s + self.margin_s))
        ended = await each([c for c, r in zip(clients, loaded) if not _stuck(r)], lambda _, c: c.end_weight_update())
        if _failed(loaded):
            return loaded
        if not _failed(ended):
            self.version = offer.version
        return ended


async def _receive(clients: Sequence[SGLangClient], offer: WeightOffer, timeout_s: float) -> Outcome:
    outcome: Outcome = [None] * len(clients)
    for k, bucket in enumerate(offer.buckets):
        version = offer.version if k == len(offer.buckets) - 1 else None  # travels with the last bucket

        def receive(_: int, c: SGLangClient, b: BucketMeta = bucket, version: int | None = version) -> Awaitable[Any]:
            return c.receive_weight_bucket(group=offer.group, names=b.names, dtype=b.dtype, shapes=b.shapes,
                                           version=version, timeout_s=timeout_s)

        outcome = await each(clients, receive)
        if _failed(outcome):
            break
    return outcome


def _failed(outcome: Outcome) -> bool:
    return any(r is not None for r in outcome)


def _stuck(r: BaseException | None) -> bool:
    return isinstance(r, (EngineTimeout, EngineUnavailable))


async def _end(clients: Sequence[SGLangClient], outcome: Outcome, *, group: str | None = None,
               joined: Outcome | None = None) -> None:
    """Tear a failed attempt down on the servers that still answer: end the session, leave the group."""
    alive = [c for c, r in zip(clients, outcome) if not _stuck(r)]
    await each(alive, lambda _, c: c.end_weight_update())
    if group is not None and joined is not None:
        await _leave([c for c, r in zip(clients, joined) if r is None and c in alive], group)


async def _leave(clients: Sequence[SGLangClient], group: str) -> None:
    for c, r in zip(clients, await each(clients, lambda _, c: c.destroy_weight_group(group))):
        if r is not None:
            logger.warning("%s: leaving weight group %s: %s", c.url, group, r)
