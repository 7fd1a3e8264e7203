"""``RemoteSandbox``: the Sandbox protocol over HTTP, talking to ``agentrl sandbox serve`` (aiohttp).

Retries (``retries`` times, exponential backoff from ``backoff_s``; or an injected :class:`agentrl.retry.Retry`)
only what is safe and retryable: a connection that could not be made, and answers 429/502/503/504 (the server
did not run the request). A run is also retried after a dropped connection (a run has no lasting effect); a
session cell never is (it may have changed the session's state). Every attempt has a deadline: the run's time
limit plus ``timeout_s``; an attempt past it is not retried (the server may still be running it). Failures
of the server or the network come back as ``SandboxError`` results (``run``) or raise ``SandboxError``
(``session``); a request the server rejects as invalid (400/422) raises ``ConfigError``. When the attempts ran out on
failures that left no effect (no connection, 429/502/503/504), the error is :class:`ServerUnavailable`: a
:class:`agentrl.sandbox.fleet.SandboxFleet` sends such a run to another server. ``load()`` reads the server's
:class:`ServerLoad` from ``/v1/ping`` (one attempt: the fleet's health loop is the retry).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Self

import aiohttp

from agentrl.errors import ConfigError, SandboxError
from agentrl.retry import Retry
from agentrl.sandbox._wire import sandbox_error
from agentrl.sandbox.base import Limits, RunRequest, RunResult
from agentrl.sandbox.schemas import LimitsModel, ResultModel, RunModel, ServerLoad

log = logging.getLogger(__name__)

RETRY_STATUS = frozenset({429, 502, 503, 504})


class _Retryable(Exception):
    """The call did not reach the server, or the server did not run it: safe to send again. ``busy``: the server
    answered 429 (it is up, but full)."""

    def __init__(self, message: str, *, busy: bool = False) -> None:
        super().__init__(message)
        self.busy = busy


class ServerUnavailable(SandboxError):
    """The sandbox server could not be reached or did not run the call, after every attempt: nothing ran, so it is
    safe to send elsewhere. ``busy``: the server answered, but was full (429), so it is up."""

    def __init__(self, message: str, *, busy: bool = False) -> None:
        super().__init__(message)
        self.busy = busy


class RemoteSandbox:
    def __init__(self, url: str, *, token: str | None = None, timeout_s: float = 30.0, retries: int = 3,
                 backoff_s: float = 0.2, retry: Retry | None = None, max_connections: int = 64) -> None:
        self.url = url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._timeout_s = timeout_s
        # retries/backoff_s: the delay doubles from backoff_s with no cap below the last one
        self._retry = retry or Retry(attempts=retries + 1, base_delay_s=backoff_s,
                                     max_delay_s=backoff_s * 2 ** max(0, retries - 1))
        self._max_connections = max_connections
        self._http: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._http is None or self._http.closed:
            # idle connections closed at 4 s, before uvicorn's 5 s: else a reused one can break under a call
            self._http = aiohttp.ClientSession(headers=self._headers,
                                               connector=aiohttp.TCPConnector(limit=self._max_connections,
                                                                              keepalive_timeout=4.0))
        return self._http

    async def _call(self, method: str, path: str, body: dict[str, Any] | None, deadline_s: float, *,
                    idempotent: bool) -> Any:
        """One JSON call with retries; raises SandboxError (gave up), ConfigError (rejected as invalid)."""

        async def attempt() -> Any:
            try:
                async with asyncio.timeout(deadline_s):
                    return await self._once(method, path, body)
            except aiohttp.ClientConnectorError as exc:  # never reached the server
                raise _Retryable(f"cannot connect to {self.url}: {exc}") from None
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
                broke = f"connection to {self.url} broke: {exc!r}"
                raise (_Retryable(broke) if idempotent else SandboxError(broke)) from None
            except TimeoutError:
                raise SandboxError(f"{method} {self.url}{path} did not answer within {deadline_s:.0f}s") from None
            except aiohttp.ClientError as exc:
                raise SandboxError(f"{method} {self.url}{path} failed: {exc!r}") from None

        try:
            return await self._retry.call(attempt, retry_on=_Retryable, what=f"sandbox call {method} {path}")
        except _Retryable as exc:
            raise ServerUnavailable(f"{method} {self.url}{path} failed after {self._retry.attempts} attempts: {exc}",
                                    busy=exc.busy) from None

    async def _once(self, method: str, path: str, body: dict[str, Any] | None) -> Any:
        async with self._client().request(method, self.url + path, json=body) as resp:
            if resp.status in RETRY_STATUS:
                raise _Retryable(f"the server answered {resp.status}: {(await resp.text())[:300]}",
                                 busy=resp.status == 429)
            if resp.status in (400, 404, 422):
                raise ConfigError(f"the sandbox server rejected {method} {path} ({resp.status}): "
                                  f"{(await resp.text())[:500]}")
            if resp.status >= 400:
                raise SandboxError(f"the sandbox server answered {resp.status} to {method} {path}: "
                                   f"{(await resp.text())[:500]}")
            return await resp.json()

    async def run(self, request: RunRequest) -> RunResult:
        try:
            return await self.run_or_raise(request)
        except SandboxError as exc:
            return sandbox_error(str(exc))

    async def run_or_raise(self, request: RunRequest) -> RunResult:
        """``run``, but the sandbox's failures to answer are raised: :class:`ServerUnavailable` (nothing ran: safe
        to send elsewhere) or :class:`SandboxError` (e.g. no answer within the deadline: it may have run)."""
        body = RunModel.of(request).model_dump(mode="json")
        data = await self._call("POST", "/v1/run", body,
                                request.run_time_s + request.limits.compile_time_s + self._timeout_s, idempotent=True)
        return ResultModel.model_validate(data).to_result()

    async def session(self, language: str = "python", limits: Limits | None = None) -> RemoteSession:
        body = {"language": language, "limits": LimitsModel.of(limits or Limits()).model_dump()}
        data = await self._call("POST", "/v1/sessions", body, self._timeout_s + 30, idempotent=False)
        return RemoteSession(self, str(data["session_id"]), limits or Limits())

    async def ping(self) -> bool:
        try:
            await self.load()
        except ServerUnavailable:
            return False
        return True

    async def load(self, timeout_s: float | None = None) -> ServerLoad | None:
        """The server's load as its ``/v1/ping`` reports it (None from a server that answers ``pong`` without it);
        raises :class:`ServerUnavailable` unless it answers ``pong`` within ``timeout_s`` (default ``timeout_s``
        of the client). One attempt, no retry."""
        try:
            async with asyncio.timeout(timeout_s or self._timeout_s):
                async with self._client().get(self.url + "/v1/ping") as resp:
                    body = await resp.json() if resp.status == 200 else None
                    if body != "pong":
                        raise ServerUnavailable(f"GET {self.url}/v1/ping answered {resp.status}, not pong")
                    return ServerLoad.from_headers(resp.headers)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise ServerUnavailable(f"GET {self.url}/v1/ping failed: {exc!r}") from None

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class RemoteSession:
    def __init__(self, remote: RemoteSandbox, session_id: str, limits: Limits) -> None:
        self._remote, self.session_id, self.limits = remote, session_id, limits
        self.closed = False

    async def run(self, code: str, *, time_s: float | None = None) -> RunResult:
        if self.closed:
            return sandbox_error("the session is closed; open a new one")
        t = self.limits.time_s if time_s is None else time_s
        try:
            data = await self._remote._call("POST", f"/v1/sessions/{self.session_id}/run",
                                            {"code": code, "time_s": time_s}, t + self._remote._timeout_s,
                                            idempotent=False)
        except SandboxError as exc:
            return sandbox_error(str(exc))
        except ConfigError as exc:  # 404: the server closed it (idle, or restarted)
            self.closed = True
            return sandbox_error(str(exc))
        return ResultModel.model_validate(data).to_result()

    async def aclose(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            await self._remote._call("DELETE", f"/v1/sessions/{self.session_id}", None, self._remote._timeout_s,
                                     idempotent=True)
        except (SandboxError, ConfigError) as exc:
            log.debug("closing remote session %s: %s", self.session_id, exc)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
