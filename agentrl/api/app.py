"""The evaluation REST API (FastAPI): submit, track, cancel and page through evaluation tasks.

    POST   /v1/evals                 202 {id, status, progress, links}; body: agentrl.eval.EvalSpec
    GET    /v1/evals                 recent tasks (newest first; ?status=&limit=)
    GET    /v1/evals/{id}            status, progress {done, total}, metrics (partial while running)
    GET    /v1/evals/{id}/results    per-sample records with trajectories, paged (?offset=&limit=&trajectories=)
    DELETE /v1/evals/{id}            cancel (409 if it already finished)
    GET    /v1/environments          registered environments and their tools
    GET    /healthz                  liveness + Redis + what this process runs

Client mistakes are 4xx, never 5xx: 401 without the bearer token (when one is set), 404 for an unknown task or
environment (naming the known environments), 413 past ``max_body_bytes``, 422 with field errors
``{"detail": [{"loc", "msg", "type"}]}``. A 503 means Redis does not answer.
"""

from __future__ import annotations

import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Body, Depends, FastAPI, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from agentrl._http import BodyLimit, bearer_auth
from agentrl.api.base import ApiSettings, TaskStatus
from agentrl.api.routes import add_routes, operation_id
from agentrl.api.schemas import (
    EnvironmentInfo,
    EnvironmentList,
    ErrorBody,
    EvalCreated,
    EvalList,
    EvalState,
    Health,
    Progress,
    ResultsPage,
    ToolInfo,
    links,
)
from agentrl.api.store import TaskStore
from agentrl.api.webhooks import check_webhook
from agentrl.api.worker import EvalWorkers
from agentrl.errors import ConfigError, QueueError
from agentrl.eval.base import SpecError, UnknownEnvironmentError
from agentrl.eval.datasets import tasks_to_json
from agentrl.eval.services import EvalServices
from agentrl.eval.spec import EXAMPLE, EvalSpec
from agentrl.queue import connect_redis

logger = logging.getLogger(__name__)

_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorBody, "description": "missing or wrong bearer token"},
    422: {"model": ErrorBody, "description": "invalid request: field errors"},
    503: {"model": ErrorBody, "description": "Redis does not answer; retry later"},
}
_NOT_FOUND: dict[int | str, dict[str, Any]] = {404: {"model": ErrorBody, "description": "no such task"}}


@dataclass(frozen=True, slots=True)
class _State:
    store: TaskStore
    services: EvalServices
    workers: EvalWorkers


def _state(request: Request) -> _State:
    return request.app.state.agentrl  # type: ignore[no-any-return]


State = Annotated[_State, Depends(_state)]


def create_app(settings: ApiSettings | None = None, *, services: EvalServices | None = None) -> FastAPI:
    """The API; its lifespan connects Redis, builds the services (unless given) and runs the workers."""
    settings = settings or ApiSettings.from_env()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            handle = await connect_redis(settings.redis_url, settings.data_dir / "redis")
            stack.push_async_callback(handle.aclose)
            store = TaskStore(handle.client, settings.namespace)
            svc = services
            if svc is None:
                svc = await EvalServices.create(
                    sandbox=settings.sandbox, rewards=settings.rewards,
                    max_servers=settings.max_servers, max_inflight=settings.max_inflight,
                    max_episodes=settings.max_episodes, server_config=settings.sglang,
                    log_dir=settings.data_dir / "logs", runs_dir=settings.runs_dir,
                    dataset_dirs=settings.dataset_dirs)
                stack.push_async_callback(svc.aclose)
            workers = await EvalWorkers(store, svc, settings).start()
            stack.push_async_callback(workers.aclose)  # first to stop: hands running tasks back
            app.state.agentrl = _State(store, svc, workers)
            yield

    app = FastAPI(title="agentrl evaluation API", version="1", lifespan=lifespan,
                  generate_unique_id_function=operation_id,
                  description=__doc__.split("\n\n", 1)[1] if __doc__ else "")
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes,  # type: ignore[arg-type]
                       hint="; send fewer items inline or put the dataset in a server-side file")
    _errors(app)
    v1 = [Depends(bearer_auth(settings.token, hint=" (Authorization: Bearer <AGENTRL_API_TOKEN>)",
                              description="required when the server has AGENTRL_API_TOKEN set"))]
    add_routes(app, v1)  # first: /v1/evals/compare before /v1/evals/{eval_id}

    @app.post("/v1/evals", status_code=202, response_model=EvalCreated, dependencies=v1, tags=["evals"],
              responses={**_ERRORS, 404: {"model": ErrorBody, "description": "unknown environment"},
                         413: {"model": ErrorBody, "description": "request body too large"}})
    async def submit(spec: Annotated[EvalSpec, Body(openapi_examples={"retool": {
            "summary": "ReTool math with the bundled tiny model", "value": EXAMPLE}})],
            s: State, response: Response) -> EvalCreated:
        """Queue an evaluation; poll ``GET /v1/evals/{id}`` for its status and metrics."""
        spec, tasks = await s.services.resolve(spec)  # the stored spec records the dataset's version and sha256
        check_webhook(spec.webhook_url, settings)
        total = len(tasks) * spec.samples_per_item
        task_id = await s.store.submit(spec.model_dump(mode="json"), tasks_to_json(tasks), total)
        await s.workers.emit(task_id, "status", {"status": TaskStatus.QUEUED.value})
        s.workers.wake()
        response.headers["Location"] = f"/v1/evals/{task_id}"
        return EvalCreated(id=task_id, status=TaskStatus.QUEUED, links=links(task_id),
                           progress=Progress(done=0, total=total))

    @app.get("/v1/evals", response_model=EvalList, dependencies=v1, tags=["evals"], responses=_ERRORS)
    async def list_evals(s: State, status: TaskStatus | None = None,
                         limit: Annotated[int, Query(ge=1, le=500)] = 50) -> EvalList:
        """Recent tasks, newest first (without their specs)."""
        return EvalList(evals=[EvalState.of(t, with_spec=False)
                               for t in await s.store.list_tasks(limit=limit, status=status)])

    @app.get("/v1/evals/{eval_id}", response_model=EvalState, dependencies=v1, tags=["evals"],
             responses={**_ERRORS, **_NOT_FOUND})
    async def get_eval(eval_id: str, s: State) -> EvalState:
        """Status, progress and metrics (partial while the task runs) of a task."""
        t = await s.store.get(eval_id)
        if t is None:
            raise HTTPException(404, f"no evaluation task {eval_id!r}")
        return EvalState.of(t)

    @app.get("/v1/evals/{eval_id}/results", response_model=ResultsPage, dependencies=v1, tags=["evals"],
             responses={**_ERRORS, **_NOT_FOUND})
    async def results(eval_id: str, s: State, offset: Annotated[int, Query(ge=0, le=10**9)] = 0,
                      limit: Annotated[int, Query(ge=1, le=1000)] = 100,
                      trajectories: Annotated[bool, Query(
                          description="include full trajectories (and chat transcripts)")] = True) -> Response:
        """Per-sample records in completion order, ``limit`` at a time from ``offset``."""
        t = await s.store.get(eval_id)
        if t is None:
            raise HTTPException(404, f"no evaluation task {eval_id!r}")
        total, rows = await s.store.results(eval_id, offset, limit)
        if not trajectories:
            rows = [json.dumps({**json.loads(r), "trajectory": None, "transcript": None}) for r in rows]
        nxt = offset + len(rows) if offset + len(rows) < total else None
        head = {"id": eval_id, "status": t.status.value, "total": total, "offset": offset, "limit": limit,
                "next_offset": nxt}
        body = json.dumps(head)[:-1] + ', "records": [' + ",".join(rows) + "]}"  # records are stored as JSON
        return Response(body, media_type="application/json")

    @app.delete("/v1/evals/{eval_id}", response_model=EvalState, dependencies=v1, tags=["evals"],
                responses={**_ERRORS, **_NOT_FOUND, 409: {"model": ErrorBody, "description": "already finished"}})
    async def cancel(eval_id: str, s: State) -> EvalState:
        """Cancel a queued or running task (its records so far are kept); cancelling twice is fine."""
        before = await s.store.cancel(eval_id)
        if before is None:
            raise HTTPException(404, f"no evaluation task {eval_id!r}")
        if before in (TaskStatus.SUCCEEDED, TaskStatus.FAILED):
            raise HTTPException(409, f"evaluation task {eval_id} already {before.value}; nothing to cancel")
        s.workers.cancelled(eval_id)
        await s.workers.announce_cancel(eval_id, before)
        t = await s.store.get(eval_id)
        assert t is not None
        return EvalState.of(t)

    @app.get("/v1/environments", response_model=EnvironmentList, dependencies=v1, tags=["environments"],
             responses=_ERRORS)
    async def environments(s: State) -> EnvironmentList:
        """Registered environments (use one as ``environment.name``) and their tools."""
        reg = s.services.registry
        return EnvironmentList(environments=[
            EnvironmentInfo(name=e.name, description=e.description,
                            tools=[ToolInfo(name=t.name, description=t.description, parameters=t.parameters)
                                   for t in (reg.tools.get(n) for n in e.tools) if t is not None],
                            stop=[str(x) for x in getattr(e.factory, "stop", ()) or ()])
            for e in reg.list_envs()])

    @app.get("/healthz", response_model=Health, tags=["health"])
    async def healthz(s: State) -> Health:
        """Liveness (no token needed)."""
        try:
            queued: int | None = await s.store.queue_length()
        except QueueError:
            queued = None
        return Health(status="ok" if queued is not None else "degraded", redis=queued is not None, queued=queued,
                      running=sorted(s.workers.running), engines=s.services.engines.status(),
                      worker=s.workers.worker_id)

    return app


def _field_errors(errors: Any) -> list[dict[str, Any]]:
    return [{"loc": list(e.get("loc", ())), "msg": str(e.get("msg", "")), "type": str(e.get("type", ""))}
            for e in errors]


def _errors(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"detail": _field_errors(exc.errors())}, status_code=422)

    @app.exception_handler(UnknownEnvironmentError)
    async def unknown_env(request: Request, exc: UnknownEnvironmentError) -> JSONResponse:
        return JSONResponse({"detail": str(exc), "known_environments": list(exc.known)}, status_code=404)

    @app.exception_handler(SpecError)
    async def bad_spec(request: Request, exc: SpecError) -> JSONResponse:
        return JSONResponse({"detail": [{"loc": ["body", *exc.loc], "msg": exc.message, "type": "value_error"}]},
                            status_code=422)

    @app.exception_handler(ConfigError)
    async def bad_config(request: Request, exc: ConfigError) -> JSONResponse:
        return JSONResponse({"detail": [{"loc": ["body"], "msg": str(exc), "type": "value_error"}]}, status_code=422)

    @app.exception_handler(QueueError)
    async def redis_down(request: Request, exc: QueueError) -> JSONResponse:
        return JSONResponse({"detail": f"the task store is unavailable: {exc}"}, status_code=503,
                            headers={"Retry-After": "5"})

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> JSONResponse:
        ref = uuid.uuid4().hex[:12]
        logger.exception("internal error %s on %s %s", ref, request.method, request.url.path)
        return JSONResponse({"detail": f"internal error (reference {ref}); see the server log"}, status_code=500)
