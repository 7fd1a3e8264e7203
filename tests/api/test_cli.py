"""``agentrl eval CONFIG.yaml``: locally (starting sandbox and checker; the model is the session's SGLang
server by URL) and submitted to a real API server with ``--server``; bad configs exit 1 with a message."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import yaml
from api_support import body
from typer.testing import CliRunner

from agentrl.api import ApiSettings
from agentrl.cli import app


def write_config(tmp_path: Path, url: str) -> Path:
    path = tmp_path / "eval.yaml"
    path.write_text(yaml.safe_dump(body(url, name="cli")))
    return path


def test_bad_configs_exit_1_with_a_message(tmp_path: Path) -> None:
    runner = CliRunner()
    res = runner.invoke(app, ["eval", str(tmp_path / "missing.yaml")])
    assert res.exit_code == 1 and "does not exist" in res.output
    cfg = write_config(tmp_path, "http://127.0.0.1:9")
    res = runner.invoke(app, ["eval", str(cfg), "samples_per_item=0"])
    assert res.exit_code == 1 and "samples_per_item" in res.output


@pytest.mark.sglang
def test_local_eval_writes_records_and_prints_metrics(tmp_path: Path, sglang_url: str) -> None:
    out = tmp_path / "records.jsonl"
    res = CliRunner().invoke(app, ["eval", str(write_config(tmp_path, sglang_url)), "samples_per_item=1",
                                   "pass_k=[1]", "--out", str(out)])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout[res.stdout.index("{"):])
    assert summary["status"] == "succeeded" and summary["progress"] == {"done": 2, "total": 2}
    assert summary["metrics"]["num_samples"] == 2 and "pass@1" in summary["metrics"]
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted(r["item_index"] for r in lines) == [0, 1] and all(r["trajectory"] for r in lines)


@pytest.mark.sglang
async def test_eval_submits_to_a_server(tmp_path: Path, sglang_url: str, settings: ApiSettings, start_api) -> None:
    server = await start_api(settings.model_copy(update={"token": "cli-token"}))
    out = tmp_path / "records.jsonl"
    args = ["eval", str(write_config(tmp_path, sglang_url)), "--server", server.url, "--out", str(out)]
    res = await asyncio.to_thread(CliRunner().invoke, app, args, env={"AGENTRL_API_TOKEN": "cli-token"})
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout[res.stdout.index("{"):])
    assert summary["status"] == "succeeded" and summary["metrics"]["num_samples"] == 4
    assert len(out.read_text().splitlines()) == 4
    res = await asyncio.to_thread(CliRunner().invoke, app, args[:4], env={"AGENTRL_API_TOKEN": "wrong"})
    assert res.exit_code == 1 and "401" in res.output
