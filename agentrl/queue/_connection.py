"""The Redis client of the queue and the registry: redis-py's asyncio client with a piece-writing connection.

Why: a trajectory is ~50 KB, most of it four numpy arrays, and the trainer reads thousands a minute. Stock
redis-py takes each payload as one bytes (the codec would have to join its pieces first), and Python 3.11's
transport joins a whole pipeline into one bytes (32 trajectories: 1.6 MB), then copies what the socket did not
take twice more. Here

- a :class:`Pieces` argument (a trajectory's :func:`agentrl.queue.codec.wire_pieces`: small framing bytes and
  memoryviews of the arrays) is framed as RESP around its parts, which are never joined;
- ``pack_command`` joins a command's small arguments once (redis-py re-joins a growing buffer per argument:
  ~53 us for the 97 arguments of an ACK of 32 entries);
- ``pack_commands`` does redis-py's chunking with less work per chunk (a pipeline of trajectories has hundreds);
- before Python 3.12 the stream writer is a :class:`_PieceWriter`, whose ``writelines`` hands large pieces to
  the transport as memoryviews (Python 3.12's transport does the same with ``sendmsg``).

Measured with ``benchmarks/queue_bench.py`` (docs/results.md; 47 KB trajectories, embedded Redis, Python 3.11):
the writer alone makes the raw XADD/XREADGROUP/XACK path 1.75x as fast as on stock redis-py
(``raw_client_vs_raw_ratio=1.754``), and sending the pieces unjoined is part of what took the queue's codec from
~0.10 to ~0.045 ms per trajectory.

The price: this module overrides private parts of redis-py's ``redis.asyncio.connection.AbstractConnection``
(``pack_command``, ``pack_commands``, ``_connect``, and reads ``encoder``, ``_buffer_cutoff``, ``_writer``).
pyproject.toml pins ``redis`` to the major version these were written and tested against (8.x); the tests in
``tests/queue/test_connection.py`` check byte-exact delivery through every override, so an upgrade that breaks
them fails there, not in a run.
"""

from __future__ import annotations

import asyncio
import functools
import sys
from collections.abc import Callable
from typing import Any

import redis.asyncio
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff


def make_client(url: str, *, connect_timeout_s: float = 10.0) -> redis.asyncio.Redis:
    """An asyncio client for the queue and registry: binary replies, no socket read timeout (blocking reads
    are bounded by asyncio.timeout instead), and one immediate reconnect — the RetryPolicy of the queue and the
    registry is the retry layer, so redis-py's own backoff (10 tries by default) would only multiply it.
    Its connections take :class:`Pieces` arguments (sent piece by piece, never joined) and, before Python 3.12,
    write large commands piece by piece (:class:`_PieceWriter`)."""
    pool = redis.asyncio.ConnectionPool.from_url(url, socket_connect_timeout=connect_timeout_s, socket_timeout=None,
                                                 retry=Retry(NoBackoff(), 1))
    # a class is hashable (functools.cache's key); the stub's AbstractConnection defines __eq__ without __hash__
    pool.connection_class = _piece_sending(pool.connection_class, sys.version_info < (3, 12))  # type: ignore[arg-type]
    client = redis.asyncio.Redis(connection_pool=pool)
    client.auto_close_connection_pool = True  # as from_url: aclose() closes the pool it made
    return client


class Pieces:
    """One bulk-string argument of a Redis command given as consecutive byte buffers (bytes, or C-contiguous
    memoryviews: cast to bytes ``B`` here), e.g. :func:`agentrl.queue.codec.wire_pieces`: a client of
    :func:`make_client` sends them one after another and never joins them (see :func:`sends_pieces`)."""

    __slots__ = ("parts", "nbytes")

    def __init__(self, parts: list[bytes | memoryview]) -> None:
        if any(type(p) is memoryview and p.format != "B" for p in parts):  # len() would count items, not bytes
            parts = [p.cast("B") if type(p) is memoryview and p.format != "B" else p for p in parts]
        self.parts = parts
        self.nbytes = sum(map(len, parts))

    def __len__(self) -> int:
        return self.nbytes

    def __bytes__(self) -> bytes:
        return b"".join(self.parts)


def sends_pieces(client: Any) -> bool:
    """Whether ``client``'s connections take :class:`Pieces` arguments (clients of :func:`make_client` do)."""
    pool = getattr(client, "connection_pool", None)
    return bool(getattr(getattr(pool, "connection_class", None), "sends_pieces", False))


_SMALL_PART = 2048  # bytes parts of a Pieces argument below this are joined with the command's framing


def _pack(encode: Callable[[Any], bytes], args: tuple[Any, ...], cutoff: int) -> list[bytes | memoryview]:
    """RESP for one command, as redis-py's ``pack_command`` lays it out (a value longer than ``cutoff`` or a
    memoryview is a chunk of its own, the rest is joined with the framing) but joined once at the end: redis-py
    re-joins its growing buffer for every argument, which made the 97 arguments of the queue's ACK cost ~53 us.
    A :class:`Pieces` argument goes as its parts: small bytes parts joined with the framing, the others (the
    arrays' memoryviews, large bytes) chunks of their own."""
    if isinstance(args[0], str):  # 'CONFIG GET'-style names, as redis-py splits them
        args = (*args[0].encode().split(), *args[1:])
    elif b" " in args[0]:
        args = (*args[0].split(), *args[1:])
    out: list[bytes | memoryview] = []
    buff: list[bytes] = [b"*%d\r\n" % len(args)]
    for arg in args:
        if type(arg) is Pieces:
            buff.append(b"$%d\r\n" % arg.nbytes)
            for part in arg.parts:
                if type(part) is bytes and len(part) < _SMALL_PART:
                    buff.append(part)
                    continue
                out.append(b"".join(buff))
                out.append(part)
                buff = []
            buff.append(b"\r\n")
            continue
        value = arg if type(arg) is bytes else encode(arg)  # (redis-py's encoder: its encoding, its checks)
        if type(value) is memoryview or len(value) > cutoff:
            buff.append(b"$%d\r\n" % len(value))
            out.append(b"".join(buff))
            out.append(value)
            buff = [b"\r\n"]
        else:
            buff += (b"$%d\r\n" % len(value), value, b"\r\n")
    out.append(b"".join(buff))
    return out


class _PieceWriter(asyncio.StreamWriter):
    """``writelines`` without the copies: Python 3.11's transport joins the pieces into one bytes (a pipeline of
    32 trajectories is 1.6 MB), then copies the part the socket did not take twice more (``data[n:]``, then into
    its buffer). Here small pieces are joined, large ones (payloads) go to the transport as they are, as
    memoryviews (so the unsent tail is a view, not a copy): at most one copy in Python (into the transport's
    buffer, once the socket is full). Python 3.12's transport does the same with ``sendmsg``."""

    _JOIN_BELOW = 16384

    def writelines(self, data: Any) -> None:
        transport, small = self.transport, []
        for piece in data:
            if len(piece) < self._JOIN_BELOW:
                small.append(piece)
                continue
            if small:
                transport.write(b"".join(small))
                small.clear()
            transport.write(memoryview(piece))
        if small:
            transport.write(b"".join(small))


@functools.cache  # one subclass per redis-py connection class, not one per client
def _piece_sending(base: type[Any], piece_writer: bool) -> type[Any]:
    """``base`` (a redis-py asyncio connection class) that packs :class:`Pieces` arguments, and whose stream
    writer is a :class:`_PieceWriter` if ``piece_writer``."""

    class PieceSending(base):  # type: ignore[misc, valid-type]
        sends_pieces = True

        def pack_command(self, *args: Any) -> list[Any]:
            return _pack(self.encoder.encode, args, self._buffer_cutoff)

        def pack_commands(self, commands: Any) -> list[Any]:
            """As redis-py's (small chunks joined up to the buffer cutoff, large ones and memoryviews alone),
            with less work per chunk: a pipeline of trajectories has hundreds."""
            out: list[Any] = []
            small: list[bytes] = []
            size, cutoff, pack = 0, self._buffer_cutoff, self.pack_command
            for cmd in commands:
                for chunk in pack(*cmd):
                    n = len(chunk)
                    if n > cutoff or type(chunk) is memoryview:
                        if small:
                            out.append(b"".join(small))
                            small, size = [], 0
                        out.append(chunk)
                        continue
                    small.append(chunk)
                    size += n
                    if size > cutoff:
                        out.append(b"".join(small))
                        small, size = [], 0
            if small:
                out.append(b"".join(small))
            return out

        if piece_writer:
            async def _connect(self) -> None:
                await super()._connect()
                if type(self._writer) is asyncio.StreamWriter:
                    self._writer.__class__ = _PieceWriter  # same object and state, one method different

    PieceSending.__name__ = PieceSending.__qualname__ = f"PieceSending{base.__name__}"
    return PieceSending
