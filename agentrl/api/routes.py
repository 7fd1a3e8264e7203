"""Routes of the evaluation API beyond a task's life cycle: its event stream, the comparison of two runs, and the
dataset registry (mounted by :func:`agentrl.api.app.create_app` before ``/v1/evals/{id}``, so ``compare`` is not
taken for an id).

    GET /v1/evals/{id}/events     server-sent events: status, progress, metrics, end (resumable: Last-Event-ID)
    GET /v1/evals/compare         do runs a and b differ? paired over their items (?a=&b=&metric=)
    GET /v1/datasets              named datasets (files under the data roots, plugins, built-ins)
    GET /v1/datasets/{name}       one dataset: versions, sizes, sha256

The event stream replays the task's stored events after ``Last-Event-ID`` (all of them without one), then
follows new ones; it ends after the ``end`` event. When a task is final but its ``end`` event is missing (it was
trimmed, or the task failed while being claimed) the stream ends with an ``end`` event built from the task (with
no id). Events are kept per task up to ``events_maxlen`` (older ones are trimmed: a client resuming from a trimmed
id gets the events still kept).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import FastAPI, Header, Query, Request
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.exceptions import HTTPException

from agentrl.api.auth import Reader
from agentrl.api.schemas import Comparison, DatasetInfo, DatasetList, DatasetVersionInfo, ErrorBody, EvalState
from agentrl.api.store import TaskStore
from agentrl.eval.base import SampleRecord
from agentrl.eval.catalog import DatasetCatalog, NamedDataset, natural_order
from agentrl.eval.metrics import item_scores
from agentrl.eval.stats import compare_paired

logger = logging.getLogger(__name__)

ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorBody, "description": "missing or wrong bearer token"},
    422: {"model": ErrorBody, "description": "invalid request: field errors"},
    503: {"model": ErrorBody, "description": "Redis does not answer; retry later"},
}
NOT_FOUND: dict[int | str, dict[str, Any]] = {404: {"model": ErrorBody, "description": "no such task"}}
EVENT_ID = r"^[0-9]{1,20}(-[0-9]{1,20})?$"
METRIC = r"^(accuracy|mean_reward|pass@[1-9][0-9]{0,2})$"

_SSE_DOC: dict[int | str, dict[str, Any]] = {200: {"description": (
    "`text/event-stream`; each event has an `id` (give it back as `Last-Event-ID` to resume), an `event` kind and "
    "JSON `data`: `status` {status, attempts?}, `progress` {done, total, errors, fraction}, `metrics` (partial "
    "metrics), `end` (the final task state, as GET /v1/evals/{id} shows it; the stream ends after it)"),
    "content": {"text/event-stream": {"schema": {"type": "string"}, "example": (
        'id: 1767225600000-0\nevent: status\ndata: {"status": "running", "attempts": 1}\n\n'
        'id: 1767225600412-0\nevent: progress\ndata: {"done": 1, "total": 4, "errors": 0, "fraction": 0.25}\n\n')}}}}


#: stable operationIds of the routes of agentrl.api.app (by function name); generated clients name methods after them
OPERATION_IDS = {"submit": "createEval", "list_evals": "listEvals", "get_eval": "getEval",
                 "results": "getEvalResults", "cancel": "cancelEval", "environments": "listEnvironments",
                 "healthz": "getHealth", "service_status": "getStatus"}


def operation_id(route: APIRoute) -> str:
    """A route's operationId: its ``operation_id``, else :data:`OPERATION_IDS`, else its name in camelCase."""
    if route.name in OPERATION_IDS:
        return OPERATION_IDS[route.name]
    head, *rest = route.name.split("_")
    return head + "".join(w.title() for w in rest)


def _state(request: Request) -> Any:
    return request.app.state.agentrl


def add_routes(app: FastAPI, dependencies: list[Any]) -> None:
    """Mount this module's routes on ``app`` (``dependencies``: the /v1 auth)."""

    @app.get("/v1/evals/compare", response_model=Comparison, dependencies=dependencies, tags=["evals"],
             operation_id="compareEvals", responses={**ERRORS, **NOT_FOUND})
    async def compare(request: Request, p: Reader,
                      a: Annotated[str, Query(min_length=1, max_length=128, description="id of the baseline run")],
                      b: Annotated[str, Query(min_length=1, max_length=128, description="id of the other run")],
                      metric: Annotated[str, Query(pattern=METRIC, description="accuracy, mean_reward or pass@K")]
                      = "accuracy") -> Comparison:
        """Whether run ``b`` differs from run ``a`` on ``metric``, paired over the items both scored: the
        difference b − a, its standard error and 95 % interval (paired bootstrap over items), and a two-sided
        p-value (McNemar's exact test for 0/1 item outcomes, else a paired permutation test)."""
        store: TaskStore = _state(request).store
        tasks = [await store.get(a), await store.get(b)]
        for name, t in zip(("a", "b"), tasks):
            if t is None or not p.owns(t.tenant):  # another tenant's task: as unknown
                raise HTTPException(404, f"no evaluation task {(a if name == 'a' else b)!r} (query parameter {name})")
        rows = [(await store.results(i, 0, 10**9))[1] for i in (a, b)]  # JSON, parsed off the loop
        try:
            out = await asyncio.to_thread(_compare, rows[0], rows[1], metric)
        except ValueError as exc:
            return _unprocessable(str(exc))  # type: ignore[return-value]
        ta, tb = tasks
        assert ta is not None and tb is not None
        return Comparison(a=a, b=b, metric=metric, status_a=ta.status, status_b=tb.status, **out)

    @app.get("/v1/evals/{eval_id}/events", dependencies=dependencies, tags=["evals"], operation_id="getEvalEvents",
             response_class=EventSourceResponse, responses={**ERRORS, **NOT_FOUND, **_SSE_DOC})
    async def events(eval_id: str, request: Request, p: Reader,
                     last_event_id: Annotated[str | None, Header(
                         alias="Last-Event-ID", pattern=EVENT_ID,
                         description="resume after this event (what a browser's EventSource sends)")] = None,
                     after: Annotated[str | None, Query(
                         pattern=EVENT_ID, description="resume after this event (for clients that cannot set "
                                                       "headers; Last-Event-ID wins)")] = None) -> EventSourceResponse:
        """The task's events as server-sent events (see the module docstring of agentrl.api.routes)."""
        s = _state(request)
        t = await s.store.get(eval_id)
        if t is None or not p.owns(t.tenant):  # another tenant's task: as unknown
            raise HTTPException(404, f"no evaluation task {eval_id!r}")
        start = last_event_id or after or "0"
        return EventSourceResponse(_stream(s.store, eval_id, start, wait_s=s.workers.settings.events_wait_s),
                                   ping=15, headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})


    @app.get("/v1/datasets", response_model=DatasetList, dependencies=dependencies, tags=["datasets"],
             operation_id="listDatasets", responses=ERRORS)
    async def datasets(request: Request) -> DatasetList:
        """Named datasets: files under the server's dataset roots, ``agentrl.datasets`` plugins, built-in
        generators; with versions and sha256 content hashes."""
        catalog: DatasetCatalog = _state(request).services.catalog
        return DatasetList(datasets=await asyncio.to_thread(
            lambda: [_info(catalog, d) for d in catalog.datasets().values()]))

    @app.get("/v1/datasets/{name}", response_model=DatasetInfo, dependencies=dependencies, tags=["datasets"],
             operation_id="getDataset",
             responses={**ERRORS, 404: {"model": ErrorBody, "description": "no such dataset"}})
    async def dataset(name: str, request: Request) -> DatasetInfo:
        """One named dataset: its versions, their sizes and sha256 content hashes."""
        catalog: DatasetCatalog = _state(request).services.catalog

        def find() -> DatasetInfo | None:
            d = catalog.datasets().get(name)
            return _info(catalog, d) if d is not None else None

        info = await asyncio.to_thread(find)
        if info is None:
            raise HTTPException(404, f"no dataset {name!r}; GET /v1/datasets lists them")
        return info


def _info(catalog: DatasetCatalog, d: NamedDataset) -> DatasetInfo:
    versions = []
    for key in sorted(d.versions, key=natural_order):
        v = d.versions[key]
        try:
            digest = catalog.sha256(v)
        except Exception as exc:  # a broken file or plugin: listed, without a hash (submitting it says why)
            logger.warning("dataset %s version %s: no hash: %r", d.name, key, exc)
            digest = None
        versions.append(DatasetVersionInfo(**v.describe(digest)))
    return DatasetInfo(name=d.name, description=d.description, latest=d.latest, versions=versions)


def _unprocessable(message: str) -> JSONResponse:
    return JSONResponse({"detail": [{"loc": ["query"], "msg": message, "type": "value_error"}]}, status_code=422)


def _compare(rows_a: list[str], rows_b: list[str], metric: str) -> dict[str, Any]:
    scores_a, binary_a = item_scores((SampleRecord.from_dict(json.loads(r)) for r in rows_a), metric)
    scores_b, binary_b = item_scores((SampleRecord.from_dict(json.loads(r)) for r in rows_b), metric)
    shared = sorted(set(scores_a) & set(scores_b))
    if not shared:
        raise ValueError(f"the two runs have no item both scored under {metric} (compare runs of the same dataset; "
                         f"a has {len(scores_a)} scored items, b {len(scores_b)})")
    c = compare_paired([scores_a[k] for k in shared], [scores_b[k] for k in shared], binary=binary_a and binary_b)
    return {**c.to_dict(), "only_a": len(set(scores_a) - set(shared)), "only_b": len(set(scores_b) - set(shared))}


async def _stream(store: TaskStore, task_id: str, after: str, *, wait_s: float) -> AsyncIterator[ServerSentEvent]:
    """The task's events after ``after`` until its ``end`` (see the module docstring)."""
    last = after
    block: int | None = None  # the first read does not wait: a finished task's stream ends at once
    grace = 1  # waits allowed for a final task's end event while a worker still holds it
    while True:
        entries = await store.read_events(task_id, last, block_ms=block)
        for eid, kind, data in entries:
            last = eid
            yield ServerSentEvent(data=data, event=kind, id=eid)
            if kind == "end":
                return
        if entries:
            continue
        block = int(wait_s * 1000)
        t = await store.get(task_id)
        if t is None:  # deleted meanwhile
            return
        if t.status.terminal:
            if t.worker is not None and grace > 0:  # its worker is writing the end now
                grace -= 1
                continue
            if await store.read_events(task_id, last, block_ms=None):
                continue
            yield ServerSentEvent(data=json.dumps(EvalState.of(t, with_spec=False).model_dump(mode="json")),
                                  event="end")
            return
