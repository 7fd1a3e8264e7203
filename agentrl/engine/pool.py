"""Several SGLang servers behind one engine: sticky routing, health checks, crash recovery with weight resync.

    generate(ids, sticky_key=k) ──► the server k was first sent to (least busy at that moment), while it is up
    load_weights(source) / update_weights / pause / resume / set_weight_version ──► every server that is up
    start ──► every server agentrl did not start is told ``/continue_generation`` once (a pause an owner killed
              mid-pause left behind would make it look hung: SGLang's ``/health`` waits while paused)
    health loop ──► a server whose process died, or that failed ``failures_to_down`` checks in a row, is taken
                    out; if agentrl started it, it is restarted on the same port, loads the CURRENT weights
                    (from the last weight source: a folder, a broadcast, or the start-up weights under a
                    version), is paused too if the pool is, and
                    only then is put back (as slime does).

Requests in flight on a server that dies fail with :class:`EngineError` (the rollout scheduler retries the group);
``generate`` waits up to ``wait_for_server_s`` when no server is up (a restart takes ~20-40 s on CPU) instead of
failing at once. All turns of one episode (all samples of one group, when the key is the group id) go to one
server, so its prefix cache is reused.

Invariant: a server is ``up`` only while it serves the pool's current weight version; membership changes and
weight updates are serialised by one lock, so a restarted server cannot rejoin with old weights.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, Self, TypeVar

from agentrl.engine.base import EngineTimeout, EngineUnavailable, GenerateResult, PauseMode, SamplingParams
from agentrl.engine.client import SGLangClient
from agentrl.engine.config import PoolConfig
from agentrl.engine.weight_sync import AsStarted, FromDisk, Outcome, WeightSource
from agentrl.errors import EngineError
from agentrl.retry import Retry

T = TypeVar("T")

logger = logging.getLogger(__name__)


class ManagedServer(Protocol):
    """A server process the pool may restart (:class:`SGLangServer`)."""

    @property
    def url(self) -> str: ...
    def alive(self) -> bool: ...
    def cpu_seconds(self) -> float | None: ...  # CPU time of its processes so far (None: unknown)
    def restart(self) -> Any: ...
    def stop(self, timeout_s: float = ...) -> None: ...


class MemberState(str, enum.Enum):
    UP = "up"
    DOWN = "down"  # out of rotation; waiting to be restarted or (not ours) to answer again
    RESTARTING = "restarting"
    FAILED = "failed"  # out for good: restarts exhausted


@dataclass
class _Member:
    client: SGLangClient
    server: ManagedServer | None  # None: a server agentrl did not start (reached by URL only)
    state: MemberState = MemberState.UP
    inflight: int = 0
    requests: int = 0
    failures: int = 0
    restarts: int = 0
    starting: asyncio.Future[Any] | None = None  # the thread (re)starting the server process
    # the last sign of work (a health answer, a finished request, CPU time used; see PoolConfig.hung_after_s)
    last_progress: float = field(default_factory=time.monotonic)
    unhealthy_since: float | None = None  # when /health last went from answering to not
    cpu_s: float | None = None  # its processes' CPU time at the last check

    @property
    def url(self) -> str:
        return self.client.url


@dataclass(frozen=True, slots=True)
class MemberStats:
    url: str
    state: str
    inflight: int
    requests: int
    restarts: int


class EnginePool:
    """Implements :class:`agentrl.engine.base.ControllableEngine` over several SGLang servers."""

    def __init__(self, members: Sequence[ManagedServer | str], *, config: PoolConfig = PoolConfig(),
                 client_factory: Callable[[str], SGLangClient] = SGLangClient,
                 on_restart: Callable[[Any], None] | None = None, router: str | None = None) -> None:
        """``members``: servers agentrl started (restarted on a crash) or URLs of servers it did not start.
        ``on_restart(server)`` is called after each restart of a server process (e.g. to record its new pid).
        ``router``: the URL of an sglang-router in front of the members: generation goes through it (its policy
        routes), falling back to the pool's own sticky routing while it does not answer; control is the pool's."""
        if not members:
            raise EngineError("an EnginePool needs at least one server (an SGLangServer or a URL)")
        self.config = config
        self._members = [
            _Member(client_factory(m), None) if isinstance(m, str) else _Member(client_factory(m.url), m)
            for m in members
        ]
        self._routes: OrderedDict[str, _Member] = OrderedDict()
        self._rr = itertools.count()
        self._changed = asyncio.Condition()
        self._lock = asyncio.Lock()  # weight updates, pause state and membership changes
        self._target: WeightSource | None = None  # None: the weights the servers were started with
        self._paused: PauseMode | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._closing = False
        self._health: asyncio.Task[None] | None = None
        self._on_restart = on_restart
        self._router = client_factory(router) if router else None
        self._router_up = True

    def start(self) -> Self:
        """Start the health loop (idempotent)."""
        if self._health is None:
            self._health = asyncio.get_running_loop().create_task(self._health_loop())
        return self

    @property
    def urls(self) -> list[str]:
        return [m.url for m in self._members]

    def stats(self) -> list[MemberStats]:
        return [MemberStats(m.url, m.state.value, m.inflight, m.requests, m.restarts) for m in self._members]

    def route_of(self, sticky_key: str) -> str | None:
        member = self._routes.get(sticky_key)
        return member.url if member is not None else None

    # -- generation -------------------------------------------------------------------------------------------

    async def generate(self, input_ids: Sequence[int], sampling: SamplingParams, *,
                       sticky_key: str | None = None) -> GenerateResult:
        return await self._routed(sticky_key, lambda client: client.generate(input_ids, sampling), count=True)

    async def prefill(self, input_ids: Sequence[int], *, sticky_key: str | None = None) -> None:
        """:meth:`SGLangClient.prefill` on the server that ``sticky_key``'s requests go to (the router's choice when
        there is one)."""
        await self._routed(sticky_key, lambda client: client.prefill(input_ids), count=False)

    async def _routed(self, sticky_key: str | None, call: Callable[[Any], Awaitable[T]], *, count: bool) -> T:
        """``call(client)`` through the router while it answers, else on ``sticky_key``'s server; ``count``: a
        request in the member's stats."""
        if self._router is not None and self._router_up:
            try:
                return await call(self._router)
            except EngineUnavailable as exc:  # the router is gone: route ourselves until it answers again
                self._router_up = False
                logger.error("sglang-router %s does not answer (%s); routing to the servers directly until it does",
                             self._router.url, exc)
        member = await self._pick(sticky_key)
        member.inflight += 1
        member.requests += count
        try:
            result = await call(member.client)
            member.last_progress = time.monotonic()
            return result
        except EngineUnavailable:
            self._suspect(member)
            raise
        finally:
            member.inflight -= 1

    async def _pick(self, key: str | None) -> _Member:
        if key is not None and (m := self._routes.get(key)) is not None and m.state is MemberState.UP:
            self._routes.move_to_end(key)
            return m
        up = [m for m in self._members if m.state is MemberState.UP]
        if not up:
            up = await self._wait_for_up()
        start = next(self._rr)
        member = min((up[(start + i) % len(up)] for i in range(len(up))), key=lambda m: m.inflight)
        if key is not None:
            self._routes[key] = member
            self._routes.move_to_end(key)
            while len(self._routes) > self.config.sticky_capacity:
                self._routes.popitem(last=False)
        return member

    async def _wait_for_up(self) -> list[_Member]:
        def up() -> list[_Member]:
            return [m for m in self._members if m.state is MemberState.UP]

        try:
            async with asyncio.timeout(self.config.wait_for_server_s):
                async with self._changed:
                    await self._changed.wait_for(lambda: bool(up()) or self._all_failed())
        except TimeoutError:
            pass
        if not up():
            raise EngineError(
                f"no SGLang server is up ({', '.join(f'{m.url}: {m.state.value}' for m in self._members)}) "
                f"after waiting {self.config.wait_for_server_s:g}s; see the server logs"
            )
        return up()

    def _all_failed(self) -> bool:
        return all(m.state is MemberState.FAILED for m in self._members)

    # -- weights and control, fanned out ----------------------------------------------------------------------

    async def load_weights(self, source: WeightSource) -> int:
        """Bring every server that is up to ``source``'s weights; returns the version they now serve. A server that
        dies or hangs meanwhile is taken out and comes back with these weights (from the same source); a server
        that refuses them (a bad path, say) raises EngineError."""
        async with self._lock:
            self._target = source
            up = [m for m in self._members if m.state is MemberState.UP]
            self._settle(up, await source.load([m.client for m in up]), f"load weights v{source.version}")
            return source.version

    async def retarget(self, source: WeightSource) -> None:
        """From now on a restarted server gets its weights from ``source``, which must hold the weights the servers
        serve now (nothing is loaded here): e.g. the final version written to disk once the trainer that broadcast
        it has ended."""
        async with self._lock:
            self._target = source

    async def update_weights(self, path: str, version: int) -> None:
        """Load the HF folder ``path`` as ``version`` on every server that is up (see :meth:`load_weights`)."""
        await self.load_weights(FromDisk(path, version))

    async def set_weight_version(self, version: int) -> None:
        """Report the weights the servers were started with as ``version``."""
        await self.load_weights(AsStarted(version))

    async def pause(self, mode: PauseMode = "abort") -> None:
        async with self._lock:
            await self._fan_out(lambda c: c.pause(mode), f"pause ({mode})")
            self._paused = mode

    async def resume(self) -> None:
        async with self._lock:
            await self._fan_out(lambda c: c.resume(), "resume")
            self._paused = None

    async def release_memory(self) -> None:
        """Every server that is up frees its GPU memory for a colocated trainer (see
        :meth:`SGLangClient.release_memory`)."""
        async with self._lock:
            await self._fan_out(lambda c: c.release_memory(), "release memory")

    async def resume_memory(self) -> None:
        async with self._lock:
            await self._fan_out(lambda c: c.resume_memory(), "resume memory")

    async def abort_all(self) -> None:
        async with self._lock:
            await self._fan_out(lambda c: c.abort_all(), "abort all")

    async def weight_version(self) -> int:
        """The version every server that is up serves (the lowest, should they ever differ)."""
        up = [m for m in self._members if m.state is MemberState.UP] or await self._wait_for_up()
        return min(await asyncio.gather(*(m.client.weight_version() for m in up)))

    async def _fan_out(self, op: Callable[[SGLangClient], Any], what: str) -> None:
        """``op`` on every server that is up. Servers that died or hung are taken out (they are brought to the
        current weights and pause state before they rejoin); any other failure is raised, naming the servers."""
        up = [m for m in self._members if m.state is MemberState.UP]
        results = await asyncio.gather(*(op(m.client) for m in up), return_exceptions=True)
        self._settle(up, [r if isinstance(r, BaseException) else None for r in results], what)

    def _settle(self, members: list[_Member], outcome: Outcome, what: str) -> None:
        refused = []
        for m, r in zip(members, outcome):
            if isinstance(r, (EngineUnavailable, EngineTimeout)):
                logger.error("%s failed on %s: %s; taking it out", what, m.url, r)
                self._take_out(m)
            elif isinstance(r, EngineError):
                refused.append(f"{m.url}: {r}")
            elif isinstance(r, BaseException):
                raise r
        if refused:
            raise EngineError(f"{what} failed on {len(refused)} of {len(members)} servers: " + "; ".join(refused))

    # -- health and recovery ----------------------------------------------------------------------------------

    def _suspect(self, member: _Member) -> None:
        """A request could not reach ``member``: check it now rather than at the next tick."""
        if member.state is MemberState.UP:
            self._spawn(self._check(member))

    async def _health_loop(self) -> None:
        await self._clear_stale_pause()
        while True:
            await asyncio.gather(*(self._check(m) for m in self._members))
            if self._router is not None and not self._router_up and await self._router.health(
                    self.config.health_timeout_s):
                self._router_up = True
                logger.info("sglang-router %s answers again; generation goes through it", self._router.url)
            await asyncio.sleep(self.config.health_interval_s)

    async def _clear_stale_pause(self) -> None:
        """``/continue_generation`` once on every server this pool did not start, as it attaches. Such a server may
        have been left paused by an earlier owner killed between pause and resume (a rollout process of this run,
        before ``--resume``): SGLang's ``/health`` generates a token and so waits while paused, and the pool would
        take a healthy server for a hung one while every request waits on it. On a server that is not paused it
        does nothing. A pool is the one controller of its servers (a second one pausing them would fight it
        anyway), so nothing else's pause is undone."""
        async with self._lock:
            if self._paused is not None:
                return
            attached = [m for m in self._members if m.server is None]
            results = await asyncio.gather(*(m.client.resume() for m in attached), return_exceptions=True)
        for m, r in zip(attached, results):
            if isinstance(r, BaseException):  # not answering: the health checks deal with it
                logger.warning("could not clear a pause left on %s: %s", m.url, r)

    async def _check(self, member: _Member) -> None:
        if member.state in (MemberState.RESTARTING, MemberState.FAILED):
            return
        dead = member.server is not None and not member.server.alive()
        health = "unreachable" if dead else await member.client.probe(self.config.health_timeout_s)
        healthy = health == "ok"
        if member.state is MemberState.DOWN:
            if healthy and member.server is None:  # a server we do not manage answers again
                self._spawn(self._rejoin_logged(member))
            return
        now = time.monotonic()
        if healthy:
            member.failures, member.unhealthy_since, member.last_progress = 0, None, now
            return
        member.failures += 1
        member.unhealthy_since = member.unhealthy_since or now
        cpu = member.server.cpu_seconds() if member.server is not None else None
        if cpu is not None and member.cpu_s is not None and cpu > member.cpu_s + 0.05:
            member.last_progress = now  # its processes are computing: slow, not hung
        member.cpu_s = cpu
        if member.failures < self.config.failures_to_down:
            return
        idle_s, unhealthy_s = now - member.last_progress, now - member.unhealthy_since
        if health == "unreachable" or idle_s >= self.config.hung_after_s or unhealthy_s >= self.config.max_unhealthy_s:
            why = ("dead" if dead else "unreachable" if health == "unreachable" else
                   f"not answering /health for {unhealthy_s:.0f}s, no progress for {idle_s:.0f}s")
            logger.error("SGLang server %s is %s; taking it out", member.url, why)
            self._take_out(member)
        elif member.failures == self.config.failures_to_down:
            logger.warning("SGLang server %s is not answering /health but is still working (CPU or requests): "
                           "slow, not dead; taken out only after %.0fs without progress", member.url,
                           self.config.hung_after_s)

    def _take_out(self, member: _Member) -> None:
        if member.state is not MemberState.UP or self._closing:
            return
        member.state = MemberState.DOWN
        for key in [k for k, m in self._routes.items() if m is member]:
            del self._routes[key]
        self._spawn(self._notify())
        if member.server is not None and self.config.restart:
            self._spawn(self._restart(member))

    async def _restart(self, member: _Member) -> None:
        assert member.server is not None
        while member.restarts < self.config.max_restarts and not self._closing:
            member.state = MemberState.RESTARTING
            member.restarts += 1
            logger.warning("restarting SGLang server %s (restart %d/%d)", member.url, member.restarts,
                           self.config.max_restarts)
            try:
                member.starting = asyncio.ensure_future(asyncio.to_thread(member.server.restart))
                await asyncio.shield(member.starting)
                if self._on_restart is not None:
                    self._on_restart(member.server)
                await self._rejoin(member)
                return
            except EngineError as exc:
                logger.error("restart of %s failed: %s", member.url, exc)
                backoff = Retry(base_delay_s=self.config.restart_backoff_s, max_delay_s=60.0)  # no jitter
                await asyncio.sleep(backoff.delay_s(member.restarts))
        member.state = MemberState.FAILED
        logger.error("SGLang server %s stays out: %d restarts failed", member.url, member.restarts)
        await self._notify()

    async def _rejoin(self, member: _Member) -> None:
        """Bring ``member`` to the current weights (and pause state), then put it back in rotation."""
        async with self._lock:
            if member.state is MemberState.UP:
                return
            target = self._target
            if self._paused is None and member.client.paused is not None:
                await member.client.resume()  # a fresh process is not paused; forget the old state
            if target is not None and (failure := (await target.load([member.client]))[0]) is not None:
                raise failure if isinstance(failure, EngineError) else EngineError(str(failure))
            if self._paused is not None:
                await member.client.pause(self._paused)
            member.state, member.failures, member.unhealthy_since = MemberState.UP, 0, None
            member.last_progress, member.cpu_s = time.monotonic(), None
            logger.info("SGLang server %s is back (weight version %s)", member.url,
                        target.version if target is not None else "as started")
        await self._notify()

    async def _rejoin_logged(self, member: _Member) -> None:
        try:
            await self._rejoin(member)
        except EngineError as exc:
            logger.error("SGLang server %s answers again but could not be brought to the current weights: %s",
                         member.url, exc)

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def aclose(self) -> None:
        """Stop the health loop and recoveries, close the clients, stop the servers this pool started."""
        self._closing = True  # from here on a server going away is expected: never restart it
        for task in [*self._tasks, *([self._health] if self._health else [])]:
            task.cancel()
        await asyncio.gather(*self._tasks, *([self._health] if self._health else []), return_exceptions=True)
        self._health = None
        if self._router is not None:
            await self._router.aclose()
        for m in self._members:
            await m.client.aclose()
            if m.server is not None:
                await asyncio.to_thread(m.server.stop)
                if m.starting is not None and not m.starting.done():  # a restart thread may start it again
                    await asyncio.gather(m.starting, return_exceptions=True)
                    await asyncio.to_thread(m.server.stop)

    async def __aenter__(self) -> Self:
        return self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
