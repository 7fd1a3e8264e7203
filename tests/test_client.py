"""The REST client's retries (agentrl/client.py): reads are retried while the server is busy or unreachable, a
submission too, with one Idempotency-Key across its retries, and what it gives up on is an ApiError with the
status (0: unreachable). A scripted
transport stands in for the server here; the client against a real ``agentrl serve`` is tested in tests/api/."""

from __future__ import annotations

import httpx
import pytest

from agentrl.client import ApiError, AsyncEvalClient, EvalClient
from agentrl.engine.server import free_port


class Script:
    """Answers each request with the next status of ``statuses`` (the last one repeats)."""

    def __init__(self, *statuses: int) -> None:
        self.statuses, self.hits, self.keys = list(statuses), list[str](), list[str | None]()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.hits.append(f"{request.method} {request.url.path}")
        self.keys.append(request.headers.get("Idempotency-Key"))
        status = self.statuses.pop(0) if len(self.statuses) > 1 else self.statuses[0]
        return httpx.Response(status, json={"status": "ok", "id": "e1"} if status < 400 else {"detail": "busy"})


async def test_reads_are_retried_through_busy_answers() -> None:
    script = Script(503, 502, 200)
    async with AsyncEvalClient("http://api", retries=2, transport=httpx.MockTransport(script)) as c:
        assert (await c.health())["status"] == "ok"
    assert script.hits == ["GET /healthz"] * 3


async def test_reads_give_up_with_the_last_status() -> None:
    script = Script(503)
    async with AsyncEvalClient("http://api", retries=1, transport=httpx.MockTransport(script)) as c:
        with pytest.raises(ApiError) as err:
            await c.get("e1")
    assert err.value.status == 503 and err.value.detail == "busy" and len(script.hits) == 2


async def test_a_submission_is_retried_with_one_idempotency_key() -> None:
    script = Script(503, 502, 202)
    async with AsyncEvalClient("http://api", retries=5, transport=httpx.MockTransport(script)) as c:
        assert await c.submit({"environment": "x"}) == "e1"
        first = script.keys[:]
        assert await c.submit({"environment": "x"}, idempotency_key="mine") == "e1"
    assert script.hits == ["POST /v1/evals"] * 4
    assert first[0] is not None and first == [first[0]] * 3  # the same key on every retry of one submission
    assert script.keys[3] == "mine"


async def test_a_refused_submission_is_not_retried() -> None:
    for status in (409, 422, 507):
        script = Script(status, 202)
        async with AsyncEvalClient("http://api", retries=5, transport=httpx.MockTransport(script)) as c:
            with pytest.raises(ApiError) as err:
                await c.submit({"environment": "x"})
        assert err.value.status == status and script.hits == ["POST /v1/evals"]


async def test_an_unreachable_server_is_status_0_after_the_retries() -> None:
    async with AsyncEvalClient(f"http://127.0.0.1:{free_port()}", retries=1) as c:
        with pytest.raises(ApiError, match="cannot reach the server") as err:
            await c.health()
    assert err.value.status == 0


def test_the_blocking_client_retries_the_same_way() -> None:
    script = Script(504, 200)
    with EvalClient("http://api", retries=1, transport=httpx.MockTransport(script)) as c:
        assert c.health()["status"] == "ok"
    assert script.hits == ["GET /healthz"] * 2
    script = Script(503, 200)
    with EvalClient("http://api", retries=5, transport=httpx.MockTransport(script)) as c:
        assert c.submit({"environment": "x"}) == "e1"
    assert script.hits == ["POST /v1/evals"] * 2 and script.keys[0] == script.keys[1] is not None
    script = Script(422, 200)
    with EvalClient("http://api", retries=5, transport=httpx.MockTransport(script)) as c:
        with pytest.raises(ApiError) as err:
            c.submit({"environment": "x"})
    assert err.value.status == 422 and script.hits == ["POST /v1/evals"]
    with EvalClient(f"http://127.0.0.1:{free_port()}", retries=0) as c:
        with pytest.raises(ApiError, match="cannot reach the server"):
            c.health()
