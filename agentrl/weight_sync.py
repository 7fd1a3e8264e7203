"""The weight-sync offer: what the trainer tells the rollout side before it broadcasts one weight version.

``weight_sync.mode: distributed`` moves weights without a shared filesystem (SGLang's RL update path, the one
slime and AReaL use): trainer rank 0 and the SGLang servers form a fresh process group per update (gloo on CPU,
NCCL on GPU), rank 0 broadcasts the weights in flattened buckets of one dtype, and each server loads each bucket
as it arrives. Three rooms take part, each with its own module:

    agentrl/trainer/weight_sync.py   the sender (trainer rank 0): snapshot, buckets, the group, the broadcast
    agentrl/queue/weight_sync.py     the request/reply channel in Redis (the rollout asks, the trainer offers)
    agentrl/engine/weight_sync.py    the receiver side: the SGLang HTTP calls, in order, on every server

``weight_sync.mode: tensor`` is for servers on the trainer's host: the same snapshot lives in shared memory
(``/dev/shm``) and the trainer answers with a :class:`TensorOffer`, one payload per server that names the memory
(SGLang's ``/update_weights_from_tensor``: handles, no weight bytes); each server maps it and loads from it.

This module is the one contract between them, a plain JSON document (it travels through Redis), so that the
trainer never imports the engine and the engine never imports the trainer or the queue.
"""

from __future__ import annotations

import functools
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentrl.errors import ConfigError, InfrastructureError


class WeightSyncError(InfrastructureError):
    """A weight update through a process group failed: a peer did not join or receive in time, or a server
    refused a bucket. The group is torn down on both sides; the update is tried again or falls back to disk."""

#: dtypes a bucket may hold (by the name SGLang's ``/update_weights_from_distributed`` takes: ``torch.<name>``)
#: and their sizes in bytes
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8, "int64": 8, "int32": 4, "int16": 2, "int8": 1,
            "uint8": 1, "bool": 1}


@dataclass(frozen=True, slots=True)
class BucketMeta:
    """One broadcast: tensors of one dtype laid end to end as bytes, in this order (SGLang's flattened bucket)."""

    names: tuple[str, ...]
    dtype: str
    shapes: tuple[tuple[int, ...], ...]

    @property
    def nbytes(self) -> int:
        size = _itemsize(self.dtype)
        total = 0
        for shape in self.shapes:
            n = 1
            for d in shape:
                n *= d
            total += n * size
        return total

    def to_dict(self) -> dict[str, Any]:
        return {"names": list(self.names), "dtype": self.dtype, "shapes": [list(s) for s in self.shapes]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> BucketMeta:
        names, shapes = tuple(map(str, d["names"])), tuple(tuple(int(x) for x in s) for s in d["shapes"])
        if len(names) != len(shapes) or not names:
            raise ConfigError(f"a weight bucket needs one shape per name and at least one name, got {len(names)} "
                              f"names and {len(shapes)} shapes")
        _itemsize(str(d["dtype"]))
        return cls(names=names, dtype=str(d["dtype"]), shapes=shapes)


@dataclass(frozen=True, slots=True)
class WeightOffer:
    """Where and how to receive ``version``: join the group ``group`` at ``address:port`` as rank 1 + i (of
    ``world_size``; rank 0 is the trainer), then receive ``buckets`` in order. Every step is bounded by
    ``timeout_s`` on the trainer's side; the receiver bounds its own calls by it too."""

    version: int
    address: str
    port: int
    group: str
    world_size: int
    backend: str
    timeout_s: float
    buckets: tuple[BucketMeta, ...]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, "address": self.address, "port": self.port, "group": self.group,
                "world_size": self.world_size, "backend": self.backend, "timeout_s": self.timeout_s,
                "buckets": [b.to_dict() for b in self.buckets]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> WeightOffer:
        try:
            return cls(version=int(d["version"]), address=str(d["address"]), port=int(d["port"]),
                       group=str(d["group"]), world_size=int(d["world_size"]), backend=str(d["backend"]),
                       timeout_s=float(d["timeout_s"]),
                       buckets=tuple(BucketMeta.from_dict(b) for b in d["buckets"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"malformed weight offer ({exc!r}): expected the fields of WeightOffer, got "
                              f"{sorted(d)}") from exc


@dataclass(frozen=True, slots=True)
class TensorOffer:
    """``version`` in the shared memory of ``host`` (:func:`host_id`): ``payloads[i]`` is server i's argument to
    ``/update_weights_from_tensor`` (each may be used once: it holds one reference to the memory it names)."""

    version: int
    host: str
    payloads: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, "host": self.host, "payloads": list(self.payloads)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TensorOffer:
        try:
            return cls(version=int(d["version"]), host=str(d["host"]), payloads=tuple(map(str, d["payloads"])))
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"malformed tensor offer ({exc!r}): expected the fields of TensorOffer, got "
                              f"{sorted(d)}") from exc


@functools.cache
def host_id() -> str:
    """This machine, as two processes compare it to tell whether they can share memory: the host name and the
    kernel's boot id (two machines differ in both; the same name on two machines still differs in the boot id)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "no-boot-id"
    return f"{socket.gethostname()}/{boot}"


def plan_buckets(named: Sequence[tuple[str, str, tuple[int, ...]]], bucket_bytes: int) -> list[BucketMeta]:
    """Group ``(name, dtype, shape)`` into buckets, in order: consecutive tensors of one dtype, each bucket at most
    ``bucket_bytes`` (a tensor larger than that gets a bucket of its own)."""
    if bucket_bytes <= 0:
        raise ConfigError(f"bucket size must be positive, got {bucket_bytes} bytes")
    buckets: list[BucketMeta] = []
    names: list[str] = []
    shapes: list[tuple[int, ...]] = []
    dtype, size = "", 0
    for name, dt, shape in named:
        nbytes = BucketMeta((name,), dt, (tuple(shape),)).nbytes
        if names and (dt != dtype or size + nbytes > bucket_bytes):
            buckets.append(BucketMeta(tuple(names), dtype, tuple(shapes)))
            names, shapes, size = [], [], 0
        names.append(name)
        shapes.append(tuple(shape))
        dtype, size = dt, size + nbytes
    if names:
        buckets.append(BucketMeta(tuple(names), dtype, tuple(shapes)))
    return buckets


def _itemsize(dtype: str) -> int:
    if dtype not in ITEMSIZE:
        raise ConfigError(f"weight dtype {dtype!r} cannot be synced: expected one of {', '.join(ITEMSIZE)}")
    return ITEMSIZE[dtype]
