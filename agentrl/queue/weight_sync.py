"""The weight-sync channel in Redis: the rollout side asks the trainer for a version's weights, the trainer answers
(``weight_sync: distributed``; the protocol is in :mod:`agentrl.weight_sync`).

Keys under the run's registry namespace N::

    N:sync:requests        list   JSON requests (LPUSH by the rollout; the trainer BRPOPs the oldest)
    N:sync:reply:<id>      list   the one JSON answer to request <id>, expiring after ``reply_ttl_s``
    N:sync:loaded          string the version the rollout's servers last loaded through the channel: the trainer
                                  keeps answering after its last step until this reaches the final version

A request is ``{"id", "kind": "broadcast" | "tensor" | "export", "version", "world_size", "deadline"}``; the answer
is ``{"offer": WeightOffer}`` (broadcast: the newest weights the trainer has, at least ``version``), ``{"tensor":
TensorOffer}`` (``weight_sync: tensor``: one shared-memory payload per server; ``world_size`` counts servers only),
``{"path": ...}``
(export: the trainer wrote its newest weights there, on its own filesystem) or ``{"error": ...}``. The trainer skips
a request whose ``deadline`` (wall clock) has passed: whoever asked has given up on it.

The rollout drives the servers (its pool owns their pause state and restarts); the trainer only answers, so a server
restarted at any time gets the current weights by asking again, and nothing needs a shared filesystem.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

import redis.asyncio

from agentrl.queue._connection import make_client
from agentrl.queue.retry import RetryPolicy
from agentrl.weight_sync import TensorOffer, WeightOffer, WeightSyncError

Kind = Literal["broadcast", "tensor", "export"]


@dataclass(frozen=True, slots=True)
class SyncRequest:
    id: str
    kind: Kind
    version: int
    world_size: int
    deadline: float  # time.time() after which nobody waits for the answer

    @property
    def expired(self) -> bool:
        return time.time() > self.deadline


class SyncChannel:
    """Both ends of the channel of one run (``namespace``: the weight registry's)."""

    def __init__(self, client: redis.asyncio.Redis, namespace: str, *, retry: RetryPolicy | None = None,
                 op_timeout_s: float = 30.0, reply_ttl_s: int = 600, owns_client: bool = False) -> None:
        self._redis = client
        self._owns_client = owns_client
        self._requests = f"{namespace}:sync:requests"
        self._reply_prefix = f"{namespace}:sync:reply:"
        self._loaded = f"{namespace}:sync:loaded"
        self._retry = retry or RetryPolicy()
        self._op_timeout_s = op_timeout_s
        self._reply_ttl_s = reply_ttl_s

    @classmethod
    def connect(cls, url: str, namespace: str) -> SyncChannel:
        """A channel on a client of its own (closed by :meth:`aclose`): for a thread with its own event loop."""
        return cls(make_client(url), namespace, owns_client=True)

    async def aclose(self) -> None:
        if self._owns_client:
            await self._redis.aclose()

    # -- the rollout side --------------------------------------------------------------------------------------

    async def ask(self, kind: Kind, *, version: int, world_size: int = 0, timeout_s: float) -> dict[str, Any]:
        """Send a request and wait up to ``timeout_s`` for its answer; WeightSyncError on an error answer or none."""
        rid = uuid.uuid4().hex
        request = {"id": rid, "kind": kind, "version": int(version), "world_size": int(world_size),
                   "deadline": time.time() + timeout_s}
        await self._call(lambda: self._redis.lpush(self._requests, json.dumps(request)), "send a weight request")
        reply = await self._blocking_pop(self._reply_prefix + rid, timeout_s)
        if reply is None:
            raise WeightSyncError(f"the trainer did not answer the {kind} request for weights v{version} within "
                                  f"{timeout_s:g}s: is it running, and does it serve weight_sync requests?")
        answer: dict[str, Any] = json.loads(reply)
        if "error" in answer:
            raise WeightSyncError(f"the trainer refused the {kind} request for weights v{version}: {answer['error']}")
        return answer

    async def offer(self, version: int, *, world_size: int, timeout_s: float) -> WeightOffer:
        """Ask for a broadcast of ``version`` (or newer) to ``world_size - 1`` servers."""
        return WeightOffer.from_dict((await self.ask("broadcast", version=version, world_size=world_size,
                                                     timeout_s=timeout_s))["offer"])

    async def tensors(self, version: int, *, servers: int, timeout_s: float) -> TensorOffer:
        """Ask for ``version`` (or newer) in shared memory, one payload for each of ``servers`` servers."""
        return TensorOffer.from_dict((await self.ask("tensor", version=version, world_size=servers,
                                                     timeout_s=timeout_s))["tensor"])

    async def export(self, version: int, *, timeout_s: float) -> tuple[str, int]:
        """Ask the trainer to write its newest weights (``version`` or newer) to disk; returns where, and which."""
        answer = await self.ask("export", version=version, timeout_s=timeout_s)
        return str(answer["path"]), int(answer["version"])

    async def confirm_loaded(self, version: int) -> None:
        """Tell the trainer the servers now serve ``version`` (a trainer past its last step waits for this)."""
        await self._call(lambda: self._redis.set(self._loaded, int(version)), "confirm a weight load")

    # -- the trainer side --------------------------------------------------------------------------------------

    async def loaded(self) -> int | None:
        """The version the rollout side last confirmed loading, or None since :meth:`forget_loaded`."""
        raw = await self._call(lambda: self._redis.get(self._loaded), "read the loaded weight version")
        return None if raw is None else int(raw)

    async def forget_loaded(self) -> None:
        """Clear the confirmation (a trainer starting: a confirmation left by an earlier attempt means nothing)."""
        await self._call(lambda: self._redis.delete(self._loaded), "clear the loaded weight version")

    async def next_request(self, block_s: float) -> SyncRequest | None:
        """The oldest request still wanted, waiting up to ``block_s`` for one; None if there was none."""
        deadline = time.monotonic() + block_s
        while (left := deadline - time.monotonic()) > 0:
            raw = await self._blocking_pop(self._requests, left)
            if raw is None:
                return None
            d = json.loads(raw)
            request = SyncRequest(id=str(d["id"]), kind=d["kind"], version=int(d["version"]),
                                  world_size=int(d["world_size"]), deadline=float(d["deadline"]))
            if not request.expired:
                return request
        return None

    async def answer(self, request: SyncRequest, reply: dict[str, Any]) -> None:
        key = self._reply_prefix + request.id

        async def push() -> None:
            async with self._redis.pipeline(transaction=True) as p:
                p.rpush(key, json.dumps(reply))
                p.expire(key, self._reply_ttl_s)
                await p.execute()

        await self._call(push, "answer a weight request")

    # -- helpers -----------------------------------------------------------------------------------------------

    async def _blocking_pop(self, key: str, timeout_s: float) -> bytes | None:
        """BRPOP with the server-side block bounded, and the call bounded by it plus the op timeout."""
        block = max(0.01, timeout_s)

        async def pop() -> Any:
            async with asyncio.timeout(block + self._op_timeout_s):
                return await self._redis.brpop([key], timeout=block)

        reply = await self._call(pop, f"wait on {key}")
        return None if reply is None else reply[1]

    async def _call(self, op: Callable[[], Awaitable[Any]], what: str) -> Any:
        return await self._retry.call(op, what=f"{what} (weight sync)")
