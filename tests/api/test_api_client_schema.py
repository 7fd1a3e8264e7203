"""The Python client against the server's OpenAPI schema, over a real uvicorn API and Redis (queue only): every
operation of the schema has a client method and every client method an operation; every request the client
makes is an operation of the schema with only the parameters it declares, and every JSON answer validates
against the response schema the operation declares (the typed models: records, metrics, datasets, ...)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from api_support import body

from agentrl.api import ApiSettings
from agentrl.client import OPERATIONS, ApiError, AsyncEvalClient, EvalClient

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from openai_support import FakeOpenAI, Reply, Served  # noqa: E402


class Recording(httpx.AsyncBaseTransport):
    """A real HTTP transport that remembers each exchange."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.seen: list[tuple[httpx.Request, httpx.Response]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        if response.headers.get("content-type", "").startswith("application/json"):
            await response.aread()
        self.seen.append((request, response))
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()


def find_operation(schema: dict[str, Any], method: str, path: str) -> tuple[str, dict[str, Any]]:
    for template, methods in schema["paths"].items():
        pattern = "^" + re.sub(r"\{[^}]+\}", "[^/]+", template) + "$"
        if re.match(pattern, path) and method.lower() in methods:
            return template, methods[method.lower()]
    raise AssertionError(f"{method} {path} is not an operation of the schema")


def test_every_operation_has_a_client_method_and_back() -> None:
    from agentrl.api import create_app

    schema = create_app(ApiSettings()).openapi()
    ids = {op["operationId"] for methods in schema["paths"].values() for op in methods.values()}
    assert ids == set(OPERATIONS)
    for method in OPERATIONS.values():
        assert callable(getattr(AsyncEvalClient, method)) and callable(getattr(EvalClient, method))


def solver(body: dict[str, Any], turn: int) -> str:
    question = next(m["content"] for m in body["messages"] if m["role"] == "user")
    a, op, b = question.removeprefix("What is ").rstrip("?").split()
    return f"\\boxed{{{int(a) + int(b)}}}"


async def test_the_client_speaks_the_schema(settings: ApiSettings, start_api, tmp_path: Path) -> None:
    (tmp_path / "mini.jsonl").write_text("".join(
        json.dumps({"prompt": f"What is {i} + 1?", "answer": str(i + 1), "level": i % 2}) + "\n" for i in range(3)))
    server = await start_api(settings)
    transport = Recording()
    async with Served(FakeOpenAI(solver)) as fake, Served(FakeOpenAI(lambda b, t: Reply("", delay_s=2))) as slow, \
            AsyncEvalClient(server.url, transport=transport) as client:
        schema = (await client._http.get("/openapi.json")).json()
        model = {"openai_url": fake.url, "openai_model": "fake-model"}
        a = await client.submit(body(dataset={"name": "mini"}, model=model))
        b = await client.submit(body(dataset={"name": "mini"}, model=model, group_by="level"))
        queued = await client.submit(body(dataset={"name": "mini"}, model={"openai_url": slow.url,
                                                                           "openai_model": "fake-model"}))
        assert (await client.cancel(queued))["status"] == "cancelled"  # queued or running
        for task in (a, b):
            await client.wait(task, poll_s=0.05, timeout_s=60)
        state = await client.get(b)
        assert state["metrics"]["groups"] and state["metrics"]["intervals"]["accuracy"]["method"] == "bootstrap"
        await client.list_evals(limit=5, status="succeeded")
        first = await client.list_page(limit=1, environment="retool", created_after=0.0)
        assert first["has_more"] and len((await client.list_page(limit=5, after=first["next_cursor"]))["evals"]) == 2
        again = await client.submit(body(dataset={"name": "mini"}, model=model), idempotency_key="k1")
        assert await client.submit(body(dataset={"name": "mini"}, model=model), idempotency_key="k1") == again  # 200
        page = await client.results(a, offset=0, limit=10, trajectories=True)
        assert page["records"] and page["records"][0]["transcript"]
        with pytest.raises(ApiError) as info:
            await client.cancel(a)  # already succeeded: a clear 409
        assert info.value.status == 409
        events = [e async for e in client.events(a)]
        assert events[-1]["event"] == "end" and events[-1]["data"]["status"] == "succeeded"
        assert [e["event"] for e in [x async for x in client.events(queued)]][-1] == "end"
        assert (await client.compare(a, b, metric="pass@1"))["n"] == 3
        with pytest.raises(ApiError) as info:
            await client.compare(a, "nope")
        assert info.value.status == 404
        assert [d["name"] for d in await client.datasets()].count("mini") == 1
        assert (await client.dataset("mini"))["latest"] == "default"
        await client.environments()
        await client.health()
        await client.wait(again, poll_s=0.05, timeout_s=60)
        assert (await client.status())["tasks"]["succeeded"] == 3
        await client.purge(again)  # 204, no body
    called = set()
    for request, response in transport.seen:
        if request.url.path == "/openapi.json":
            continue
        template, op = find_operation(schema, request.method, request.url.path)
        called.add(op["operationId"])
        declared = {p["name"] for p in op.get("parameters", []) if p["in"] == "query"}
        assert set(request.url.params) <= declared, (template, dict(request.url.params))
        status = str(response.status_code)
        assert status in op["responses"], (template, status)
        content = op["responses"][status].get("content", {})
        if response.headers.get("content-type", "").startswith("application/json"):
            target = content["application/json"]["schema"]
            jsonschema.Draft202012Validator({**target, "components": schema["components"]}).validate(response.json())
        elif status != "204":
            assert "text/event-stream" in content, template
    assert called == set(OPERATIONS)
