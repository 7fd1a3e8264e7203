"""The weight-version registry: which weights exist and which is latest.

Keys under ``namespace`` N:

- ``N:versions``    hash   version -> JSON record (path, step, created_at, metrics, transport);
- ``N:latest``      string the highest published version;
- ``N:events``      stream one entry per publish (field ``v``), what :meth:`WeightRegistry.wait_for` blocks on.

``wait_for`` cannot miss a publish: it notes the last event id *before* reading ``latest``, then blocks on events
after that id; a publish sets ``latest`` and appends its event atomically, so it is seen by one or the other.
Deleting the files of old versions is the trainer's job (it keeps the newest few); the registry only records them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from types import TracebackType
from typing import Any, Self

import redis.asyncio

from agentrl.queue.base import WeightVersion, WeightVersionError
from agentrl.queue.retry import RetryPolicy

log = logging.getLogger(__name__)


TRANSPORTS = ("disk", "distributed", "tensor", "base")


class VersionWaitTimeout(WeightVersionError, TimeoutError):
    """``wait_for`` saw no version >= the one asked for within its timeout."""


# KEYS: versions, latest, events.  ARGV: version, record, record prefix up to the path (see _dump).
# -> {1, record} published | {0, existing record} (same version, other path)
_PUBLISH = """
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if cur and string.sub(cur, 1, #ARGV[3]) ~= ARGV[3] then return {0, cur} end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
local latest = tonumber(redis.call('GET', KEYS[2]) or '-1')
if tonumber(ARGV[1]) > latest then redis.call('SET', KEYS[2], ARGV[1]) end
redis.call('XADD', KEYS[3], 'MAXLEN', '~', 1000, '*', 'v', ARGV[1])
return {1, ARGV[2]}
"""

# KEYS: versions, latest.  -> {version, record} | false
_LATEST = """
local v = redis.call('GET', KEYS[2])
if not v then return false end
return {v, redis.call('HGET', KEYS[1], v)}
"""

# KEYS: versions, latest.  ARGV: version.  Unregisters every version above it; latest becomes it (or unset when it
# is not registered).  -> how many were unregistered
_REWIND = """
local n = 0
for _, v in ipairs(redis.call('HKEYS', KEYS[1])) do
  if tonumber(v) > tonumber(ARGV[1]) then redis.call('HDEL', KEYS[1], v); n = n + 1 end
end
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then redis.call('SET', KEYS[2], ARGV[1])
else redis.call('DEL', KEYS[2]) end
return n
"""


class WeightRegistry:
    """Weight versions of one run in Redis (see the module docstring)."""

    def __init__(self, redis_client: redis.asyncio.Redis, namespace: str, *, retry: RetryPolicy | None = None,
                 op_timeout_s: float = 30.0) -> None:
        self._redis = redis_client
        self.namespace = namespace
        self._versions, self._latest = f"{namespace}:versions", f"{namespace}:latest"
        self._events = f"{namespace}:events"
        self._retry = retry or RetryPolicy()
        self._op_timeout_s = op_timeout_s
        self._publish = redis_client.register_script(_PUBLISH)
        self._get_latest = redis_client.register_script(_LATEST)
        self._rewind = redis_client.register_script(_REWIND)

    async def publish(self, version: int, path: str, *, step: int, metrics: Mapping[str, float] | None = None,
                      transport: str = "disk") -> WeightVersion:
        """Register ``version`` at ``path`` (``transport``: see WeightVersion) and wake every ``wait_for``.
        Publishing an existing version again with the same path replaces its record (a resumed trainer); with
        another path it is an error."""
        if transport not in TRANSPORTS:
            raise WeightVersionError(f"unknown weight transport {transport!r}: expected one of {', '.join(TRANSPORTS)}")
        wv = WeightVersion(version=int(version), path=str(path), step=int(step), created_at=time.time(),
                           metrics={k: float(v) for k, v in (metrics or {}).items()}, transport=transport)
        keys = [self._versions, self._latest, self._events]
        ok, record = await self._call(lambda: self._publish(keys=keys, args=[wv.version, _dump(wv), _path_prefix(wv.path)]),
                                      "publish")
        if not int(ok):
            raise WeightVersionError(f"weight version {version} is already published at "
                                     f"{_load(version, record).path}, not at {path}: versions are immutable; "
                                     "publish the new weights under a new version number")
        log.info("published weight version %d (step %d) at %s", wv.version, wv.step, wv.path)
        return wv

    async def rewind(self, version: int) -> int:
        """Forget every version above ``version`` (a run resumed from the checkpoint of ``version`` trains them
        again and re-publishes them); ``latest`` becomes ``version``. Returns how many were forgotten."""
        keys = [self._versions, self._latest]
        n = int(await self._call(lambda: self._rewind(keys=keys, args=[int(version)]), "rewind"))
        if n:
            log.info("forgot %d weight versions above %d (a resumed run trains them again)", n, version)
        return n

    async def latest(self) -> WeightVersion | None:
        """The highest published version, or None before the first publish."""
        reply = await self._call(lambda: self._get_latest(keys=[self._versions, self._latest]), "latest")
        if not reply or reply[1] is None:
            return None
        return _load(int(reply[0]), reply[1])

    async def get(self, version: int) -> WeightVersion:
        """The record of ``version``; WeightVersionError if it was never published or was rewound."""
        record = await self._call(lambda: self._redis.hget(self._versions, str(version)), "get")
        if record is None:
            raise WeightVersionError(f"weight version {version} is not registered in {self.namespace!r} (never "
                                     "published, or forgotten by a rewind): use latest() or a newer version")
        return _load(version, record)

    async def wait_for(self, min_version: int, *, timeout_s: float) -> WeightVersion:
        """The latest version once it is >= ``min_version``; VersionWaitTimeout after ``timeout_s``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        tail = await self._call(lambda: self._redis.xrevrange(self._events, count=1), "wait_for")
        last_id = tail[0][0] if tail else b"0-0"  # noted before reading latest: see the module docstring
        while True:
            current = await self.latest()
            if current is not None and current.version >= min_version:
                return current
            remaining = deadline - loop.time()
            if remaining <= 0:
                have = "none" if current is None else str(current.version)
                raise VersionWaitTimeout(f"no weight version >= {min_version} was published in {self.namespace!r} "
                                         f"within {timeout_s}s (latest: {have}); is the trainer running?")
            block_ms = max(1, int(remaining * 1000))

            async def read(after: Any = last_id, ms: int = block_ms) -> Any:
                async with asyncio.timeout(ms / 1000 + self._op_timeout_s):
                    return await self._redis.xread({self._events: after}, block=ms)

            reply = await self._retry.call(read, what=f"wait for weight version {min_version}")
            if reply:
                last_id = reply[0][1][-1][0]

    async def aclose(self) -> None:
        """Nothing to release: the Redis client belongs to whoever created it (see RedisHandle)."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()

    async def _call(self, op: Callable[[], Awaitable[Any]], what: str) -> Any:
        async def bounded() -> Any:
            async with asyncio.timeout(self._op_timeout_s):
                return await op()
        return await self._retry.call(bounded, what=f"{what} in weight registry {self.namespace!r}")


def _path_prefix(path: str) -> str:
    return json.dumps({"path": path})[:-1] + ","  # what _dump(wv) starts with: path is its first key


def _dump(wv: WeightVersion) -> str:
    return json.dumps({"path": wv.path, "step": wv.step, "created_at": wv.created_at, "metrics": dict(wv.metrics),
                       "transport": wv.transport})


def _load(version: int, record: bytes | str) -> WeightVersion:
    d = json.loads(record)
    return WeightVersion(version=version, path=d["path"], step=int(d["step"]), created_at=float(d["created_at"]),
                         metrics={k: float(v) for k, v in d["metrics"].items()}, transport=d.get("transport", "disk"))
