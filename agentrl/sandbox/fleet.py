"""``SandboxFleet``: the Sandbox protocol over several sandbox servers (``agentrl sandbox serve``), one
:class:`RemoteSandbox` client per server.

    run ──► the healthy server with the least load ── ServerUnavailable (nothing ran) ──► the next least loaded …
            └─ no healthy server left, or every one tried ──► a SandboxError *result* (a reward's INFRA_ERROR, never 0)
    session ──► opened on the least loaded healthy server and pinned there: its cells never move (its state lives
                there); if that server dies, its cells answer SandboxError results
    health loop, every ``health_interval_s`` ──► ``GET /v1/ping`` on every server, ``health_timeout_s`` each:
                ``failures_to_down`` failures in a row take a server out; one ``pong`` puts it back

The load of a server is the share of its slots in use, as this client sees it (the least wins; ties go round-robin):

    load(s) = (mine(s) + others(s)) / capacity(s),    others(s) = max(0, busy(s) - mine_then(s))

``mine`` is this client's requests in flight to ``s`` now; ``busy`` is what ``s`` reported at its last ping (requests
running or queued, :class:`agentrl.sandbox.schemas.ServerLoad`) and ``mine_then`` ours when that ping was sent, so
``others`` estimates the other clients' share (up to one ``health_interval_s`` old); ``capacity`` is its slots (1 from
a server that does not report). With one client ``others`` stays ~0 and this is least-outstanding-requests, weighted
by capacity.

A run that fails with :class:`ServerUnavailable` takes its server out at once (unless it answered 429: up, but
full) and goes to the next server; any other failure (no answer within the run's deadline: it may have run) is the
run's SandboxError result and is not sent again. The pattern of the engine's pool (``engine/pool.py``: least in
flight, round-robin ties, a health loop), without what is SGLang's there (weights, restarts, sticky keys).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Self, TypeVar

from agentrl.errors import ConfigError, SandboxError
from agentrl.sandbox._wire import sandbox_error
from agentrl.sandbox.base import Limits, RunRequest, RunResult
from agentrl.sandbox.config import FleetConfig, check_url
from agentrl.sandbox.remote import RemoteSandbox, RemoteSession, ServerUnavailable
from agentrl.sandbox.schemas import ServerLoad

T = TypeVar("T")

log = logging.getLogger(__name__)


@dataclass
class _Server:
    client: RemoteSandbox
    up: bool = True  # optimistic until a run or a ping says otherwise
    inflight: int = 0  # this client's requests to it now (runs, session opens and cells)
    requests: int = 0
    failures: int = 0  # failed pings in a row
    reported: ServerLoad | None = None
    mine_then: int = 0  # our in-flight requests when ``reported`` was asked for
    why_down: str = ""

    @property
    def url(self) -> str:
        return self.client.url

    def load(self) -> float:
        if self.reported is None:
            return float(self.inflight)
        others = max(0, self.reported.busy - self.mine_then)
        return (self.inflight + others) / self.reported.capacity


@dataclass(frozen=True, slots=True)
class ServerStats:
    url: str
    up: bool
    inflight: int
    requests: int  # sent to it so far (runs, session opens, cells)
    reported: ServerLoad | None


class SandboxFleet:
    """Implements the Sandbox protocol over several sandbox servers (see the module docstring). ``remote_opts`` go
    to each server's :class:`RemoteSandbox` (``token``, ``timeout_s``, ...); ``retries`` is 1 here (one more try on
    the same server before the run moves on), not the lone client's 3."""

    def __init__(self, urls: Sequence[str], *, fleet: FleetConfig | None = None,
                 client_factory: Callable[..., RemoteSandbox] = RemoteSandbox, **remote_opts: Any) -> None:
        if not urls:
            raise ConfigError("a sandbox fleet needs at least one server URL")
        clean = [check_url(u, "sandbox fleet") for u in urls]
        if len({u.rstrip("/") for u in clean}) < len(clean):
            raise ConfigError(f"sandbox servers are listed twice: {list(urls)}")
        self.config = fleet or FleetConfig()
        remote_opts.setdefault("retries", 1)
        self._servers = [_Server(client_factory(u, **remote_opts)) for u in clean]
        self._rr = itertools.count()
        self._health: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self._servers]

    def stats(self) -> list[ServerStats]:
        return [ServerStats(s.url, s.up, s.inflight, s.requests, s.reported) for s in self._servers]

    # ------------------------------------------------------------------------------------------- runs

    async def run(self, request: RunRequest) -> RunResult:
        self._watch()
        t0 = time.monotonic()
        try:
            _, result = await self._on_a_server("the run", lambda s: s.client.run_or_raise(request))
        except SandboxError as exc:
            return sandbox_error(str(exc), time.monotonic() - t0)
        return result

    async def session(self, language: str = "python", limits: Limits | None = None) -> FleetSession:
        """A session on the least loaded healthy server, pinned there (raises SandboxError if none can open one)."""
        self._watch()
        server, inner = await self._on_a_server("a session", lambda s: s.client.session(language, limits))
        return FleetSession(self, server, inner)

    async def _on_a_server(self, what: str, call: Callable[[_Server], Awaitable[T]]) -> tuple[_Server, T]:
        """``call`` on the least loaded healthy server; a server that did not take it (``ServerUnavailable``) is
        skipped, and taken out unless it was only busy; any other SandboxError ends the search. Raises SandboxError
        when no server is left."""
        tried: set[int] = set()
        errors: list[str] = []
        while (server := self._pick(tried)) is not None:
            tried.add(id(server))
            server.inflight += 1
            server.requests += 1
            try:
                return server, await call(server)
            except ServerUnavailable as exc:
                errors.append(str(exc))
                if not exc.busy:
                    self._take_out(server, str(exc))
            finally:
                server.inflight -= 1
        raise SandboxError(self._none_left(what, errors))

    def _pick(self, tried: set[int]) -> _Server | None:
        """The least loaded server that is up and not tried yet (ties: round-robin), or None."""
        up = [s for s in self._servers if s.up and id(s) not in tried]
        if not up:
            return None
        start = next(self._rr)
        return min((up[(start + i) % len(up)] for i in range(len(up))), key=_Server.load)

    def _none_left(self, what: str, errors: list[str]) -> str:
        states = "; ".join(f"{s.url}: {'up' if s.up else 'down (' + s.why_down + ')'}" for s in self._servers)
        tried = f" (tried: {' | '.join(errors)})" if errors else ""
        return (f"no sandbox server can take {what}{tried}; the fleet: {states}. Start the servers or fix "
                f"sandbox.url; a server is put back once its /v1/ping answers")

    # ------------------------------------------------------------------------------------------- health

    def _watch(self) -> None:
        """Start the health loop on first use (it needs the running loop)."""
        if self._health is None and not self._closed:
            self._health = asyncio.get_running_loop().create_task(self._health_loop())

    async def start(self) -> Self:
        """Ping every server once now (so the down ones are known before the first run), then keep watching."""
        await asyncio.gather(*(self._check(s) for s in self._servers))
        self._watch()
        return self

    async def _health_loop(self) -> None:
        while True:
            await asyncio.gather(*(self._check(s) for s in self._servers))
            await asyncio.sleep(self.config.health_interval_s)

    async def _check(self, server: _Server) -> None:
        mine = server.inflight
        try:
            load = await server.client.load(self.config.health_timeout_s)
        except ServerUnavailable as exc:
            server.failures += 1
            if server.failures >= self.config.failures_to_down:
                self._take_out(server, f"{server.failures} pings failed, the last: {exc}")
            return
        server.failures, server.reported, server.mine_then = 0, load, mine
        if not server.up:
            server.up, server.why_down = True, ""
            log.info("sandbox server %s answers again: back in the fleet", server.url)

    def _take_out(self, server: _Server, why: str) -> None:
        if server.up and not self._closed:
            server.up, server.why_down, server.reported = False, why, None
            log.error("sandbox server %s is out of the fleet (%s); it is put back when its /v1/ping answers",
                      server.url, why)

    # ------------------------------------------------------------------------------------------- teardown

    async def aclose(self) -> None:
        self._closed = True
        if self._health is not None:
            self._health.cancel()
            await asyncio.gather(self._health, return_exceptions=True)
            self._health = None
        for s in self._servers:
            await s.client.aclose()

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class FleetSession:
    """A session pinned to the server it was opened on; its load counts there while a cell runs."""

    def __init__(self, fleet: SandboxFleet, server: _Server, inner: RemoteSession) -> None:
        self._fleet, self._server, self._inner = fleet, server, inner

    @property
    def url(self) -> str:
        """The server this session lives on."""
        return self._server.url

    @property
    def closed(self) -> bool:
        return self._inner.closed

    async def run(self, code: str, *, time_s: float | None = None) -> RunResult:
        self._server.inflight += 1
        self._server.requests += 1
        try:
            return await self._inner.run(code, time_s=time_s)
        finally:
            self._server.inflight -= 1

    async def aclose(self) -> None:
        await self._inner.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
