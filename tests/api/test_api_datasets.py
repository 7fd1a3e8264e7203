"""``GET /v1/datasets`` and named datasets in specs over a real uvicorn API and Redis (queue only: no model runs):
files under the server's dataset root are listed with versions and sha256; a spec naming one is stored with the
version and hash it resolved to; unknown names, versions and a stale pinned hash are 4xx with clear messages."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import httpx
from api_support import body

from agentrl.api import ApiSettings


async def test_datasets_are_listed_and_named_in_specs(settings: ApiSettings, start_api, tmp_path: Path) -> None:
    bench = tmp_path / "bench"
    bench.mkdir()
    for version, n in (("v1", 2), ("v2", 3)):
        (bench / f"{version}.jsonl").write_text(
            "".join(json.dumps({"prompt": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n" for i in range(n)))
    digest = {v: hashlib.sha256((bench / f"{v}.jsonl").read_bytes()).hexdigest() for v in ("v1", "v2")}
    server = await start_api(settings.model_copy(update={"max_tasks": 0}))
    async with httpx.AsyncClient(base_url=server.url) as http:
        listed = (await http.get("/v1/datasets")).json()["datasets"]
        names = [d["name"] for d in listed]
        assert "bench" in names and "arithmetic:heldout" in names
        one = (await http.get("/v1/datasets/bench")).json()
        assert one["latest"] == "v2" and [(v["version"], v["sha256"], v["source"]) for v in one["versions"]] == [
            ("v1", digest["v1"], "file"), ("v2", digest["v2"], "file")]
        r = await http.get("/v1/datasets/nope")
        assert r.status_code == 404 and "GET /v1/datasets" in r.json()["detail"]

        r = await http.post("/v1/evals", json=body(dataset={"name": "bench"}))
        assert r.status_code == 202, r.text
        assert r.json()["progress"]["total"] == 3 * 2  # v2's 3 items x 2 samples
        state = (await http.get(f"/v1/evals/{r.json()['id']}")).json()
        assert state["spec"]["dataset"]["version"] == "v2" and state["spec"]["dataset"]["sha256"] == digest["v2"]
        assert state["dataset"] == {"name": "bench", "version": "v2", "sha256": digest["v2"], "path": None,
                                    "items": None}
        r = await http.post("/v1/evals", json=body(dataset={"name": "bench", "version": "v1",
                                                            "sha256": digest["v1"]}))
        assert r.status_code == 202 and r.json()["progress"]["total"] == 2 * 2

        r = await http.post("/v1/evals", json=body(dataset={"name": "bench", "version": "v9"}))
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "dataset", "version"]
        r = await http.post("/v1/evals", json=body(dataset={"name": "bench", "sha256": digest["v1"]}))
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "dataset", "sha256"]
        r = await http.post("/v1/evals", json=body(dataset={"name": "nope"}))
        assert r.status_code == 422 and "bench" in r.json()["detail"][0]["msg"]
