"""The evaluation REST API (FastAPI): submit, track, cancel and page through evaluation tasks.

    POST   /v1/evals                 202 {id, status, progress, links}; body: agentrl.eval.EvalSpec;
                                     Idempotency-Key header: the same key + body again is 200 and the same task
    GET    /v1/evals                 tasks, newest first, cursor-paged (?after=&limit=), filtered (?status=
                                     &environment=&label=k=v&created_after=&created_before=)
    GET    /v1/evals/{id}            status, progress {done, total}, metrics (partial while running)
    GET    /v1/evals/{id}/results    per-sample records with trajectories, paged (?offset=&limit=&trajectories=)
    DELETE /v1/evals/{id}            cancel (409 if it already finished); ?purge=true: delete it and its results
    GET    /v1/environments          registered environments and their tools
    GET    /v1/status                (admin) queue, tasks per status, what this process runs, bytes stored
    GET    /healthz                  liveness
    (and agentrl.api.routes: GET /v1/evals/{id}/events, /v1/evals/compare, /v1/datasets, /v1/datasets/{name})

Client mistakes are 4xx, never 5xx: 401 without a known bearer token (when tenants or a token are set), 403
without the route's scope, 404 for an unknown task (or another tenant's) or environment (naming the known
environments), 409 for an Idempotency-Key reused with another body, 413 past ``max_body_bytes``, 422 with field
errors ``{"detail": [{"loc", "msg", "type"}]}``, 507 when the task store is at its bound. A 503 means Redis does
not answer.
"""

from __future__ import annotations

import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Body, Depends, FastAPI, Header, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import StringConstraints
from starlette.exceptions import HTTPException

from agentrl._http import BodyLimit
from agentrl.api.auth import Admin, Authenticator, Canceller, Principal, Reader, Submitter, authenticated
from agentrl.api.base import ApiSettings, IdempotencyConflict, StoreFull, TaskStatus
from agentrl.api.policy import SpecPolicy
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
    ServiceStatus,
    ToolInfo,
    links,
    progress,
)
from agentrl.api.store import ListQuery, TaskRecord, TaskStore
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
_NOT_FOUND: dict[int | str, dict[str, Any]] = {
    403: {"model": ErrorBody, "description": "the tenant lacks this route's scope"},
    404: {"model": ErrorBody, "description": "no such task (or another tenant's)"}}


@dataclass(frozen=True, slots=True)
class _State:
    store: TaskStore
    services: EvalServices
    workers: EvalWorkers


def _state(request: Request) -> _State:
    return request.app.state.agentrl  # type: ignore[no-any-return]


State = Annotated[_State, Depends(_state)]


def _replayed(t: TaskRecord, response: Response) -> EvalCreated:
    """The answer to a submission whose Idempotency-Key made ``t`` before: 200 and its state now."""
    response.status_code = 200
    response.headers["Location"] = f"/v1/evals/{t.id}"
    response.headers["Idempotent-Replayed"] = "true"
    return EvalCreated(id=t.id, status=t.status, links=links(t.id), progress=progress(t))


async def _owned(s: _State, p: Principal, eval_id: str) -> TaskRecord:
    """The task, if the caller may see it: another tenant's is a 404 like an unknown one (ids are not revealed)."""
    t = await s.store.get(eval_id)
    if t is None or not p.owns(t.tenant):
        raise HTTPException(404, f"no evaluation task {eval_id!r}")
    return t


def create_app(settings: ApiSettings | None = None, *, services: EvalServices | None = None) -> FastAPI:
    """The API; its lifespan connects Redis, builds the services (unless given) and runs the workers."""
    settings = settings or ApiSettings.from_env()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            handle = await connect_redis(settings.redis_url, settings.data_dir / "redis")
            stack.push_async_callback(handle.aclose)
            store = TaskStore(handle.client, settings.namespace, max_task_bytes=settings.max_task_result_bytes,
                              max_store_bytes=settings.max_store_bytes, idempotency_ttl_s=settings.idempotency_ttl_s)
            if migrated := await store.migrate():
                logger.info("indexed %d evaluation tasks stored by an older agentrl", migrated)
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
    app.state.authenticator = Authenticator(settings.all_tenants())
    policy = SpecPolicy(model_hosts=settings.model_hosts, model_dirs=settings.model_dirs)
    v1 = [Depends(authenticated)]
    add_routes(app, v1)  # first: /v1/evals/compare before /v1/evals/{eval_id}

    @app.post("/v1/evals", status_code=202, response_model=EvalCreated, tags=["evals"],
              responses={**_ERRORS, 200: {"model": EvalCreated, "description": "this Idempotency-Key's task "
                                                                                 "(submitted before with this body)"},
                         403: _NOT_FOUND[403], 404: {"model": ErrorBody, "description": "unknown environment"},
                         409: {"model": ErrorBody, "description": "Idempotency-Key used with another body"},
                         413: {"model": ErrorBody, "description": "request body too large"},
                         507: {"model": ErrorBody, "description": "the task store is at its bound"}})
    async def submit(spec: Annotated[EvalSpec, Body(openapi_examples={"retool": {
            "summary": "ReTool math with the bundled tiny model", "value": EXAMPLE}})],
            s: State, p: Submitter, response: Response,
            idempotency_key: Annotated[str | None, Header(
                alias="Idempotency-Key", min_length=1, max_length=255, pattern=r"^[\x21-\x7e]+$",
                description="a unique key per evaluation (e.g. a UUID): a retry with it and the same body gets "
                            "the same task (200), with another body a 409")] = None) -> EvalCreated:
        """Queue an evaluation; poll ``GET /v1/evals/{id}`` for its status and metrics."""
        policy.check(spec)
        request = spec.model_dump(mode="json")  # what an Idempotency-Key is bound to: the request, not its resolution
        if idempotency_key is not None:  # a retry answers at once, without resolving the dataset again
            seen = await s.store.replay(request, tenant=p.name, idempotency_key=idempotency_key)
            if seen is not None and (t := await s.store.get(seen)) is not None:
                return _replayed(t, response)
        spec, tasks = await s.services.resolve(spec)  # the stored spec records the dataset's version and sha256
        check_webhook(spec.webhook_url, settings, policy.host_allowed)
        total = len(tasks) * spec.samples_per_item
        task_id, new = await s.store.submit(spec.model_dump(mode="json"), tasks_to_json(tasks), total, tenant=p.name,
                                            idempotency_key=idempotency_key, request=request)
        if not new and (t := await s.store.get(task_id)) is not None:
            return _replayed(t, response)
        await s.workers.emit(task_id, "status", {"status": TaskStatus.QUEUED.value})
        s.workers.wake()
        response.headers["Location"] = f"/v1/evals/{task_id}"
        return EvalCreated(id=task_id, status=TaskStatus.QUEUED, links=links(task_id),
                           progress=Progress(done=0, total=total))

    @app.get("/v1/evals", response_model=EvalList, tags=["evals"], responses={**_ERRORS, 403: _NOT_FOUND[403]})
    async def list_evals(
            s: State, p: Reader, status: TaskStatus | None = None,
            limit: Annotated[int, Query(ge=1, le=500)] = 50,
            after: Annotated[str | None, Query(pattern=r"^[0-9]{1,19}$",
                                               description="the `next_cursor` of the previous page")] = None,
            environment: Annotated[str | None, Query(min_length=1, max_length=128)] = None,
            label: Annotated[list[Annotated[str, StringConstraints(pattern=r"^[^=]{1,64}=[\s\S]{0,256}$")]] | None,
                             Query(max_length=32, description="key=value: tasks with this label (repeatable: "
                                                              "tasks with all of them)")] = None,
            created_after: Annotated[float | None, Query(ge=0, le=1e11, description="unix time, inclusive")] = None,
            created_before: Annotated[float | None, Query(ge=0, le=1e11, description="unix time, exclusive")] = None,
    ) -> EvalList:
        """Tasks (the caller's own; an admin's: every tenant's), newest first, without their specs; a page at a
        time: pass ``next_cursor`` as ``after``. Tasks submitted meanwhile are newer than the cursor, so a walk
        sees each task that existed when it began exactly once. Filters combine (all must match)."""
        labels = tuple(tuple(x.split("=", 1)) for x in label or ())
        tasks, cursor = await s.store.list_page(ListQuery(
            tenant=p.sees, status=status, environment=environment, labels=labels,  # type: ignore[arg-type]
            created_after=created_after, created_before=created_before,
            after=int(after) if after is not None else None, limit=limit))
        return EvalList(evals=[EvalState.of(t, with_spec=False) for t in tasks], has_more=cursor is not None,
                        next_cursor=None if cursor is None else str(cursor))

    @app.get("/v1/evals/{eval_id}", response_model=EvalState, tags=["evals"],
             responses={**_ERRORS, **_NOT_FOUND})
    async def get_eval(eval_id: str, s: State, p: Reader) -> EvalState:
        """Status, progress and metrics (partial while the task runs) of a task."""
        return EvalState.of(await _owned(s, p, eval_id))

    @app.get("/v1/evals/{eval_id}/results", response_model=ResultsPage, tags=["evals"],
             responses={**_ERRORS, **_NOT_FOUND})
    async def results(eval_id: str, s: State, p: Reader, offset: Annotated[int, Query(ge=0, le=10**9)] = 0,
                      limit: Annotated[int, Query(ge=1, le=1000)] = 100,
                      trajectories: Annotated[bool, Query(
                          description="include full trajectories (and chat transcripts)")] = True) -> Response:
        """Per-sample records in completion order, ``limit`` at a time from ``offset``."""
        t = await _owned(s, p, eval_id)
        total, rows = await s.store.results(eval_id, offset, limit)
        if not trajectories:
            rows = [json.dumps({**json.loads(r), "trajectory": None, "transcript": None}) for r in rows]
        nxt = offset + len(rows) if offset + len(rows) < total else None
        head = {"id": eval_id, "status": t.status.value, "total": total, "offset": offset, "limit": limit,
                "next_offset": nxt}
        body = json.dumps(head)[:-1] + ', "records": [' + ",".join(rows) + "]}"  # records are stored as JSON
        return Response(body, media_type="application/json")

    @app.delete("/v1/evals/{eval_id}", response_model=EvalState, tags=["evals"],
                responses={**_ERRORS, **_NOT_FOUND, 204: {"description": "purged"},
                           409: {"model": ErrorBody, "description": "already finished (cancel without purge)"}})
    async def cancel(eval_id: str, s: State, p: Canceller,
                     purge: Annotated[bool, Query(description="delete the task and all its results (a running "
                                                              "task is stopped first); 204")] = False) -> Any:
        """Cancel a queued or running task (its records so far are kept); cancelling twice is fine. With
        ``purge=true``: delete the task, its dataset and its records, whatever its status."""
        await _owned(s, p, eval_id)
        if purge:
            if await s.store.purge(eval_id) is None:
                raise HTTPException(404, f"no evaluation task {eval_id!r}")
            s.workers.cancelled(eval_id)
            return Response(status_code=204)
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
        """Liveness (no token needed); the rest is ``GET /v1/status`` (admin)."""
        try:
            ok = await s.store.ping()
        except QueueError:
            ok = False
        return Health(status="ok" if ok else "degraded", redis=ok)

    @app.get("/v1/status", response_model=ServiceStatus, tags=["health"],
             responses={**_ERRORS, 403: _NOT_FOUND[403]})
    async def service_status(s: State, p: Admin) -> ServiceStatus:
        """What the service holds and runs (admin scope)."""
        try:
            queued: int | None = await s.store.queue_length()
            counts, stored = await s.store.counts(), await s.store.stored_bytes()
        except QueueError:
            queued, counts, stored = None, {}, None
        return ServiceStatus(redis=queued is not None, queued=queued, tasks=counts, running=sorted(s.workers.running),
                             engines=s.services.engines.status(), worker=s.workers.worker_id, stored_bytes=stored,
                             max_store_bytes=settings.max_store_bytes,
                             tenants=[t.name for t in settings.all_tenants()])

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

    @app.exception_handler(StoreFull)
    async def store_full(request: Request, exc: StoreFull) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=507)

    @app.exception_handler(IdempotencyConflict)
    async def idempotency_conflict(request: Request, exc: IdempotencyConflict) -> JSONResponse:
        return JSONResponse({"detail": str(exc), "task_id": exc.task_id}, status_code=409)

    @app.exception_handler(QueueError)
    async def redis_down(request: Request, exc: QueueError) -> JSONResponse:
        return JSONResponse({"detail": f"the task store is unavailable: {exc}"}, status_code=503,
                            headers={"Retry-After": "5"})

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> JSONResponse:
        ref = uuid.uuid4().hex[:12]
        logger.exception("internal error %s on %s %s", ref, request.method, request.url.path)
        return JSONResponse({"detail": f"internal error (reference {ref}); see the server log"}, status_code=500)
