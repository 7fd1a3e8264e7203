"""The piece-writing Redis client (agentrl.queue._connection) against real Redis servers: whatever the overrides
of redis-py's private methods do, every byte arrives."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest
import redis.asyncio

from agentrl.queue._connection import Pieces, _PieceWriter, sends_pieces

pytestmark = pytest.mark.redis


async def test_client_writes_large_pipelines_exactly(client: redis.asyncio.Redis, name: str) -> None:
    """make_client's connections write big commands piece by piece (before Python 3.12): several MB in one
    pipeline, far more than a socket buffer takes at once, with values of every size around the join
    threshold, arrive byte for byte."""
    sizes = [0, 1, _PieceWriter._JOIN_BELOW - 1, _PieceWriter._JOIN_BELOW, 70_000, 300_000, 2_000_000]
    values = [os.urandom(n) for n in sizes] * 2
    async with client.pipeline(transaction=True) as pipe:
        for k, v in enumerate(values):
            pipe.set(f"{name}:{k}", v)
            pipe.strlen(f"{name}:{k}")
        replies = await pipe.execute()
    assert replies[1::2] == [len(v) for v in values]
    assert await client.mget([f"{name}:{k}" for k in range(len(values))]) == values
    await client.delete(*(f"{name}:{k}" for k in range(len(values))))
    conn = await client.connection_pool.get_connection()
    try:
        expected = _PieceWriter if sys.version_info < (3, 12) else asyncio.StreamWriter
        assert type(conn._writer) is expected
    finally:
        await client.connection_pool.release(conn)


async def test_pieces_arguments_arrive_as_their_parts_joined(client: redis.asyncio.Redis, name: str) -> None:
    """A Pieces argument (e.g. a trajectory's wire pieces: small bytes and large memoryviews) is sent part by
    part, alone, inside a command with other arguments, and in pipelines; the server stores the parts joined."""
    import numpy as np

    big = np.arange(100_000, dtype="<i4")
    values = [Pieces([]), Pieces([b"a"]),
              Pieces([b"head", big.data.cast("B"), b"", memoryview(os.urandom(20_000)), b"tail"]),
              Pieces([memoryview(b"x" * 7000)[10:]]), Pieces([memoryview(big[:5000]), b"!"])]  # int32 items
    async with client.pipeline(transaction=True) as pipe:
        for k, v in enumerate(values):
            pipe.xadd(f"{name}:s", {"i": str(k), "t": v, "after": "z" * 9000})
        await pipe.execute()
    entries = await client.xrange(f"{name}:s")
    assert [f[b"t"] for _, f in entries] == [bytes(v) for v in values]
    assert entries[-1][1][b"t"] == big[:5000].tobytes() + b"!" and len(values[-1]) == 20_001
    assert all(f[b"after"] == b"z" * 9000 and f[b"i"] == str(k).encode() for k, (_, f) in enumerate(entries))
    await client.set(f"{name}:k", values[2])  # outside a pipeline too
    assert await client.get(f"{name}:k") == bytes(values[2]) and len(values[2]) == 400_008 + 20_000
    await client.delete(f"{name}:s", f"{name}:k")
    assert sends_pieces(client)
    stock = redis.asyncio.Redis.from_url("redis://localhost:1")  # never connects: only its class is looked at
    assert not sends_pieces(stock) and not sends_pieces(object())
    await stock.aclose()


def test_commands_are_packed_byte_for_byte_as_redis_py_packs_them() -> None:
    """make_client's pack_command (one join per command) sends exactly the bytes stock redis-py would, for every
    kind of argument, and keeps large values and memoryviews out of the joined framing, as redis-py does."""
    from agentrl.queue._connection import _pack

    stock = redis.asyncio.Connection()  # never connects: only its packing is used
    big, view = os.urandom(stock._buffer_cutoff + 1), memoryview(os.urandom(100))
    commands = [("PING",), ("CONFIG GET", "maxmemory"), (b"CONFIG SET", b"x", 1), ("EVALSHA", "ab" * 20, 3, "k", 7.5, -2),
                ("SET", "é" * 3, b""), ("XADD", "s", "*", "t", big, "v", view, "w", "tail"),
                ("XACK", "s", "g", *(f"{1700000000000 + i}-0" for i in range(500)))]
    for cmd in commands:
        ours, theirs = _pack(stock.encoder.encode, cmd, stock._buffer_cutoff), stock.pack_command(*cmd)
        assert b"".join(ours) == b"".join(theirs), cmd
        assert [c for c in ours if c is big or c is view] == [c for c in theirs if c is big or c is view]
    with pytest.raises(redis.exceptions.DataError):  # redis-py's encoder still checks the argument types
        _pack(stock.encoder.encode, ("SET", "k", True), stock._buffer_cutoff)
