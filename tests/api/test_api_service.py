"""The eval service a team shares (issue 23): idempotent submission, cursor listing with filters, retention
(purge, TTL, bounds), tenants with scopes, the model-host allow-list. A real uvicorn server and a real Redis; no
SGLang (the service queues only, ``max_tasks=0``; records are stored through the real task store, as a worker
stores them)."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import zlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio
from api_support import body

from agentrl.api import ApiSettings, ListQuery, TaskStatus, TaskStore
from agentrl.api.base import StoreFull, Tenant
from agentrl.client import ApiError, AsyncEvalClient

ADMIN = "admin-token"
TENANTS = [Tenant(name="team-a", token="token-a"), Tenant(name="team-b", token="token-b"),
           Tenant(name="viewer", token="token-ro", scopes=frozenset({"read"})),  # type: ignore[arg-type]
           Tenant(name="ops", token="token-ops", scopes=frozenset({"admin"}))]  # type: ignore[arg-type]


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
async def rds(redis_url: str) -> AsyncIterator[redis.asyncio.Redis]:
    client = redis.asyncio.Redis.from_url(redis_url)
    yield client
    await client.aclose()


async def namespace_keys(r: redis.asyncio.Redis, ns: str) -> list[str]:
    return sorted([k.decode() async for k in r.scan_iter(match=f"{ns}*", count=1000)])


async def used_memory(r: redis.asyncio.Redis) -> int:
    return int((await r.info("memory"))["used_memory"])


def big_record(item: int, rng: random.Random) -> str:
    """A sample record with a 4,000-token trajectory, as a worker stores it."""
    n = 4000
    return json.dumps({"item_index": item, "sample_index": 0, "status": "ok", "reward": 1.0, "trajectory": {
        "token_ids": [rng.randrange(50_000) for _ in range(n)], "loss_mask": [rng.randrange(2) for _ in range(n)],
        "behavior_logprobs": [round(-rng.random() * 5, 4) for _ in range(n)]}})


async def store_records(store: TaskStore, task_id: str, count: int, *, finish: bool = True) -> None:
    """Run ``task_id`` as a worker would: claim it (handing back the tasks queued before it), store ``count``
    records, finish it."""
    others = []
    while (claimed := await store.claim("test-worker", lease_s=60, max_attempts=3)) != task_id:
        assert claimed is not None, f"{task_id} is not queued"
        others.append(claimed)
    for other in others:
        assert await store.release(other, "test-worker")
    rng = random.Random(0)
    for i in range(count):
        assert await store.append(task_id, "test-worker", f"{i}:0", big_record(i, rng), ok=True)
    if finish:
        assert await store.finish(task_id, "test-worker", TaskStatus.SUCCEEDED, metrics={"num_samples": count})


def task_store(settings: ApiSettings, r: redis.asyncio.Redis) -> TaskStore:
    return TaskStore(r, settings.namespace, max_task_bytes=settings.max_task_result_bytes,
                     max_store_bytes=settings.max_store_bytes)


# ------------------------------------------------------------------------------------------------ idempotency


class DropFirstReply(httpx.AsyncBaseTransport):
    """Forwards every request to the real server; the reply to the first POST is lost on the way back."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.posts: list[str] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        if request.method == "POST":
            self.posts.append(request.headers["Idempotency-Key"])
            if len(self.posts) == 1:
                await response.aread()  # the server did its work ...
                await response.aclose()
                raise httpx.ReadError("connection reset by peer", request=request)  # ... the reply never came
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_a_submission_retried_after_a_dropped_reply_makes_one_task(settings: ApiSettings, start_api) -> None:
    server = await start_api(settings.model_copy(update={"max_tasks": 0}))
    transport = DropFirstReply()
    async with AsyncEvalClient(server.url, transport=transport) as client:
        eval_id = await client.submit(body())
        listed = [e["id"] async for e in client.iter_evals()]
    assert len(transport.posts) == 2 and transport.posts[0] == transport.posts[1]  # retried with its key
    assert listed == [eval_id]  # one task, the one the first (lost) reply announced


async def test_same_key_same_body_is_the_same_task_another_body_is_409(settings: ApiSettings, start_api) -> None:
    server = await start_api(settings.model_copy(update={"max_tasks": 0, "tenants": TENANTS}))
    async with httpx.AsyncClient(base_url=server.url) as http:
        key = {"Idempotency-Key": "eval-2026-11-25-001"}
        first = await http.post("/v1/evals", json=body(), headers=key | auth("token-a"))
        assert first.status_code == 202 and "idempotent-replayed" not in first.headers
        # the same body with its keys in another order is the same body
        again = await http.post("/v1/evals", json=dict(reversed(list(body().items()))), headers=key | auth("token-a"))
        assert again.status_code == 200 and again.headers["idempotent-replayed"] == "true"
        assert again.json()["id"] == first.json()["id"] and again.json()["status"] == "queued"
        other = await http.post("/v1/evals", json=body(samples_per_item=3, pass_k=[1]), headers=key | auth("token-a"))
        assert other.status_code == 409 and other.json()["task_id"] == first.json()["id"]
        assert "another request body" in other.json()["detail"]
        theirs = await http.post("/v1/evals", json=body(), headers=key | auth("token-b"))  # keys are per tenant
        assert theirs.status_code == 202 and theirs.json()["id"] != first.json()["id"]
        bad = await http.post("/v1/evals", json=body(), headers={"Idempotency-Key": "x" * 300} | auth("token-a"))
        assert bad.status_code == 422 and bad.json()["detail"][0]["loc"] == ["header", "Idempotency-Key"]
        # a purged task frees its key
        assert (await http.delete(f"/v1/evals/{first.json()['id']}", params={"purge": "true"},
                                  headers=auth("token-a"))).status_code == 204
        fresh = await http.post("/v1/evals", json=body(samples_per_item=3, pass_k=[1]), headers=key | auth("token-a"))
        assert fresh.status_code == 202 and fresh.json()["id"] != first.json()["id"]


async def test_concurrent_submissions_with_one_key_make_one_task(settings: ApiSettings, start_api) -> None:
    server = await start_api(settings.model_copy(update={"max_tasks": 0}))
    async with httpx.AsyncClient(base_url=server.url) as http:
        replies = await asyncio.gather(*(http.post("/v1/evals", json=body(), headers={"Idempotency-Key": "same"})
                                         for _ in range(16)))
        listed = (await http.get("/v1/evals")).json()["evals"]
    assert sorted(r.status_code for r in replies) == [200] * 15 + [202]
    assert len({r.json()["id"] for r in replies}) == 1 and [e["id"] for e in listed] == [replies[0].json()["id"]]


async def test_an_idempotency_key_is_forgotten_after_its_window(settings: ApiSettings, start_api) -> None:
    server = await start_api(settings.model_copy(update={"max_tasks": 0, "idempotency_ttl_s": 0.2}))
    async with httpx.AsyncClient(base_url=server.url) as http:
        first = await http.post("/v1/evals", json=body(), headers={"Idempotency-Key": "k"})
        await asyncio.sleep(0.5)  # past the window (Redis expires the key)
        second = await http.post("/v1/evals", json=body(), headers={"Idempotency-Key": "k"})
    assert (first.status_code, second.status_code) == (202, 202) and first.json()["id"] != second.json()["id"]


# ------------------------------------------------------------------------------------------------- listing


async def test_cursor_paging_walks_1000_tasks_without_duplicates_or_gaps_while_new_ones_arrive(
        settings: ApiSettings, start_api) -> None:
    server = await start_api(settings.model_copy(update={"max_tasks": 0}))
    async with AsyncEvalClient(server.url) as client:
        sem = asyncio.Semaphore(8)

        async def submit(i: int, wave: str) -> str:
            async with sem:
                return await client.submit(body(labels={"wave": wave, "i": str(i)}))

        first = await asyncio.gather(*(submit(i, "first") for i in range(1000)))
        stop = asyncio.Event()

        arrived: list[str] = []

        async def keep_submitting() -> list[str]:
            while not stop.is_set():
                arrived.append(await submit(len(arrived), "later"))
            return arrived

        walked: list[dict[str, Any]] = []
        after = None
        later_task = None
        while True:  # small pages, so submissions land between them
            page = await client.list_page(limit=37, after=after)
            walked += page["evals"]
            if later_task is None:  # the walk began: from now on new tasks arrive
                later_task = asyncio.create_task(keep_submitting())
            await asyncio.sleep(0.01)
            if not page["has_more"]:
                assert page["next_cursor"] is None
                break
            after = page["next_cursor"]
        assert arrived  # tasks did arrive during the walk
        stop.set()
        later = await later_task  # type: ignore[misc]
        everything = [e["id"] async for e in client.iter_evals(page_size=500)]
    ids = [e["id"] for e in walked]
    assert len(ids) == len(set(ids))  # no duplicates
    assert set(ids) == set(first)  # no gaps; tasks newer than the walk's start are above its cursor
    created = [e["created_at"] for e in walked]
    assert created == sorted(created, reverse=True)  # newest first
    assert set(everything[:len(later)]) == set(later) and set(everything[len(later):]) == set(first)


async def test_listing_filters_by_status_label_environment_and_created_range(settings: ApiSettings,
                                                                             start_api) -> None:
    server = await start_api(settings.model_copy(update={"max_tasks": 0}))
    async with AsyncEvalClient(server.url) as client:
        specs = [body(labels={"team": "ab"[i % 2], "i": str(i)},
                      environment={"name": "math" if i % 3 == 0 else "retool"}) for i in range(12)]
        ids = [await client.submit(s) for s in specs]
        for i in (0, 1, 2, 3):
            await client.cancel(ids[i])
        states = [await client.get(i) for i in ids]

        async def listed(**filters: Any) -> set[str]:
            return {e["id"] async for e in client.iter_evals(page_size=2, **filters)}

        assert await listed() == set(ids)
        assert await listed(status="cancelled") == set(ids[:4])
        assert await listed(status="queued", labels={"team": "a"}) == {ids[i] for i in (4, 6, 8, 10)}
        assert await listed(labels={"team": "b", "i": "5"}) == {ids[5]}
        assert await listed(labels={"team": "c"}) == set()
        assert await listed(environment="math") == {ids[i] for i in (0, 3, 6, 9)}
        assert await listed(environment="math", status="cancelled", labels={"team": "b"}) == {ids[3]}
        lo, hi = states[3]["created_at"], states[7]["created_at"]
        assert await listed(created_after=lo, created_before=hi) == set(ids[3:7])  # [lo, hi)
        with pytest.raises(ApiError) as bad:
            await client.list_page(after="not-a-cursor")
        assert bad.value.status == 422
        with pytest.raises(ApiError) as bad:
            await client.list_page(labels={"": "x"})
        assert bad.value.status == 422


# ----------------------------------------------------------------------------------------------- retention


async def test_purge_removes_the_task_and_its_results_and_frees_the_memory(settings: ApiSettings, start_api,
                                                                           rds: redis.asyncio.Redis) -> None:
    server = await start_api(settings.model_copy(update={"max_tasks": 0}))
    ns = settings.namespace
    async with AsyncEvalClient(server.url) as client:
        keep = await client.submit(body(name="keep"))
        keys_before = await namespace_keys(rds, ns)
        mem_before = await used_memory(rds)
        eval_id = await client.submit(body(name="purge me", labels={"team": "a"}))
        await store_records(task_store(settings, rds), eval_id, 300)
        state = await client.get(eval_id)
        assert state["status"] == "succeeded" and state["progress"]["done"] == 300
        page = await client.results(eval_id, limit=2)
        assert len(page["records"][0]["trajectory"]["token_ids"]) == 4000  # stored compressed, served as JSON
        raw = await rds.lindex(f"{ns}:results:{eval_id}", 0)
        assert json.loads(zlib.decompress(raw))["item_index"] == 0  # zlib-compressed JSON
        assert len(raw) < 0.7 * len(big_record(0, random.Random(0)))
        mem_full = await used_memory(rds)
        assert mem_full - mem_before > 300 * 5_000
        assert (await client.status())["stored_bytes"] > 300 * 5_000

        await client.purge(eval_id)
        assert await namespace_keys(rds, ns) == keys_before  # every key and index entry of the task is gone
        mem_after = await used_memory(rds)
        assert mem_full - mem_after > 0.8 * (mem_full - mem_before), (mem_before, mem_full, mem_after)
        for call in (client.get(eval_id), client.results(eval_id), client.cancel(eval_id), client.purge(eval_id)):
            with pytest.raises(ApiError) as gone:
                await call
            assert gone.value.status == 404
        assert [e["id"] async for e in client.iter_evals()] == [keep]
        assert [e["id"] async for e in client.iter_evals(labels={"team": "a"})] == []
        status = await client.status()
        assert status["tasks"]["succeeded"] == 0 and status["tasks"]["queued"] == 1
        assert status["stored_bytes"] == int(await rds.get(f"{ns}:bytes"))  # only the kept task's dataset
        assert (await client.cancel(keep))["status"] == "cancelled"  # without purge DELETE still cancels


async def test_a_running_task_that_is_purged_stops_storing(settings: ApiSettings, start_api,
                                                          rds: redis.asyncio.Redis) -> None:
    from agentrl.api.base import TaskLost

    server = await start_api(settings.model_copy(update={"max_tasks": 0}))
    store = task_store(settings, rds)
    async with AsyncEvalClient(server.url) as client:
        eval_id = await client.submit(body())
        await store_records(store, eval_id, 2, finish=False)
        assert await rds.exists(f"{settings.namespace}:events:{eval_id}")  # its "queued" event at least
        await client.purge(eval_id)
    assert await store.add_event(eval_id, "progress", {"done": 3}) is None  # a late event of its worker
    assert not await rds.exists(f"{settings.namespace}:events:{eval_id}")
    with pytest.raises(TaskLost):
        await store.append(eval_id, "test-worker", "9:0", "{}", ok=True)
    assert await store.heartbeat(eval_id, "test-worker", lease_s=60) == "lost"
    assert not await store.finish(eval_id, "test-worker", TaskStatus.SUCCEEDED, metrics=None)
    assert await namespace_keys(rds, f"{settings.namespace}:task") == []  # nothing written back


async def test_finished_tasks_are_purged_after_their_ttl(settings: ApiSettings, start_api,
                                                         rds: redis.asyncio.Redis) -> None:
    server = await start_api(settings.model_copy(update={"max_tasks": 0, "finished_ttl_s": 1.0}))
    ns = settings.namespace
    async with AsyncEvalClient(server.url) as client:
        mem_before = await used_memory(rds)
        done, cancelled, queued = [await client.submit(body(name=n)) for n in ("done", "cancelled", "queued")]
        await store_records(task_store(settings, rds), done, 200)
        await client.cancel(cancelled)
        mem_full = await used_memory(rds)
        for _ in range(300):  # the retention sweep runs every ttl/4
            if len(await client.list_evals()) == 1:
                break
            await asyncio.sleep(0.1)
        assert [e["id"] for e in await client.list_evals()] == [queued]  # the unfinished task stays
        for gone in (done, cancelled):
            with pytest.raises(ApiError) as info:
                await client.get(gone)
            assert info.value.status == 404
        tasks = [k for k in await namespace_keys(rds, ns) if any(i in k for i in (done, cancelled))]
        assert tasks == []
        mem_after = await used_memory(rds)
    assert mem_full - mem_after > 0.8 * (mem_full - mem_before), (mem_before, mem_full, mem_after)


async def test_a_store_at_its_bound_refuses_new_tasks_with_507(settings: ApiSettings, start_api,
                                                               rds: redis.asyncio.Redis) -> None:
    server = await start_api(settings.model_copy(update={"max_tasks": 0, "max_store_bytes": 4096}))
    items = [{"prompt": f"What is {i} + {i}? " + "x" * 300, "answer": str(2 * i)} for i in range(4)]  # ~1.4 KB
    async with AsyncEvalClient(server.url) as client:
        accepted = [await client.submit(body(dataset={"items": items})) for _ in range(2)]
        with pytest.raises(ApiError) as full:
            await client.submit(body(dataset={"items": items}))
        assert full.value.status == 507
        assert "max_store_bytes" in str(full.value.detail) and "purge" in str(full.value.detail)
        assert len(await client.list_evals()) == 2  # nothing half-stored
        assert (await client.health())["status"] == "ok"  # refusing is not a crash
        await client.purge(accepted[0])
        assert await client.submit(body(dataset={"items": items}))  # room again


async def test_records_that_would_pass_the_store_bound_are_refused(settings: ApiSettings, rds) -> None:
    store = TaskStore(rds, settings.namespace, max_store_bytes=20_000)
    task_id, _ = await store.submit({"name": "t"}, [{"prompt": "x" * 15_000}], 1)
    assert await store.claim("w", lease_s=60, max_attempts=3) == task_id
    with pytest.raises(StoreFull, match="max_store_bytes"):  # the whole store's bound, as a worker meets it
        await store.append(task_id, "w", "0:0", big_record(0, random.Random(1)), ok=True)
    assert (await store.get(task_id)).done == 0  # type: ignore[union-attr]


async def test_a_task_whose_records_pass_their_bound_is_refused_them(settings: ApiSettings, rds) -> None:
    store = TaskStore(rds, settings.namespace, max_task_bytes=30_000)
    task_id, _ = await store.submit({"name": "t"}, [], 10)
    assert await store.claim("w", lease_s=60, max_attempts=3) == task_id
    rng = random.Random(2)
    with pytest.raises(StoreFull, match="max_task_result_bytes"):
        for i in range(10):
            await store.append(task_id, "w", f"{i}:0", big_record(i, rng), ok=True)
    t = await store.get(task_id)
    assert t is not None and 0 < t.done < 10 and t.bytes <= 30_000


# -------------------------------------------------------------------------------------------------- tenants


async def test_a_tenant_sees_reads_and_cancels_only_its_own_tasks(settings: ApiSettings, start_api) -> None:
    server = await start_api(settings.model_copy(update={"max_tasks": 0, "token": ADMIN, "tenants": TENANTS}))
    async with httpx.AsyncClient(base_url=server.url) as http:
        mine = (await http.post("/v1/evals", json=body(), headers=auth("token-a"))).json()["id"]
        theirs = (await http.post("/v1/evals", json=body(), headers=auth("token-b"))).json()["id"]
        for method, path, params in (("GET", f"/v1/evals/{mine}", {}), ("GET", f"/v1/evals/{mine}/results", {}),
                                     ("GET", f"/v1/evals/{mine}/events", {}),
                                     ("DELETE", f"/v1/evals/{mine}", {}),
                                     ("DELETE", f"/v1/evals/{mine}", {"purge": "true"})):
            r = await http.request(method, path, params=params, headers=auth("token-b"))
            unknown = await http.request(method, path.replace(mine, "0" * 32), params=params,
                                         headers=auth("token-b"))
            assert r.status_code == 404 and r.json() == {"detail": f"no evaluation task {mine!r}"}, (path, r.text)
            assert unknown.status_code == 404  # the same answer as an id that does not exist
        assert (await http.get(f"/v1/evals/{mine}", headers=auth("token-a"))).json()["status"] == "queued"
        r = await http.get("/v1/evals/compare", params={"a": theirs, "b": mine}, headers=auth("token-b"))
        assert r.status_code == 404 and mine in r.json()["detail"] and "(query parameter b)" in r.json()["detail"]

        def ids(r: httpx.Response) -> list[str]:
            assert r.status_code == 200, r.text
            return [e["id"] for e in r.json()["evals"]]

        assert ids(await http.get("/v1/evals", headers=auth("token-a"))) == [mine]
        assert ids(await http.get("/v1/evals", headers=auth("token-b"))) == [theirs]
        assert ids(await http.get("/v1/evals", headers=auth("token-ops"))) == [theirs, mine]  # admin: all
        assert ids(await http.get("/v1/evals", headers=auth(ADMIN))) == [theirs, mine]  # the shared token: admin
        assert ids(await http.get("/v1/evals", headers=auth("token-ro"))) == []  # its own: none
        listed = (await http.get("/v1/evals", headers=auth("token-ops"))).json()["evals"]
        assert [e["tenant"] for e in listed] == ["team-b", "team-a"]

        # scopes: read-only cannot submit or cancel; 403 says which scope is missing
        r = await http.post("/v1/evals", json=body(), headers=auth("token-ro"))
        assert r.status_code == 403 and "'submit'" in r.json()["detail"]
        r = await http.delete(f"/v1/evals/{mine}", headers=auth("token-ro"))
        assert r.status_code == 403 and "'cancel'" in r.json()["detail"]
        assert (await http.get("/v1/environments", headers=auth("token-ro"))).status_code == 200
        r = await http.post("/v1/evals", json=body(), headers=auth("not-a-token"))
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"

        # an admin acts on any tenant's task
        r = await http.delete(f"/v1/evals/{mine}", headers=auth("token-ops"))
        assert r.status_code == 200 and r.json()["status"] == "cancelled" and r.json()["tenant"] == "team-a"

        # /healthz: liveness only, open; /v1/status: admin
        assert (await http.get("/healthz")).json() == {"status": "ok", "redis": True}
        assert (await http.get("/v1/status", headers=auth("token-a"))).status_code == 403
        status = (await http.get("/v1/status", headers=auth("token-ops"))).json()
        assert status["tasks"]["queued"] == 1 and status["tasks"]["cancelled"] == 1 and status["queued"] == 1
        assert status["tenants"] == ["default", "team-a", "team-b", "viewer", "ops"] and status["running"] == []


def test_tenant_names_and_tokens_must_be_unique() -> None:
    with pytest.raises(ValueError, match="unique"):
        ApiSettings(tenants=[Tenant(name="a", token="t1"), Tenant(name="a", token="t2")])
    with pytest.raises(ValueError, match="unique"):
        ApiSettings(token="t1", tenants=[Tenant(name="a", token="t1")])
    with pytest.raises(ValueError, match="unique"):
        ApiSettings(token="t1", tenants=[Tenant(name="default", token="t2")])
    with pytest.raises(ValueError):
        Tenant(name="a b", token="t")


async def test_model_urls_off_the_allow_list_are_422_before_any_connection(settings: ApiSettings,
                                                                           start_api) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.2", 0))  # loopback, but not on the default list (127.0.0.1, ::1, localhost)
    listener.listen(16)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    try:
        server = await start_api(settings.model_copy(update={"max_tasks": 1}))  # a worker would run a task
        async with httpx.AsyncClient(base_url=server.url) as http:
            for model, field in (({"url": f"http://127.0.0.2:{port}"}, "url"),
                                 ({"openai_url": f"http://127.0.0.2:{port}/v1"}, "openai_url"),
                                 ({"url": f"http://127.1:{port}"}, "url"),  # another spelling: not on the list
                                 ({"url": f"http://[::ffff:127.0.0.2]:{port}"}, "url")):
                r = await http.post("/v1/evals", json=body(model=model))
                assert r.status_code == 422, r.text
                (err,) = r.json()["detail"]
                assert err["loc"] == ["body", "model", field] and "model hosts" in err["msg"], err
            for ok in ("http://127.0.0.1:9", "http://localhost:9", "http://[::1]:9"):
                r = await http.post("/v1/evals", json=body(model={"url": ok}), headers={"Idempotency-Key": ok})
                assert r.status_code == 202, (ok, r.text)
            assert len((await http.get("/v1/evals")).json()["evals"]) == 3
            await asyncio.sleep(0.3)  # time for a worker to have tried, had anything been queued
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody ever connected
        wider = await start_api(settings.model_copy(update={"max_tasks": 0, "model_hosts": ["127.0.0.0/8"]}))
        async with httpx.AsyncClient(base_url=wider.url) as http:
            r = await http.post("/v1/evals", json=body(model={"url": f"http://127.0.0.2:{port}"}))
            assert r.status_code == 202, r.text
    finally:
        listener.close()


def test_serve_settings_come_from_a_file_with_flags_on_top(tmp_path: Path) -> None:
    from agentrl.api.cli import serve_settings
    from agentrl.errors import ConfigError

    cfg = tmp_path / "serve.yaml"
    cfg.write_text("tenants:\n  - {name: team-a, token: tok-a, scopes: [submit, read]}\n"
                   "model_hosts: [127.0.0.1, 10.0.0.0/8]\nfinished_ttl_s: 86400\nmax_tasks: 4\n")
    s = serve_settings(cfg, max_tasks=1, token=None, model_hosts=None)
    assert s.max_tasks == 1 and s.finished_ttl_s == 86400 and s.model_hosts == ["127.0.0.1", "10.0.0.0/8"]
    assert [(t.name, sorted(x.value for x in t.scopes)) for t in s.all_tenants()] == [("team-a", ["read", "submit"])]
    cfg.write_text("tenants:\n  - {name: team-a, token: tok-a, scopes: [write]}\n")
    with pytest.raises(ConfigError, match="scopes"):
        serve_settings(cfg)


# ------------------------------------------------------------------------------------- store: worker side, upgrade


async def test_every_state_change_keeps_the_status_indexes_exact(settings: ApiSettings, rds) -> None:
    store = TaskStore(rds, settings.namespace)

    async def by_status() -> dict[str, set[str]]:
        out: dict[str, set[str]] = {}
        for st in TaskStatus:
            tasks, _ = await store.list_page(ListQuery(status=st, limit=500))
            out[st.value] = {t.id for t in tasks}
            assert all(t.status is st for t in tasks)
        return out

    a, _ = await store.submit({"name": "a"}, [], 2)
    b, _ = await store.submit({"name": "b"}, [], 2)
    assert (await by_status())["queued"] == {a, b}
    assert await store.claim("w1", lease_s=0.05, max_attempts=3) == a
    assert (await by_status())["running"] == {a}
    await asyncio.sleep(0.2)  # past the lease
    assert await store.reap() == 1  # w1 "died": a is queued again
    assert (await by_status())["queued"] == {a, b} and (await by_status())["running"] == set()
    assert await store.claim("w2", lease_s=60, max_attempts=3) == a
    assert await store.append(a, "w2", "0:0", json.dumps({"item_index": 0, "x": "é"}), ok=True)
    assert await store.load_records(a) == [{"item_index": 0, "x": "é"}]  # decompressed as it was given
    assert await store.release(a, "w2")
    assert await store.claim("w3", lease_s=60, max_attempts=3) == a
    assert await store.finish(a, "w3", TaskStatus.SUCCEEDED, metrics={"n": 1})
    await store.cancel(b)
    assert await by_status() == {"queued": set(), "running": set(), "succeeded": {a}, "failed": set(),
                                 "cancelled": {b}}
    assert await store.counts() == {"queued": 0, "running": 0, "succeeded": 1, "failed": 0, "cancelled": 1}
    assert await store.expire(3600) == 0 and await store.expire(0) == 2  # both finished: both purged
    assert await store.counts() == dict.fromkeys(await store.counts(), 0) and await store.stored_bytes() == 0


async def test_tasks_stored_by_an_older_version_are_indexed_at_start(settings: ApiSettings, start_api, rds) -> None:
    ns = settings.namespace
    legacy = {}
    for i, status in enumerate(("succeeded", "queued", "cancelled")):  # as the store wrote them before issue 23
        task_id = f"legacy{i}"
        spec = body(labels={"team": "old"}, environment={"name": "math" if i else "retool"})
        await rds.hset(f"{ns}:task:{task_id}", mapping={
            "status": status, "spec": json.dumps(spec), "total": 4, "done": 1, "errors": 0, "attempts": 1,
            "created_at": repr(1_700_000_000.0 + i), "finished_at": repr(1_700_000_100.0)})
        await rds.set(f"{ns}:items:{task_id}", json.dumps([{"id": "0", "prompt": "q"}]))
        await rds.rpush(f"{ns}:results:{task_id}", json.dumps({"item_index": 0, "sample_index": 0}))
        await rds.zadd(f"{ns}:index", {task_id: 1_700_000_000.0 + i})
        legacy[status] = task_id
    await rds.rpush(f"{ns}:queue", legacy["queued"])
    server = await start_api(settings.model_copy(update={"max_tasks": 0, "token": ADMIN}))
    async with AsyncEvalClient(server.url, token=ADMIN) as client:
        new = await client.submit(body(labels={"team": "old"}))
        assert [e["id"] async for e in client.iter_evals(page_size=2)] == [new, "legacy2", "legacy1", "legacy0"]
        assert {e["id"] async for e in client.iter_evals(environment="math", labels={"team": "old"})} == \
            {"legacy1", "legacy2"}
        assert {e["id"] async for e in client.iter_evals(status="queued")} == {new, "legacy1"}
        assert (await client.results("legacy0"))["records"] == [{"item_index": 0, "sample_index": 0}]  # plain JSON
        assert (await client.get("legacy0"))["tenant"] == "default"
        stored = (await client.status())["stored_bytes"]
        await client.purge("legacy0")
        assert (await client.status())["stored_bytes"] < stored
    assert not await rds.exists(f"{ns}:index", f"{ns}:task:legacy0", f"{ns}:results:legacy0")
