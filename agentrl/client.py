"""A small client of the evaluation REST API (``agentrl serve``), async and sync.

    async with AsyncEvalClient("http://127.0.0.1:8000", token=...) as c:
        eval_id = await c.submit(spec)                 # an agentrl.eval.EvalSpec or a plain dict
        state = await c.wait(eval_id)                  # until succeeded | failed | cancelled
        async for record in c.iter_results(eval_id): ...

    with EvalClient("http://127.0.0.1:8000") as c:     # the same, blocking
        print(c.wait(c.submit(spec))["metrics"])

        for event in c.events(eval_id): ...            # server-sent events until the task ends (resumes itself)
        c.compare(a, b, metric="pass@1")                # do two runs differ? (paired over items)
        c.datasets(); c.dataset("gsm8k")                # named datasets, versions, sha256
        for state in c.iter_evals(status="succeeded", labels={"team": "a"}): ...   # cursor-paged listing
        c.purge(eval_id); c.status()                    # delete a task and its results; the service (admin)

Each method is one operation of the server's OpenAPI schema (:data:`OPERATIONS`; a test checks the two agree).

Reads (GET) are retried while the server restarts (connection refused, a dropped reply, 502/503/504:
``retries`` times, the delay doubling from 0.25 s to 5 s, by :class:`agentrl.retry.Retry`). A submission is
retried the same way with one ``Idempotency-Key`` (a new UUID per ``submit`` unless given): a retry after a lost
reply gets the task the first attempt made (200), never a second one. A cancel is retried too (cancelling twice is
fine); a purge is not (a lost reply is then a 404). Errors: :class:`ApiError` with the HTTP status and the
server's detail (status 0: unreachable).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, Self

import httpx

from agentrl.errors import AgentRLError
from agentrl.retry import Retry

TERMINAL = frozenset({"succeeded", "failed", "cancelled"})
#: operationId of the server's OpenAPI schema -> the client method calling it (the same name on both clients)
OPERATIONS = {"createEval": "submit", "getEval": "get", "listEvals": "list_evals", "cancelEval": "cancel",
              "getEvalResults": "results", "getEvalEvents": "events", "compareEvals": "compare",
              "listDatasets": "datasets", "getDataset": "dataset", "listEnvironments": "environments",
              "getHealth": "health", "getStatus": "status"}
_RETRY_STATUS = frozenset({0, 502, 503, 504})  # 0: the server could not be reached


class ApiError(AgentRLError):
    """The server answered an error (``status`` >= 400), or could not be reached (``status`` 0)."""

    def __init__(self, status: int, detail: Any, *, method: str = "", url: str = "") -> None:
        super().__init__(f"{method} {url} -> {status}: {detail}")
        self.status = status
        self.detail = detail


def _body(spec: Any) -> Any:
    return spec.model_dump(mode="json", exclude_none=True) if hasattr(spec, "model_dump") else dict(spec)


def _parse(resp: httpx.Response) -> Any:
    try:
        data = resp.json()
    except ValueError:
        data = resp.text
    if resp.status_code >= 400:
        detail = data.get("detail", data) if isinstance(data, dict) else data
        raise ApiError(resp.status_code, detail, method=resp.request.method, url=str(resp.request.url))
    return data


def _headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def _unreachable(exc: httpx.TransportError, method: str, path: str) -> ApiError:
    return ApiError(0, f"cannot reach the server: {exc!r}", method=method, url=path)


class _SSE:
    """Server-sent events from lines: ``feed`` returns ``{"event", "data" (parsed JSON), "id"?}`` at each blank
    line that ends an event (comments and pings are skipped)."""

    def __init__(self) -> None:
        self.fields: dict[str, str] = {}

    def feed(self, line: str) -> dict[str, Any] | None:
        if line:
            if not line.startswith(":"):
                key, _, value = line.partition(":")
                value = value.removeprefix(" ")
                self.fields[key] = self.fields[key] + "\n" + value if key == "data" and key in self.fields else value
            return None
        fields, self.fields = self.fields, {}
        if "data" not in fields:
            return None
        event: dict[str, Any] = {"event": fields.get("event", "message"), "data": json.loads(fields["data"])}
        if "id" in fields:
            event["id"] = fields["id"]
        return event


def _stream_retryable(exc: BaseException) -> bool:
    return isinstance(exc, httpx.TransportError) or _retryable(exc)


def _retryable(exc: BaseException) -> bool:
    return isinstance(exc, ApiError) and exc.status in _RETRY_STATUS


def _reads_retry(retries: int) -> Retry:
    return Retry(attempts=retries + 1, base_delay_s=0.25, max_delay_s=5.0, jitter=0.5)


def _submission(spec: Any, idempotency_key: str | None) -> dict[str, Any]:
    key = idempotency_key or uuid.uuid4().hex
    return {"json": _body(spec), "headers": {"Idempotency-Key": key}}


def _list_params(limit: int, after: str | None, status: str | None, environment: str | None,
                 labels: dict[str, str] | None, created_after: float | None,
                 created_before: float | None) -> dict[str, Any]:
    params = {"limit": limit, "after": after, "status": status, "environment": environment,
              "created_after": created_after, "created_before": created_before,
              "label": [f"{k}={v}" for k, v in (labels or {}).items()] or None}
    return {k: v for k, v in params.items() if v is not None}


class AsyncEvalClient:
    """Async client; see the module docstring. ``transport`` is for tests (e.g. ``httpx.ASGITransport``)."""

    def __init__(self, base_url: str, *, token: str | None = None, timeout_s: float = 30.0, retries: int = 5,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.retries = retries
        self._retry = _reads_retry(retries)
        self._http = httpx.AsyncClient(base_url=base_url.rstrip("/"), headers=_headers(token), timeout=timeout_s,
                                       transport=transport)

    async def _request(self, method: str, path: str, **kw: Any) -> Any:
        try:
            return _parse(await self._http.request(method, path, **kw))
        except httpx.TransportError as exc:
            raise _unreachable(exc, method, path) from exc

    async def _get(self, path: str, **params: Any) -> Any:
        return await self._retry.call(lambda: self._request("GET", path, params=params or None),
                                      retry_on=_retryable, what=f"GET {path}")

    async def submit(self, spec: Any, *, idempotency_key: str | None = None) -> str:
        """Queue an evaluation; returns its id. Retried with one Idempotency-Key (a new one unless given)."""
        kw = _submission(spec, idempotency_key)
        out = await self._retry.call(lambda: self._request("POST", "/v1/evals", **kw), retry_on=_retryable,
                                     what="POST /v1/evals")
        return str(out["id"])

    async def get(self, eval_id: str) -> dict[str, Any]:
        return dict(await self._get(f"/v1/evals/{eval_id}"))

    async def results(self, eval_id: str, *, offset: int = 0, limit: int = 100,
                      trajectories: bool = True) -> dict[str, Any]:
        return dict(await self._get(f"/v1/evals/{eval_id}/results", offset=offset, limit=limit,
                                    trajectories=str(trajectories).lower()))

    async def iter_results(self, eval_id: str, *, page_size: int = 100,
                           trajectories: bool = True) -> AsyncIterator[dict[str, Any]]:
        """Every record stored so far, page by page."""
        offset: int | None = 0
        while offset is not None:
            page = await self.results(eval_id, offset=offset, limit=page_size, trajectories=trajectories)
            for record in page["records"]:
                yield record
            offset = page["next_offset"]

    async def list_evals(self, *, limit: int = 50, status: str | None = None) -> list[dict[str, Any]]:
        """Recent tasks, newest first (without their specs)."""
        return list((await self.list_page(limit=limit, status=status))["evals"])

    async def list_page(self, *, limit: int = 50, after: str | None = None, status: str | None = None,
                        environment: str | None = None, labels: dict[str, str] | None = None,
                        created_after: float | None = None, created_before: float | None = None) -> dict[str, Any]:
        """One page of tasks (``evals``, ``has_more``, ``next_cursor``: the ``after`` of the next page)."""
        return dict(await self._get("/v1/evals", **_list_params(limit, after, status, environment, labels,
                                                                 created_after, created_before)))

    async def iter_evals(self, *, page_size: int = 100, **filters: Any) -> AsyncIterator[dict[str, Any]]:
        """Every task matching ``filters`` (those of :meth:`list_page`), newest first, page by page."""
        after: str | None = None
        while True:
            page = await self.list_page(limit=page_size, after=after, **filters)
            for state in page["evals"]:
                yield state
            after = page["next_cursor"]
            if after is None:
                return

    async def cancel(self, eval_id: str) -> dict[str, Any]:
        return dict(await self._retry.call(lambda: self._request("DELETE", f"/v1/evals/{eval_id}"),
                                           retry_on=_retryable, what=f"DELETE /v1/evals/{eval_id}"))

    async def purge(self, eval_id: str) -> None:
        """Delete the task and all its results (a running one is stopped)."""
        await self._request("DELETE", f"/v1/evals/{eval_id}", params={"purge": "true"})

    async def wait(self, eval_id: str, *, poll_s: float = 1.0, timeout_s: float | None = None,
                   on_progress: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
        """Poll until the task is succeeded, failed or cancelled; returns its final state."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            state = await self.get(eval_id)
            if on_progress is not None:
                on_progress(state)
            if state["status"] in TERMINAL:
                return state
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"evaluation {eval_id} is still {state['status']} after {timeout_s}s")
            await asyncio.sleep(poll_s)

    async def events(self, eval_id: str, *, last_event_id: str | None = None) -> AsyncIterator[dict[str, Any]]:
        """The task's events (``{"event", "data", "id"}``: status, progress, metrics, end) until it ends; after
        ``last_event_id`` if given. A dropped connection is resumed where it broke (``retries`` times)."""
        last = last_event_id
        failures = 0
        while True:
            headers = {"Last-Event-ID": last} if last else {}
            parser = _SSE()
            try:
                async with self._http.stream("GET", f"/v1/evals/{eval_id}/events", headers=headers) as resp:
                    if resp.status_code >= 400:
                        await resp.aread()
                        _parse(resp)
                    async for line in resp.aiter_lines():
                        event = parser.feed(line)
                        if event is None:
                            continue
                        failures = 0
                        last = event.get("id", last)
                        yield event
                        if event["event"] == "end":
                            return
                return  # the server ended the stream
            except (httpx.TransportError, ApiError) as exc:
                failures += 1
                if not _stream_retryable(exc) or failures > self.retries:
                    raise exc if isinstance(exc, ApiError) else _unreachable(exc, "GET", "events") from exc
                await asyncio.sleep(self._retry.delay_s(failures))

    async def compare(self, a: str, b: str, *, metric: str = "accuracy") -> dict[str, Any]:
        """Whether run ``b`` differs from run ``a`` on ``metric`` (paired over items): difference, interval, p."""
        return dict(await self._get("/v1/evals/compare", a=a, b=b, metric=metric))

    async def datasets(self) -> list[dict[str, Any]]:
        """Named datasets of the server, with versions and sha256."""
        return list((await self._get("/v1/datasets"))["datasets"])

    async def dataset(self, name: str) -> dict[str, Any]:
        return dict(await self._get(f"/v1/datasets/{name}"))

    async def environments(self) -> list[dict[str, Any]]:
        return list((await self._get("/v1/environments"))["environments"])

    async def health(self) -> dict[str, Any]:
        return dict(await self._get("/healthz"))

    async def status(self) -> dict[str, Any]:
        """The service's queue, tasks per status, running tasks, bytes stored (admin scope)."""
        return dict(await self._get("/v1/status"))

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class EvalClient:
    """Blocking client with the same methods as :class:`AsyncEvalClient`."""

    def __init__(self, base_url: str, *, token: str | None = None, timeout_s: float = 30.0, retries: int = 5,
                 transport: httpx.BaseTransport | None = None) -> None:
        self.retries = retries
        self._retry = _reads_retry(retries)
        self._http = httpx.Client(base_url=base_url.rstrip("/"), headers=_headers(token), timeout=timeout_s,
                                  transport=transport)

    def _request(self, method: str, path: str, **kw: Any) -> Any:
        try:
            return _parse(self._http.request(method, path, **kw))
        except httpx.TransportError as exc:
            raise _unreachable(exc, method, path) from exc

    def _get(self, path: str, **params: Any) -> Any:
        return self._retry.call_sync(lambda: self._request("GET", path, params=params or None),
                                     retry_on=_retryable, what=f"GET {path}")

    def submit(self, spec: Any, *, idempotency_key: str | None = None) -> str:
        kw = _submission(spec, idempotency_key)
        return str(self._retry.call_sync(lambda: self._request("POST", "/v1/evals", **kw), retry_on=_retryable,
                                         what="POST /v1/evals")["id"])

    def get(self, eval_id: str) -> dict[str, Any]:
        return dict(self._get(f"/v1/evals/{eval_id}"))

    def results(self, eval_id: str, *, offset: int = 0, limit: int = 100, trajectories: bool = True) -> dict[str, Any]:
        return dict(self._get(f"/v1/evals/{eval_id}/results", offset=offset, limit=limit,
                              trajectories=str(trajectories).lower()))

    def iter_results(self, eval_id: str, *, page_size: int = 100, trajectories: bool = True) -> Iterator[dict[str, Any]]:
        offset: int | None = 0
        while offset is not None:
            page = self.results(eval_id, offset=offset, limit=page_size, trajectories=trajectories)
            yield from page["records"]
            offset = page["next_offset"]

    def list_evals(self, *, limit: int = 50, status: str | None = None) -> list[dict[str, Any]]:
        return list(self.list_page(limit=limit, status=status)["evals"])

    def list_page(self, *, limit: int = 50, after: str | None = None, status: str | None = None,
                  environment: str | None = None, labels: dict[str, str] | None = None,
                  created_after: float | None = None, created_before: float | None = None) -> dict[str, Any]:
        return dict(self._get("/v1/evals", **_list_params(limit, after, status, environment, labels,
                                                           created_after, created_before)))

    def iter_evals(self, *, page_size: int = 100, **filters: Any) -> Iterator[dict[str, Any]]:
        after: str | None = None
        while True:
            page = self.list_page(limit=page_size, after=after, **filters)
            yield from page["evals"]
            after = page["next_cursor"]
            if after is None:
                return

    def cancel(self, eval_id: str) -> dict[str, Any]:
        return dict(self._retry.call_sync(lambda: self._request("DELETE", f"/v1/evals/{eval_id}"),
                                          retry_on=_retryable, what=f"DELETE /v1/evals/{eval_id}"))

    def purge(self, eval_id: str) -> None:
        self._request("DELETE", f"/v1/evals/{eval_id}", params={"purge": "true"})

    def wait(self, eval_id: str, *, poll_s: float = 1.0, timeout_s: float | None = None,
             on_progress: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            state = self.get(eval_id)
            if on_progress is not None:
                on_progress(state)
            if state["status"] in TERMINAL:
                return state
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"evaluation {eval_id} is still {state['status']} after {timeout_s}s")
            time.sleep(poll_s)

    def events(self, eval_id: str, *, last_event_id: str | None = None) -> Iterator[dict[str, Any]]:
        """See :meth:`AsyncEvalClient.events`."""
        last = last_event_id
        failures = 0
        while True:
            headers = {"Last-Event-ID": last} if last else {}
            parser = _SSE()
            try:
                with self._http.stream("GET", f"/v1/evals/{eval_id}/events", headers=headers) as resp:
                    if resp.status_code >= 400:
                        resp.read()
                        _parse(resp)
                    for line in resp.iter_lines():
                        event = parser.feed(line)
                        if event is None:
                            continue
                        failures = 0
                        last = event.get("id", last)
                        yield event
                        if event["event"] == "end":
                            return
                return
            except (httpx.TransportError, ApiError) as exc:
                failures += 1
                if not _stream_retryable(exc) or failures > self.retries:
                    raise exc if isinstance(exc, ApiError) else _unreachable(exc, "GET", "events") from exc
                time.sleep(self._retry.delay_s(failures))

    def compare(self, a: str, b: str, *, metric: str = "accuracy") -> dict[str, Any]:
        return dict(self._get("/v1/evals/compare", a=a, b=b, metric=metric))

    def datasets(self) -> list[dict[str, Any]]:
        return list(self._get("/v1/datasets")["datasets"])

    def dataset(self, name: str) -> dict[str, Any]:
        return dict(self._get(f"/v1/datasets/{name}"))

    def environments(self) -> list[dict[str, Any]]:
        return list(self._get("/v1/environments")["environments"])

    def health(self) -> dict[str, Any]:
        return dict(self._get("/healthz"))

    def status(self) -> dict[str, Any]:
        return dict(self._get("/v1/status"))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

