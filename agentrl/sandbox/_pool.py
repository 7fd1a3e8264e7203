"""A warm pool: up to ``size`` ready sandboxes made in the background, so a run does not wait for a start.

Background makes that fail back off (``BACKOFF``: 1 s doubling to 30 s, reset by a success) instead of spinning;
``get`` then makes one itself and its error reaches the caller. Every background task is tracked and awaited
by ``aclose``.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Generic, TypeVar

from agentrl.retry import Retry

log = logging.getLogger(__name__)
T = TypeVar("T")
BACKOFF = Retry(base_delay_s=1.0, max_delay_s=30.0)  # the pause after the k-th background make failed in a row


class WarmPool(Generic[T]):
    def __init__(self, make: Callable[[], Awaitable[T]], discard: Callable[[T], Coroutine[Any, Any, None]],
                 size: int, *,
                 alive: Callable[[T], bool] = lambda _: True, name: str = "sandbox") -> None:
        self._make, self._discard, self._alive = make, discard, alive
        self.size, self.name = size, name
        self._ready: collections.deque[T] = collections.deque()
        self._making = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._backoff_until = 0.0
        self._failures = 0  # background makes failed in a row
        self._closed = False

    @property
    def ready(self) -> int:
        return len(self._ready)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run ``coro`` in the background, tracked until it ends (errors are logged)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("%s pool: background task failed: %r", self.name, task.exception())

    def fill(self) -> None:
        """Start background makes up to ``size`` (unless closed or backing off)."""
        loop = asyncio.get_running_loop()
        while not self._closed and loop.time() >= self._backoff_until and len(self._ready) + self._making < self.size:
            self._making += 1
            self.spawn(self._make_one())

    async def _make_one(self) -> None:
        try:
            item = await self._make()
        except Exception as exc:
            self._failures += 1
            delay = BACKOFF.delay_s(self._failures)
            self._backoff_until = asyncio.get_running_loop().time() + delay
            log.warning("%s pool: could not start a warm sandbox (retrying in %.0fs): %s", self.name, delay, exc)
            return
        finally:
            self._making -= 1
        self._failures = 0
        self.put(item)

    async def get(self) -> T:
        """A ready item, or a new one made now (its errors propagate)."""
        while self._ready:
            item = self._ready.popleft()
            if self._alive(item):
                self.fill()
                return item
            self.spawn(self._discard(item))
        item = await self._make()
        self.fill()
        return item

    def put(self, item: T) -> None:
        """Give back a clean item (or a new one); discarded if the pool is full or closed."""
        if self._closed or len(self._ready) >= self.size or not self._alive(item):
            self.spawn(self._discard(item))
        else:
            self._ready.append(item)

    def discard(self, item: T) -> None:
        self.spawn(self._discard(item))
        if not self._closed:
            self.fill()

    async def aclose(self) -> None:
        """Discard every ready item and wait for all background work (makes are let finish, then discarded)."""
        self._closed = True
        while self._ready:
            self.spawn(self._discard(self._ready.popleft()))
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
