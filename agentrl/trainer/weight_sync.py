"""Trainer side of ``weight_sync: distributed``: rank 0 keeps the newest weights and broadcasts them to the SGLang
servers when the rollout side asks (the protocol is in :mod:`agentrl.weight_sync`).

    set_weights(v, tensors)        after each step: the snapshot requests are served from, copied once into its
                                   broadcast buffers (CPU, the engine's dtype)
    offer(world_size)              a TCP store on a free port (rank 0 hosts it) and the buckets' layout
    send(pending)                  a group of ``world_size`` (rank 0 = this process), one broadcast per bucket,
                                   then the group is destroyed

With ``shared_memory=True`` (``weight_sync: tensor``) the snapshot's buffers are named shm files
(:mod:`agentrl.trainer.shm`) and :meth:`WeightSender.tensor_offer` hands servers on this host their names instead.

Every step is bounded by ``timeout_s``: the group is created with it as its timeout, so a peer that never joins,
or stops receiving, fails :meth:`WeightSender.send` within it instead of hanging; on any failure the group and its
store are torn down (the servers' side is the rollout's to tear down, see :mod:`agentrl.engine.weight_sync`).

The group is made the way SGLang makes its end of it (``init_custom_process_group`` in ``sglang.srt.utils``):
torch's ``_new_process_group_helper`` on a ``PrefixStore(group, TCPStore)``, so both ends derive the same store keys
for any backend. That helper is private to torch; SGLang relies on it the same way, and the real-server tests
(tests/trainer/test_weight_sync_sglang.py) would catch a torch release that changed it. We write the helper
ourselves rather than import it so the trainer never imports SGLang.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import socket
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol, Self

import torch
import torch.distributed as dist
from torch import Tensor

from agentrl.trainer.shm import serialize, shared_bytes
from agentrl.weight_sync import BucketMeta, TensorOffer, WeightOffer, WeightSyncError, host_id, plan_buckets

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Snapshot:
    """One version, held as its broadcast buffers (one uint8 tensor per bucket, filled once) and, for an export,
    the tensors as views into them (no second copy)."""

    version: int
    tensors: Mapping[str, Tensor]
    buckets: tuple[BucketMeta, ...]
    flat: tuple[Tensor, ...]


@dataclass(slots=True)
class PendingSend:
    """An offer made and not yet sent: the store the servers will rendezvous at, and the snapshot it offered."""

    offer: WeightOffer
    store: dist.TCPStore
    snapshot: _Snapshot


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def address_toward(host: str) -> str:
    """This machine's address on the interface that reaches ``host`` (no packet is sent): what a peer that reaches
    ``host`` (e.g. the Redis server both sides use) most likely reaches us at. Loopback for a local ``host``."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"


def open_group(store: dist.Store, *, group: str, world_size: int, rank: int, backend: str,
               timeout_s: float) -> dist.ProcessGroup:
    """Join the process group ``group`` as ``rank`` of ``world_size`` on ``store`` (see the module docstring)."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

    timeout = timedelta(seconds=timeout_s)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), PrefixStore(group, store),
                                      group_name=group,  # type: ignore[arg-type]  # torch's NewType of str
                                      backend_options=None, timeout=timeout)
    if not isinstance(pg, dist.ProcessGroup):  # torch's marker for a rank outside the group; never with all ranks
        raise RuntimeError(f"rank {rank} of {world_size} is not a member of process group {group!r}")
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def close_group(pg: dist.ProcessGroup | None) -> None:
    if pg is None:
        return
    try:
        dist.destroy_process_group(pg)
    except Exception as exc:  # tearing down after a failure: nothing more to do than say so
        logger.warning("destroying a weight-sync group failed: %s", exc)


def flatten(tensors: Mapping[str, Tensor], bucket: BucketMeta, *,
            shared: bool = False) -> tuple[Tensor, dict[str, Tensor]]:
    """The bucket's tensors as one uint8 tensor, end to end in its order (SGLang's ``FlattenedTensorBucket``),
    each cast to the bucket's dtype on the way in (one pass: cast and copy fused), and the tensors as views of it.
    ``shared``: the uint8 tensor is a named shm file (:func:`agentrl.trainer.shm.shared_bytes`)."""
    dtype = getattr(torch, bucket.dtype)
    flat = shared_bytes(bucket.nbytes) if shared else torch.empty(bucket.nbytes, dtype=torch.uint8)
    views, offset = {}, 0
    for name, shape in zip(bucket.names, bucket.shapes):
        t = tensors[name]
        if tuple(t.shape) != shape:
            raise WeightSyncError(f"{name} changed under its offer: shape {tuple(t.shape)}, offered as {shape}")
        n = t.numel() * dtype.itemsize
        view = flat[offset:offset + n].view(dtype).view(shape)
        view.copy_(t)
        views[name], offset = view, offset + n
    return flat, views


class WeightSender:
    """Rank 0's end of distributed weight sync. Thread-safe: the training thread sets weights while another thread
    serves requests (:class:`agentrl.launcher.trainer_process` runs it beside the training loop)."""

    def __init__(self, *, address: str, backend: str = "gloo", bucket_bytes: int = 512 << 20,
                 timeout_s: float = 120.0, device: torch.device | None = None, shared_memory: bool = False) -> None:
        self.address = address
        self.shared_memory = shared_memory  # snapshots in /dev/shm, for tensor_offer
        self.backend = backend
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.device = device or torch.device("cpu")  # where a bucket goes before its broadcast (cuda for NCCL)
        self._lock = threading.Lock()
        self._snapshot: _Snapshot | None = None

    @property
    def version(self) -> int | None:
        snap = self._snapshot
        return None if snap is None else snap.version

    def set_weights(self, version: int, tensors: Mapping[str, Tensor], dtype: torch.dtype | None = None) -> None:
        """The weights later requests get (a sender in flight keeps the snapshot it offered), copied once into
        their broadcast buffers; floating-point tensors cast to ``dtype`` on the way (the engine's: it would cast
        them so anyway), others kept as they are."""
        def target(t: Tensor) -> torch.dtype:
            return dtype if dtype is not None and t.is_floating_point() else t.dtype

        named = [(k, dtype_name(target(v)), tuple(v.shape)) for k, v in tensors.items()]
        buckets = tuple(plan_buckets(named, self.bucket_bytes))
        flat, views = [], {}
        for bucket in buckets:
            f, v = flatten(tensors, bucket, shared=self.shared_memory)
            flat.append(f)
            views.update(v)
        snap = _Snapshot(int(version), views, buckets, tuple(flat))
        with self._lock:
            self._snapshot = snap

    def snapshot(self) -> tuple[int, Mapping[str, Tensor]]:
        snap = self._current()
        return snap.version, snap.tensors

    def offer(self, world_size: int) -> PendingSend:
        """Open a store for a group of ``world_size`` (this process and ``world_size - 1`` servers) and describe
        the newest weights. The store listens until :meth:`send` ends (or :meth:`cancel`)."""
        if world_size < 2:
            raise WeightSyncError(f"a weight-sync group needs the trainer and at least one server, got world size "
                                  f"{world_size}")
        snap = self._current()
        store = dist.TCPStore("0.0.0.0", 0, world_size, is_master=True, timeout=timedelta(seconds=self.timeout_s),
                              wait_for_workers=False)
        group = f"agentrl-weights-v{snap.version}-{uuid.uuid4().hex[:8]}"
        offer = WeightOffer(version=snap.version, address=self.address, port=int(store.port), group=group,
                            world_size=world_size, backend=self.backend, timeout_s=self.timeout_s,
                            buckets=snap.buckets)
        return PendingSend(offer, store, snap)

    def tensor_offer(self, servers: int) -> TensorOffer:
        """The newest weights as ``servers`` payloads naming their shared memory, one per server (each holds a
        reference to the memory until that server has mapped it: :mod:`agentrl.trainer.shm`)."""
        if not self.shared_memory:
            raise WeightSyncError("this trainer keeps its weights in private memory (weight_sync: distributed); "
                                  "a tensor offer needs them in shared memory (weight_sync: tensor)")
        if servers < 1:
            raise WeightSyncError(f"a tensor offer is for at least one server, got {servers}")
        snap = self._current()
        named = list(snap.tensors.items())
        return TensorOffer(version=snap.version, host=host_id(), payloads=tuple(serialize(named)
                                                                               for _ in range(servers)))

    def send(self, pending: PendingSend) -> float:
        """Form the group and broadcast every bucket; returns the seconds it took. Raises WeightSyncError (after
        tearing the group down) when a peer does not join or does not receive within ``timeout_s``."""
        t0 = time.monotonic()
        offer, pg, failure = pending.offer, None, ""
        try:
            pg = open_group(pending.store, group=offer.group, world_size=offer.world_size, rank=0,
                            backend=offer.backend, timeout_s=offer.timeout_s)
            for i, buffer in enumerate(pending.snapshot.flat):
                flat = buffer.to(self.device)  # no copy on CPU
                work = dist.broadcast(flat, group=pg, group_src=0, async_op=True)
                assert work is not None
                work.wait(timedelta(seconds=offer.timeout_s))
                logger.debug("weights v%d: bucket %d/%d sent (%d bytes)", offer.version, i + 1, len(offer.buckets),
                             flat.numel())
        except Exception as exc:  # torch raises RuntimeError/DistBackendError/DistStoreError: all mean the same
            failure = f"{type(exc).__name__}: {exc}"
        finally:
            close_group(pg)
            pg = None
            # The store must really close now: peers still waiting in the rendezvous or a collective (a server's
            # end has torch's 30-minute timeout) then fail at once ("connection closed") instead of hanging. So
            # no reference may survive: not the pending send's, and not a traceback's (the error is re-raised as
            # text, outside the except block, and reference cycles through frames are collected).
            pending.store = None  # type: ignore[assignment]
        if failure:
            gc.collect()
            raise WeightSyncError(f"broadcasting weights v{offer.version} to {offer.world_size - 1} server(s) "
                                  f"(group {offer.group}) failed after {time.monotonic() - t0:.1f}s: {failure}")
        return time.monotonic() - t0

    def _current(self) -> _Snapshot:
        snap = self._snapshot
        if snap is None:
            raise WeightSyncError("no weights to send yet: the trainer has not published a version")
        return snap


class RequestChannel(Protocol):
    """The trainer's end of :class:`agentrl.queue.weight_sync.SyncChannel`."""

    async def next_request(self, block_s: float) -> Any: ...  # -> SyncRequest | None
    async def answer(self, request: Any, reply: dict[str, Any]) -> None: ...
    async def loaded(self) -> int | None: ...
    async def forget_loaded(self) -> None: ...
    async def aclose(self) -> None: ...


class WeightServer:
    """Answers weight requests from a thread of its own (with its own event loop and Redis connection), so they
    are served while the training thread computes a step: a broadcast of the newest snapshot, its shared-memory
    names (``tensor``), or (the fallback) an export of it to ``export_dir/v<N>`` through ``write(tensors, path)``."""

    def __init__(self, sender: WeightSender, connect: Callable[[], Awaitable[RequestChannel]], *,
                 export_dir: Path, write: Callable[[Mapping[str, Tensor], Path], Any]) -> None:
        self.sender = sender
        self._connect = connect
        self._export_dir = export_dir
        self._write = write
        self._stop = threading.Event()
        self._finishing = threading.Event()
        self._final = 0
        self._finish_by = 0.0
        self._confirmed = False
        self._thread: threading.Thread | None = None
        self.served: list[tuple[int, int, float]] = []  # (version, servers, seconds) of each broadcast sent

    def start(self) -> Self:
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), name="weight-server", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop answering now (a trainer that failed: nobody should wait on its weights)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def finish(self, final_version: int, timeout_s: float) -> bool:
        """Keep answering until the rollout side confirms it serves ``final_version`` (its last load, a fallback
        export included, comes after the trainer's last step: stopping at once left it unanswered), at most
        ``timeout_s``; then stop. False if no confirmation came."""
        self._final = final_version
        self._finish_by = time.monotonic() + timeout_s
        self._finishing.set()
        if self._thread is not None:
            self._thread.join(timeout_s + 30.0)  # the loop checks every second; a request in service ends first
        self._stop.set()
        if not self._confirmed:
            logger.warning("weight server: the rollout side did not confirm loading v%d within %.0fs; stopping",
                           final_version, timeout_s)
        return self._confirmed

    async def _run(self) -> None:
        channel = await self._connect()
        try:
            try:  # a confirmation from an earlier attempt of this run says nothing now
                await channel.forget_loaded()
            except Exception:  # Redis past its retries: serve anyway (at worst the trainer ends without waiting)
                logger.exception("weight server: clearing the last load's confirmation failed")
            while not self._stop.is_set():
                try:
                    if self._finishing.is_set() and await self._done(channel):
                        return
                    request = await channel.next_request(block_s=1.0)
                    if request is not None:
                        await self._serve(channel, request)
                except Exception:  # one bad request (or a Redis hiccup past its retries) must not end the server
                    logger.exception("weight server: a request failed")
                    await asyncio.sleep(1.0)
        finally:
            await channel.aclose()

    async def _done(self, channel: RequestChannel) -> bool:
        loaded = await channel.loaded()
        self._confirmed = loaded is not None and loaded >= self._final
        if self._confirmed:
            logger.info("weight server: the rollout side serves v%d; stopping", loaded)
        return self._confirmed or time.monotonic() > self._finish_by

    async def _serve(self, channel: RequestChannel, request: Any) -> None:
        if request.kind == "export":
            await self._export(channel, request)
        elif request.kind == "tensor":
            await self._tensors(channel, request)
        else:
            await self._broadcast(channel, request)

    async def _export(self, channel: RequestChannel, request: Any) -> None:
        try:
            version, tensors = self.sender.snapshot()
            path = self._export_dir / f"v{version}"
            await asyncio.to_thread(self._write, tensors, path)
        except Exception as exc:
            await channel.answer(request, {"error": f"exporting the weights failed: {exc!r}"})
            return
        await channel.answer(request, {"path": str(path), "version": version})

    async def _tensors(self, channel: RequestChannel, request: Any) -> None:
        have = self.sender.version  # checked first: an offer made takes references a refusal would leak
        if have is not None and have < request.version:
            await channel.answer(request, {"error": f"the trainer has v{have}, not v{request.version} yet: ask "
                                                    "again once it is published"})
            return
        try:
            offer = self.sender.tensor_offer(request.world_size)
        except WeightSyncError as exc:
            await channel.answer(request, {"error": str(exc)})
            return
        await channel.answer(request, {"tensor": offer.to_dict()})
        logger.info("weights v%d offered in shared memory to %d server(s)", offer.version, len(offer.payloads))

    async def _broadcast(self, channel: RequestChannel, request: Any) -> None:
        try:
            pending = self.sender.offer(request.world_size)
        except WeightSyncError as exc:
            await channel.answer(request, {"error": str(exc)})
            return
        if pending.offer.version < request.version:
            await channel.answer(request, {"error": f"the trainer has v{pending.offer.version}, not v{request.version}"
                                                    " yet: ask again once it is published"})
            return
        await channel.answer(request, {"offer": pending.offer.to_dict()})
        try:
            seconds = await asyncio.to_thread(self.sender.send, pending)
        except WeightSyncError as exc:
            logger.warning("%s", exc)
            return
        self.served.append((pending.offer.version, pending.offer.world_size - 1, seconds))
        logger.info("weights v%d broadcast to %d server(s) in %.2fs (%d MB in %d buckets)", pending.offer.version,
                    pending.offer.world_size - 1, seconds, pending.offer.nbytes >> 20, len(pending.offer.buckets))
