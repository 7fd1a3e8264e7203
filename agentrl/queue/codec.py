"""The trajectory wire format: how a :class:`~agentrl.types.Trajectory` is stored in the queue, and read back.

One msgpack map (schema :data:`~agentrl.types.SCHEMA_VERSION`)::

    {schema: 2, token_ids: bin, loss_mask: bin, behavior_logprobs: bin, weight_versions: bin,
     turns: bin, header: {every other field}}

the arrays as their little-endian bytes (dtypes: :data:`agentrl.types.ARRAYS`), ``turns`` as the msgpack bytes of
:func:`agentrl.types.turns_to_lists`, ``header`` as :func:`agentrl.types.plain_fields`. Any msgpack decoder reads
it, and a payload any msgpack encoder wrote (other field order, shorter bin lengths) decodes to the same trajectory
by the general path.

Why the rest of this module exists — speed: a trainer reads thousands of ~50 KB trajectories a minute. Measured
with ``benchmarks/queue_bench.py`` (docs/results.md), these took the codec from ~0.10 to ~0.045 ms per 47 KB
trajectory:

- agentrl writes the map in the order above with 32-bit bin lengths, so encoding is a list of pieces that point
  at the arrays' own memory (:func:`wire_pieces`); the queue's Redis client sends them unjoined
  (:class:`agentrl.queue._connection.Pieces`), sparing a copy of ~13 bytes per token;
- decoding finds the arrays at their offsets and wraps the payload's bytes (``np.frombuffer``, zero-copy);
  msgpack decodes only the small header;
- the turns stay bytes until something reads them (:class:`LazyTurns`; a trainer never does);
- one msgpack ``Packer`` per thread (``msgpack.packb`` builds a packer and its buffer per call).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Any, overload

import msgpack
import numpy as np

from agentrl.types import (
    ARRAYS,
    SCHEMA_VERSION,
    FinishReason,
    SchemaError,
    Trajectory,
    Turn,
    plain_fields,
    turns_from_lists,
    turns_to_lists,
)


class LazyTurns(Sequence[Turn]):
    """The turns of a trajectory read from the wire, decoded on first use (the texts, tool calls and results are
    most of a payload's decoding time, and a trainer never reads them). Behaves as the tuple of turns it stands for
    (compares equal to it; pickles undecoded, or as the tuple once decoded); a blob that does not decode raises
    :class:`~agentrl.types.SchemaError` when first read."""

    __slots__ = ("_blob", "_turns")

    def __init__(self, blob: bytes | memoryview) -> None:
        self._blob: bytes | memoryview | None = blob
        self._turns: tuple[Turn, ...] | None = None

    @property
    def wire(self) -> bytes | memoryview | None:
        """The encoded turns while they have not been decoded (re-encoding then costs nothing), else None."""
        return self._blob

    def _get(self) -> tuple[Turn, ...]:
        if self._turns is None:
            assert self._blob is not None
            self._turns = turns_from_lists(_unpack(self._blob, "its turns do not decode: "))
            self._blob = None
        return self._turns

    def __len__(self) -> int:
        return len(self._get())

    @overload
    def __getitem__(self, i: int) -> Turn: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[Turn, ...]: ...
    def __getitem__(self, i: int | slice) -> Turn | tuple[Turn, ...]:
        return self._get()[i]

    def __iter__(self) -> Iterator[Turn]:
        return iter(self._get())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, LazyTurns):
            return self._get() == other._get()
        return self._get() == other if isinstance(other, tuple) else NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(self._get())

    def __reduce__(self) -> tuple[Any, ...]:  # still undecoded: as bytes (a memoryview cannot be pickled)
        return (LazyTurns, (bytes(self._blob),)) if self._blob is not None else (tuple, (self._turns,))


def wire_pieces(t: Trajectory) -> list[bytes | memoryview]:
    """The msgpack payload of ``t`` as consecutive pieces, the arrays' (and undecoded turns') own memory among
    them: ``b"".join(wire_pieces(t)) == to_msgpack(t)``."""
    parts: list[bytes | memoryview] = []
    for name, key in _BIN_KEYS[:4]:  # each bin's key, marker and length in one small piece
        arr = getattr(t, name)
        parts += (key + arr.nbytes.to_bytes(4, "big"), arr.data.cast("B"))
    parts[0] = _WIRE_PREFIX + parts[0]
    turns = t.turns.wire if isinstance(t.turns, LazyTurns) else None
    if turns is None:
        turns = _packb(turns_to_lists(t.turns))
    parts += (_BIN_KEYS[4][1] + len(turns).to_bytes(4, "big"), turns, _HEADER_KEY + _packb(plain_fields(t)))
    return parts


def to_msgpack(t: Trajectory) -> bytes:
    """The payload of ``t`` as one bytes object."""
    return b"".join(wire_pieces(t))


def from_msgpack(payload: bytes) -> Trajectory:
    """The trajectory of a payload; :class:`~agentrl.types.SchemaError` if it is not one of this schema."""
    wire = _split(payload)
    if wire is None:  # not in our own layout: the general (copying) path
        wire = _unpack(payload, "")
        if not isinstance(wire, dict) or "schema" not in wire:
            raise SchemaError("not a trajectory: expected a map with a 'schema' field")
        if wire["schema"] != SCHEMA_VERSION:
            raise SchemaError(f"trajectory schema {wire['schema']} is not supported (this agentrl reads schema "
                              f"{SCHEMA_VERSION}); producer and consumer must run the same agentrl version")
        header = wire.pop("header", None)
        if not isinstance(header, dict):
            raise SchemaError("malformed trajectory payload: expected a 'header' map")
        wire = {**header, **wire}
    return _from_wire(wire)


# a map of 7: schema, the 4 arrays, turns, header
_WIRE_PREFIX = b"\x87" + msgpack.packb("schema") + msgpack.packb(SCHEMA_VERSION)
_BIN_KEYS = tuple((name, msgpack.packb(name) + b"\xc6") for name in (*ARRAYS, "turns"))  # bin32 fields, in order
_HEADER_KEY = msgpack.packb("header")
_packers = threading.local()  # msgpack.packb builds a Packer (and its buffer) per call; one per thread here


def _packb(obj: Any) -> bytes:
    try:
        pack = _packers.pack
    except AttributeError:
        pack = _packers.pack = msgpack.Packer(use_bin_type=True, autoreset=True).pack
    return pack(obj)  # type: ignore[no-any-return]


def _split(payload: bytes) -> dict[str, Any] | None:
    """The wire map of a payload laid out as :func:`wire_pieces` writes it, the arrays as views of ``payload`` and
    the turns as :class:`LazyTurns` on it; None if it is laid out otherwise (then the general msgpack path
    decides)."""
    if not isinstance(payload, bytes) or not payload.startswith(_WIRE_PREFIX):
        return None
    view, pos, end = memoryview(payload), len(_WIRE_PREFIX), len(payload)
    wire: dict[str, Any] = {}
    for name, key in _BIN_KEYS:  # key + bin32 marker, then a 4-byte big-endian length, then the bytes
        if not payload.startswith(key, pos):
            return None
        pos += len(key) + 4
        size = int.from_bytes(payload[pos - 4:pos], "big")
        if pos + size > end:
            return None
        wire[name] = view[pos:pos + size]
        pos += size
    if not payload.startswith(_HEADER_KEY, pos):
        return None
    header = _unpack(view[pos + len(_HEADER_KEY):], "its header does not decode: ")
    if not isinstance(header, dict):
        raise SchemaError(f"malformed trajectory payload: header is a {type(header).__name__}, expected a map")
    return {**header, **wire}


def _unpack(data: Any, what: str) -> Any:
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise SchemaError(f"not a msgpack trajectory: {what}{exc}") from exc


def _from_wire(w: dict[str, Any]) -> Trajectory:
    turns = w.get("turns")
    if not isinstance(turns, (bytes, memoryview)):
        raise SchemaError(f"malformed trajectory payload: its turns are a {type(turns).__name__}, expected bytes")
    try:
        return Trajectory(
            trajectory_id=w["trajectory_id"],
            prompt_id=w["prompt_id"],
            group_id=w["group_id"],
            token_ids=np.frombuffer(w["token_ids"], dtype=ARRAYS["token_ids"]),
            prompt_len=w["prompt_len"],
            loss_mask=np.frombuffer(w["loss_mask"], dtype=ARRAYS["loss_mask"]),
            behavior_logprobs=np.frombuffer(w["behavior_logprobs"], dtype=ARRAYS["behavior_logprobs"]),
            weight_versions=np.frombuffer(w["weight_versions"], dtype=ARRAYS["weight_versions"]),
            reward=w["reward"],
            finish_reason=FinishReason(w["finish_reason"]),
            reward_breakdown=w["reward_breakdown"],
            turns=LazyTurns(turns),
            env=w["env"],
            metadata=w["metadata"],
            created_at=w["created_at"],
        )
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise SchemaError(f"malformed trajectory payload: {exc!r}") from exc
