"""``GET /v1/evals/compare`` over a real uvicorn API and Redis, on two real runs of the same items against fake
OpenAI-compatible servers (one solves every item, one answers 0): the difference, its interval and McNemar's exact
p-value; per-group intervals in the task's metrics; clear 4xx for unknown runs, metrics and unrelated runs."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import httpx
from api_support import body

from agentrl.api import ApiSettings
from agentrl.client import AsyncEvalClient

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from openai_support import FakeOpenAI, Served  # noqa: E402

ITEMS = [{"prompt": f"What is {a} + {b}?", "answer": str(a + b), "level": "easy" if a < 4 else "hard"}
         for a, b in [(1, 2), (2, 3), (3, 4), (4, 5), (5, 6), (6, 7)]]


def solver(right: bool):
    def script(body: dict[str, Any], turn: int) -> str:
        question = next(m["content"] for m in body["messages"] if m["role"] == "user")
        a, _, b = question.removeprefix("What is ").rstrip("?").split()
        return f"\\boxed{{{int(a) + int(b) if right else 0}}}"
    return script


def spec(url: str, items: list[dict[str, Any]] = ITEMS) -> dict[str, Any]:
    return body(model={"openai_url": url, "openai_model": "fake-model"}, dataset={"items": items},
                samples_per_item=1, pass_k=[1], group_by="level")


async def test_compare_two_runs_paired_over_items(settings: ApiSettings, start_api) -> None:
    server = await start_api(settings)
    async with Served(FakeOpenAI(solver(True))) as good, Served(FakeOpenAI(solver(False))) as bad, \
            AsyncEvalClient(server.url) as client, httpx.AsyncClient(base_url=server.url) as http:
        a = await client.submit(spec(bad.url))
        b = await client.submit(spec(good.url))
        other = await client.submit(spec(good.url, [{"prompt": "What is 9 + 9?", "answer": "18"}]))
        states = [await client.wait(i, poll_s=0.05, timeout_s=60) for i in (a, b, other)]
        r = await http.get("/v1/evals/compare", params={"a": a, "b": b})
        assert r.status_code == 200, r.text
        c = r.json()
        assert (c["n"], c["mean_a"], c["mean_b"], c["difference"]) == (6, 0.0, 1.0, 1.0)
        assert c["test"] == "mcnemar-exact" and c["discordant"] == [6, 0]
        assert math.isclose(c["p_value"], 2 / 2**6) and c["significant"] is True
        assert c["low"] == c["high"] == 1.0 and c["status_a"] == c["status_b"] == "succeeded"
        same = (await http.get("/v1/evals/compare", params={"a": b, "b": b, "metric": "pass@1"})).json()
        assert same["difference"] == 0.0 and same["p_value"] == 1.0 and same["significant"] is False

        assert (await http.get("/v1/evals/compare", params={"a": a, "b": "nope"})).status_code == 404
        r = await http.get("/v1/evals/compare", params={"a": a, "b": b, "metric": "f1"})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["query", "metric"]
        r = await http.get("/v1/evals/compare", params={"a": a, "b": other})
        assert r.status_code == 422 and "no item both scored" in r.json()["detail"][0]["msg"]
    groups = states[1]["metrics"]["groups"]
    assert set(groups) == {"easy", "hard"} and groups["easy"]["num_items"] == 3
    assert groups["hard"]["intervals"]["accuracy"]["method"] == "clopper-pearson"
    hard = groups["hard"]["intervals"]["accuracy"]  # 3 of 3: the exact lower bound solves p**3 = 0.025
    assert math.isclose(hard["low"], 0.025 ** (1 / 3)) and hard["high"] == 1.0
