"""The sandbox server (FastAPI): SandboxFusion-compatible ``POST /run_code`` and ``POST /run_jupyter``, agentrl's
own lossless ``POST /v1/run`` and session endpoints, ``GET /v1/ping``, ``GET /metrics``.

- Admission: at most ``max_concurrency`` requests run at once, ``max_queue`` more wait; past that the answer is
  ``429`` with ``Retry-After`` (the client backs off), and ``503`` while the server shuts down. At most
  ``max_sessions`` sessions are open (``429`` past that).
- Load: ``/v1/ping`` answers ``"pong"`` (SandboxFusion's body) with the requests running, queued, the slots and
  the open sessions in ``X-Sandbox-*`` headers (:class:`agentrl.sandbox.schemas.ServerLoad`), which a fleet's
  client steers by; ``/metrics`` has the same as Prometheus gauges (``agentrl_sandbox_running`` ...).
- Output: each stream is cut at ``max_output_bytes`` (or the request's smaller limit) and ends with a marker.
- Failures of the sandbox itself are answered ``200`` with status ``SandboxError`` (as SandboxFusion does);
  requests the server cannot accept are ``4xx``.
- Auth: with ``token`` set, every route but ``/v1/ping`` (``/metrics`` too) needs ``Authorization: Bearer <token>``; a body over
  ``max_body_bytes`` is ``413`` (both checks are :mod:`agentrl._http`'s, shared with the eval API).
The server binds 127.0.0.1 unless told otherwise (see ``agentrl sandbox serve``).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import dataclasses
import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Response

from agentrl._http import BodyLimit, bearer_auth
from agentrl.errors import ConfigError, SandboxError
from agentrl.sandbox._wire import sandbox_error
from agentrl.sandbox.base import Limits, RequestStatus, RunRequest, RunStatus, Sandbox, Session
from agentrl.sandbox.schemas import (
    CellModel,
    CellRunResult,
    CommandRunResult,
    CommandRunStatus,
    ResultModel,
    RunCodeRequest,
    RunCodeResponse,
    RunJupyterRequest,
    RunJupyterResponse,
    RunModel,
    ServerLoad,
    SessionOpen,
    SessionOpened,
    compile_to_fusion,
    to_fusion,
)

log = logging.getLogger(__name__)


class Gate:
    """At most ``concurrency`` holders, at most ``queue`` waiters; past that: 429."""

    def __init__(self, concurrency: int, queue: int) -> None:
        self._sem, self._queue, self.waiting = asyncio.Semaphore(concurrency), queue, 0
        self.capacity, self.running = concurrency, 0
        self.closing = False

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        if self.closing:
            raise HTTPException(503, "the sandbox server is shutting down", headers={"Retry-After": "5"})
        if self._sem.locked() and self.waiting >= self._queue:
            raise HTTPException(429, f"the sandbox server is full ({self.waiting} requests queued); retry later",
                                headers={"Retry-After": "1"})
        self.waiting += 1
        try:
            await self._sem.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        try:
            yield
        finally:
            self.running -= 1
            self._sem.release()


def create_app(sandbox: Sandbox, *, max_concurrency: int = 8, max_queue: int = 64, max_sessions: int = 64,
               token: str | None = None, max_output_bytes: int = 64 * 1024, max_body_bytes: int = 32 << 20,
               default_limits: Limits | None = None, close_sandbox: bool = False) -> FastAPI:
    """A FastAPI app serving ``sandbox``; with ``close_sandbox`` the app closes it when it shuts down."""
    gate = Gate(max_concurrency, max_queue)
    defaults = default_limits or Limits()
    sessions: dict[str, Session] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        gate.closing = True
        for sid in list(sessions):
            await _close(sessions.pop(sid))
        if close_sandbox:
            await sandbox.aclose()

    app = FastAPI(title="agentrl sandbox", lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)  # type: ignore[arg-type]
    auth = bearer_auth(token)

    def capped(limits: Limits) -> Limits:
        return dataclasses.replace(limits, output_bytes=min(limits.output_bytes, max_output_bytes))

    async def run(request: RunRequest) -> Any:
        try:
            return await sandbox.run(request)
        except ConfigError as exc:
            raise HTTPException(400, str(exc)) from None
        except SandboxError as exc:
            return sandbox_error(str(exc))

    def load() -> ServerLoad:
        return ServerLoad(gate.running, gate.waiting, gate.capacity, len(sessions))

    @app.get("/v1/ping")
    async def ping(response: Response) -> str:
        response.headers.update(load().headers())
        return "pong"

    metrics = _metrics(load)

    @app.get("/metrics", dependencies=[Depends(auth)])
    async def prometheus() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(metrics), media_type=CONTENT_TYPE_LATEST)

    @app.post("/run_code", response_model=RunCodeResponse, dependencies=[Depends(auth)])
    async def run_code(req: RunCodeRequest) -> RunCodeResponse:
        limits = capped(dataclasses.replace(
            defaults, time_s=req.run_timeout, compile_time_s=req.compile_timeout,
            memory_mb=req.memory_limit_MB if req.memory_limit_MB > 0 else defaults.memory_mb))
        files = _decode_files({k: v for k, v in req.files.items() if v is not None})
        request = RunRequest(code=req.code, language=req.language, stdin=req.stdin or "", files=files,
                             fetch_files=tuple(req.fetch_files), limits=limits)
        async with gate.slot():
            result = await run(request)
        return RunCodeResponse(status=result.status, message=result.message, run_result=to_fusion(result),
                               compile_result=compile_to_fusion(result.compile),
                               files={k: base64.b64encode(v).decode("ascii") for k, v in result.files.items()})

    @app.post("/v1/run", response_model=ResultModel, dependencies=[Depends(auth)])
    async def run_native(req: RunModel) -> ResultModel:
        try:
            request = req.to_request()
        except (binascii.Error, ValueError) as exc:
            raise HTTPException(400, f"files must be base64: {exc}") from None
        request = dataclasses.replace(request, limits=capped(request.limits))
        async with gate.slot():
            return ResultModel.of(await run(request))

    @app.post("/run_jupyter", response_model=RunJupyterResponse, dependencies=[Depends(auth)])
    async def run_jupyter(req: RunJupyterRequest) -> RunJupyterResponse:
        async with gate.slot():
            return await _jupyter(sandbox, req, capped(defaults))

    @app.post("/v1/sessions", response_model=SessionOpened, dependencies=[Depends(auth)])
    async def open_session(req: SessionOpen) -> SessionOpened:
        for sid in [s for s, sess in sessions.items() if getattr(sess, "closed", False)]:
            sessions.pop(sid)  # expired on the backend (idle)
        if len(sessions) >= max_sessions:
            raise HTTPException(429, f"{max_sessions} sessions are open; close some first",
                                headers={"Retry-After": "1"})
        async with gate.slot():
            try:
                sess = await sandbox.session(req.language, capped(req.limits.to_limits()))
            except ConfigError as exc:
                raise HTTPException(400, str(exc)) from None
            except SandboxError as exc:
                raise HTTPException(503, f"could not open a session: {exc}", headers={"Retry-After": "1"}) from None
        sid = uuid.uuid4().hex
        sessions[sid] = sess
        return SessionOpened(session_id=sid)

    @app.post("/v1/sessions/{sid}/run", response_model=ResultModel, dependencies=[Depends(auth)])
    async def run_cell(sid: str, req: CellModel) -> ResultModel:
        sess = sessions.get(sid)
        if sess is None:
            raise HTTPException(404, f"no open session {sid!r} (closed, expired, or never opened)")
        async with gate.slot():
            try:
                return ResultModel.of(await sess.run(req.code, time_s=req.time_s))
            except SandboxError as exc:
                return ResultModel.of(sandbox_error(str(exc)))

    @app.delete("/v1/sessions/{sid}", dependencies=[Depends(auth)])
    async def close_session(sid: str) -> dict[str, bool]:
        sess = sessions.pop(sid, None)
        if sess is not None:
            await _close(sess)
        return {"closed": sess is not None}

    return app


def _metrics(load: Callable[[], ServerLoad]) -> Any:
    """A Prometheus registry of this app's own (no process-wide state) whose gauges read ``load()`` when scraped."""
    from prometheus_client import CollectorRegistry, Gauge

    registry = CollectorRegistry()
    for name, doc in (("running", "requests holding a slot"), ("queued", "requests waiting for a slot"),
                      ("capacity", "slots (max_concurrency)"), ("sessions", "open sessions")):
        gauge = Gauge(f"agentrl_sandbox_{name}", f"sandbox server: {doc}", registry=registry)
        gauge.set_function(_reader(load, name))
    return registry


def _reader(load: Callable[[], ServerLoad], field: str) -> Callable[[], float]:
    return lambda: float(getattr(load(), field))


async def _close(sess: Session) -> None:
    try:
        await sess.aclose()
    except Exception as exc:  # closing is best effort: the backend reaps what is left
        log.warning("closing a sandbox session failed: %r", exc)


def _decode_files(files: dict[str, str]) -> dict[str, bytes]:
    try:
        return {k: base64.b64decode(v, validate=True) for k, v in files.items()}
    except (binascii.Error, ValueError) as exc:
        raise HTTPException(400, f"files must be base64: {exc}") from None


def _cell(result: Any) -> CellRunResult:
    display = [{"text/plain": d} for d in result.display]
    error: list[dict[str, Any]] = []
    if result.run_status is RunStatus.ERROR:
        ename, _, evalue = result.message.partition(": ")
        error.append({"ename": ename, "evalue": evalue, "traceback": result.stderr.splitlines()})
    return CellRunResult(stdout=result.stdout, stderr=result.stderr, display=display, error=error)


_WRITE = ("import base64 as _b, os as _o\nfor _p, _d in {files!r}.items():\n"
          "    _f = _o.path.join('/tmp', _p)\n    _o.makedirs(_o.path.dirname(_f), exist_ok=True)\n"
          "    with open(_f, 'wb') as _h: _h.write(_b.b64decode(_d))\ndel _b, _o, _p, _d, _f, _h\n")
_FETCH = ("import base64 as _b, json as _j, os as _o\n_r = {{}}\nfor _p in {names!r}:\n    try:\n"
          "        with open(_o.path.join('/tmp', _p), 'rb') as _h: _r[_p] = _b.b64encode(_h.read()).decode()\n"
          "    except OSError: pass\nprint(_j.dumps(_r))\ndel _b, _j, _o, _r\n")


async def _jupyter(sandbox: Sandbox, req: RunJupyterRequest, limits: Limits) -> RunJupyterResponse:
    """The cells in one session: SandboxFusion's semantics (a cell that raises is reported in its ``error``;
    the request fails only on a timeout), files written before and fetched after by hidden cells."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + req.total_timeout

    def left(cap: float = 0.0) -> float:
        remaining = deadline - loop.time()
        return min(cap, remaining) if cap > 0 else remaining

    try:
        sess = await sandbox.session("python", Limits(time_s=left(req.cell_timeout), memory_mb=limits.memory_mb,
                                                      pids=limits.pids, file_size_mb=limits.file_size_mb,
                                                      output_bytes=limits.output_bytes))
    except SandboxError as exc:
        return RunJupyterResponse(status=RequestStatus.SANDBOX_ERROR, message=str(exc))
    cells: list[CellRunResult] = []
    try:
        if req.files:
            r = await sess.run(_WRITE.format(files=req.files), time_s=max(1.0, left()))
            if r.run_status is not RunStatus.FINISHED:
                return RunJupyterResponse(status=RequestStatus.SANDBOX_ERROR, message=f"writing files: {r.message}")
        for i, code in enumerate(req.cells):
            if left() <= 0:
                return _timed_out(cells, f"total_timeout of {req.total_timeout:g}s reached before cell {i}")
            r = await sess.run(code, time_s=left(req.cell_timeout))
            if r.is_sandbox_error:
                return RunJupyterResponse(status=RequestStatus.SANDBOX_ERROR, message=r.message, cells=cells)
            cells.append(_cell(r))
            if r.run_status is RunStatus.TIME_LIMIT_EXCEEDED:
                return _timed_out(cells, f"cell {i} ran past its time limit")
        files: dict[str, str] = {}
        if req.fetch_files:
            r = await sess.run(_FETCH.format(names=list(req.fetch_files)), time_s=max(1.0, left()))
            lines = r.stdout.strip().splitlines()
            files = json.loads(lines[-1]) if r.run_status is RunStatus.FINISHED and lines else {}
        return RunJupyterResponse(status=RequestStatus.SUCCESS, message="", cells=cells, files=files,
                                  driver=CommandRunResult(status=CommandRunStatus.Finished, return_code=0))
    finally:
        await _close(sess)


def _timed_out(cells: list[CellRunResult], why: str) -> RunJupyterResponse:
    return RunJupyterResponse(status=RequestStatus.FAILED, message=why, cells=cells,
                              driver=CommandRunResult(status=CommandRunStatus.TimeLimitExceeded))
