"""The REST API's answers to bad input and to missing credentials, over a real uvicorn server with a real Redis
(no SGLang: the service only queues here, ``max_tasks=0``). Every client mistake is a 4xx with a clear body."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from api_support import body

from agentrl.api import ApiSettings

TOKEN = "t0ken-for-tests"


@pytest.fixture
async def api(settings: ApiSettings, start_api, tmp_path: Path):
    server = await start_api(settings.model_copy(update={"token": TOKEN, "max_tasks": 0}))
    async with httpx.AsyncClient(base_url=server.url, headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        yield http


def field_errors(resp: httpx.Response) -> dict[tuple, str]:
    assert resp.status_code == 422, resp.text
    detail = resp.json()["detail"]
    assert isinstance(detail, list) and all({"loc", "msg", "type"} <= set(e) for e in detail), detail
    return {tuple(e["loc"]): e["msg"] for e in detail}


async def test_bearer_token_is_required_on_v1_routes(api: httpx.AsyncClient) -> None:
    async with httpx.AsyncClient(base_url=str(api.base_url)) as anon:
        for method, path in (("GET", "/v1/environments"), ("GET", "/v1/evals/x"), ("DELETE", "/v1/evals/x"),
                             ("GET", "/v1/evals/x/results"), ("GET", "/v1/evals")):
            r = await anon.request(method, path)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", (path, r.text)
            assert "bearer token" in r.json()["detail"]
        r = await anon.post("/v1/evals", json=body(), headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
        r = await anon.post("/v1/evals", json=body(), headers={"Authorization": "Basic dTpw"})
        assert r.status_code == 401
        assert (await anon.get("/healthz")).status_code == 200
        assert (await anon.get("/openapi.json")).status_code == 200
    assert (await api.get("/v1/environments")).status_code == 200


async def test_invalid_payloads_get_field_errors(api: httpx.AsyncClient, tmp_path: Path) -> None:
    r = await api.post("/v1/evals", content=b'{"dataset": ', headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["detail"][0]["type"] == "json_invalid"
    errs = field_errors(await api.post("/v1/evals", json={"model": {"name": "tiny"}}))
    assert ("body", "dataset") in errs
    errs = field_errors(await api.post("/v1/evals", json=body(pass_k=[3])))
    assert any("pass_k" in m for m in errs.values())
    errs = field_errors(await api.post("/v1/evals", json=body(samples_per_item="many")))
    assert ("body", "samples_per_item") in errs
    errs = field_errors(await api.post("/v1/evals", json=body(extra_field=1)))
    assert ("body", "extra_field") in errs
    errs = field_errors(await api.post("/v1/evals", json=[1, 2]))
    assert ("body",) in errs
    assert field_errors(await api.get("/v1/evals/x/results", params={"limit": 0})).keys() == {("query", "limit")}


@pytest.mark.parametrize("patch, loc, words", [
    ({"dataset": {"path": "missing.jsonl"}}, ("body", "dataset", "path"), "does not exist"),
    ({"dataset": {"path": "/etc/hostname.jsonl"}}, ("body", "dataset", "path"), "outside the directories"),
    ({"dataset": {"name": "gsm8k"}}, ("body", "dataset", "name"), "arithmetic:heldout"),
    ({"model": {"path": "{tmp}/nonexistent-model"}}, ("body", "model", "path"), "not a model folder"),
    ({"model": {"path": "/etc"}}, ("body", "model", "path"), "outside the directories"),
    ({"model": {"path": "{tmp}/../elsewhere"}}, ("body", "model", "path"), "outside the directories"),
    ({"model": {"name": "tiny", "tokenizer": "/etc"}}, ("body", "model", "tokenizer"), "outside the directories"),
    ({"model": {"run": "nope", "version": 2}}, ("body", "model", "version"), "no weight version 2"),
    ({"environment": {"name": "retool", "options": {"bogus": 1}}}, ("body", "environment", "options"), "bogus"),
])
async def test_references_the_server_cannot_resolve_are_field_errors(api: httpx.AsyncClient, patch: dict,
                                                                    loc: tuple, words: str, tmp_path: Path) -> None:
    patch = json.loads(json.dumps(patch).replace("{tmp}", str(tmp_path)))  # tmp_path is the server's model root
    errs = field_errors(await api.post("/v1/evals", json=body(**patch)))
    assert loc in errs and words in errs[loc], errs


async def test_unknown_environment_is_404_naming_the_known_ones(api: httpx.AsyncClient) -> None:
    r = await api.post("/v1/evals", json=body(environment={"name": "chess"}))
    assert r.status_code == 404
    assert "chess" in r.json()["detail"] and "retool" in r.json()["detail"]
    assert "retool" in r.json()["known_environments"]


async def test_unknown_task_is_404(api: httpx.AsyncClient) -> None:
    for method, path in (("GET", "/v1/evals/deadbeef"), ("GET", "/v1/evals/deadbeef/results"),
                         ("DELETE", "/v1/evals/deadbeef")):
        r = await api.request(method, path)
        assert r.status_code == 404 and "deadbeef" in r.json()["detail"]


async def test_oversized_payloads_are_413(api: httpx.AsyncClient) -> None:
    items = [{"prompt": "x" * 2000, "answer": "1"} for _ in range(200)]  # ~400 KB > 256 KiB
    r = await api.post("/v1/evals", json=body(dataset={"items": items}))
    assert r.status_code == 413 and "bytes" in r.json()["detail"]

    async def chunks():  # no Content-Length: the limit holds on the streamed body too
        payload = json.dumps(body(dataset={"items": items})).encode()
        for i in range(0, len(payload), 8192):
            yield payload[i:i + 8192]

    r = await api.post("/v1/evals", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413


async def test_queued_task_lifecycle_without_workers(api: httpx.AsyncClient, tmp_path: Path) -> None:
    (tmp_path / "ds.jsonl").write_text("".join(json.dumps({"prompt": f"q{i}", "answer": i}) + "\n"
                                               for i in range(3)))
    r = await api.post("/v1/evals", json=body(dataset={"path": str(tmp_path / "ds.jsonl")}, name="file"))
    assert r.status_code == 202, r.text
    created = r.json()
    eid = created["id"]
    assert created["status"] == "queued" and created["progress"] == {"done": 0, "total": 6, "errors": 0,
                                                                     "fraction": 0.0}
    assert r.headers["location"] == f"/v1/evals/{eid}" == created["links"]["self"]
    state = (await api.get(f"/v1/evals/{eid}")).json()
    assert state["status"] == "queued" and state["name"] == "file" and state["metrics"] is None
    assert state["spec"]["dataset"]["path"] == str(tmp_path / "ds.jsonl")
    page = (await api.get(f"/v1/evals/{eid}/results")).json()
    assert page["records"] == [] and page["total"] == 0 and page["next_offset"] is None
    listed = (await api.get("/v1/evals", params={"status": "queued"})).json()["evals"]
    assert [e["id"] for e in listed] == [eid]
    r = await api.delete(f"/v1/evals/{eid}")
    assert r.status_code == 200 and r.json()["status"] == "cancelled" and r.json()["finished_at"]
    assert (await api.delete(f"/v1/evals/{eid}")).json()["status"] == "cancelled"  # idempotent
    assert (await api.get("/healthz")).json() == {"status": "ok", "redis": True}  # liveness only
    status = (await api.get("/v1/status")).json()
    assert status["queued"] == 0 and status["tasks"]["cancelled"] == 1 and status["running"] == []


async def test_registered_dataset_and_environment_listing(api: httpx.AsyncClient) -> None:
    r = await api.post("/v1/evals", json=body(dataset={"name": "arithmetic:heldout", "n": 5, "seed": 2},
                                              samples_per_item=3, pass_k=[1, 3]))
    assert r.status_code == 202 and r.json()["progress"]["total"] == 15
    envs = {e["name"]: e for e in (await api.get("/v1/environments")).json()["environments"]}
    assert envs["retool"]["stop"] == ["</code>"] and envs["retool"]["description"]


async def test_openapi_has_examples_and_the_bearer_scheme(api: httpx.AsyncClient) -> None:
    doc = (await api.get("/openapi.json")).json()
    assert {"/v1/evals", "/v1/evals/{eval_id}", "/v1/evals/{eval_id}/results", "/v1/environments",
            "/healthz"} <= set(doc["paths"])
    post = doc["paths"]["/v1/evals"]["post"]
    example = post["requestBody"]["content"]["application/json"]["examples"]["retool"]["value"]
    assert example["pass_k"] == [1, 4] and example["model"] == {"name": "tiny"}
    assert {"202", "401", "404", "413", "422"} <= set(post["responses"])
    assert doc["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    assert doc["components"]["schemas"]["EvalState"]["examples"][0]["metrics"]["pass@4"] == 1.0


async def test_queued_tasks_survive_an_api_restart(settings: ApiSettings, start_api) -> None:
    s = settings.model_copy(update={"max_tasks": 0})
    first = await start_api(s)
    async with httpx.AsyncClient(base_url=first.url) as http:
        eid = (await http.post("/v1/evals", json=body())).json()["id"]
    await first.stop()
    second = await start_api(s)
    async with httpx.AsyncClient(base_url=second.url) as http:
        state = (await http.get(f"/v1/evals/{eid}")).json()
    assert state["status"] == "queued" and state["progress"]["total"] == 4


async def test_a_task_whose_engine_is_unreachable_fails_with_the_reason(settings: ApiSettings, start_api) -> None:
    from agentrl.client import AsyncEvalClient
    from agentrl.engine.server import free_port

    server = await start_api(settings.model_copy(update={"max_tasks": 1}))
    async with AsyncEvalClient(server.url) as client:
        eval_id = await client.submit(body(f"http://127.0.0.1:{free_port()}"))  # nothing listens there
        state = await client.wait(eval_id, poll_s=0.1, timeout_s=60)
    assert state["status"] == "failed" and "no SGLang server answers" in state["error"]
    assert state["progress"]["done"] == 0 and state["finished_at"] is not None
