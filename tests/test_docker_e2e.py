"""The Docker sandbox backend end to end, outside the sandbox tests: `agentrl demo --smoke sandbox.backend=docker`
(one RL step on the session's SGLang server) and a REST evaluation served by `agentrl serve --sandbox docker`.

The tiny model is not relied on to write code: in the run a grammar (``rollout.ebnf``) holds every turn to a <code>
cell that prints whether it runs inside a Docker container (``/.dockerenv``, which the engine puts in every
container and the host does not have), and the retool environment runs it in the run's sandbox; the evaluation's
environment (tests/docker_probe_env.py, loaded with ``--import``) runs the same probe in the service's sandbox as its
reward. Each says "True" only in Docker; the Docker engine also reports execs in agentrl's sandbox containers."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentrl.sandbox import docker_available

pytestmark = [pytest.mark.slow, pytest.mark.docker, pytest.mark.sglang, pytest.mark.redis]  # runs start their Redis

ROOT = Path(__file__).resolve().parents[1]
AGENTRL = [sys.executable, "-m", "agentrl.cli"]
PROBE_ENV = Path(__file__).parent / "docker_probe_env.py"  # not imported here: it registers an environment
PROBE = "import os\nprint(os.path.exists('/.dockerenv'))"  # the same probe as PROBE_ENV's


@pytest.fixture(scope="module", autouse=True)
def docker_engine() -> None:
    why = docker_available()
    if why is not None:
        pytest.skip(f"{why} (CI starts one with scripts/ensure_docker.sh)")


def sandbox_execs(since: float, until: float) -> int:
    """Processes the Docker engine started in agentrl's sandbox containers between the two times."""
    import docker
    from agentrl.sandbox.docker import LABEL

    client = docker.from_env(timeout=30)
    try:
        events = client.events(since=int(since), until=int(until) + 1, decode=True,
                               filters={"type": "container", "label": LABEL})
        return sum(str(e.get("Action", "")).startswith("exec_start") for e in events)
    finally:
        client.close()


def tool_results(trajectory: dict) -> list[list]:
    """[name, status, output, latency_s] of every tool call of a trajectory (its turns as serialised)."""
    return [r for turn in trajectory["turns"] for r in turn[6]]


@pytest.fixture(scope="module")
def docker_smoke(tmp_path_factory: pytest.TempPathFactory, shared_server: str) -> tuple[Path, float, float]:
    runs = tmp_path_factory.mktemp("runs")
    start = time.time()
    cell = "<code>\n" + PROBE + "\n</code>"
    proc = subprocess.run([*AGENTRL, "demo", "--smoke", "sandbox.backend=docker", f"engine.url={shared_server}",
                           f"runs_dir={runs}", "name=smoke-docker", "steps=1", "sft.enabled=false",
                           f"rollout.ebnf={json.dumps('root ::= ' + json.dumps(cell))}", "monitor.live=false",
                           "monitor.prometheus_port=null", "monitor.tensorboard=false"],
                          capture_output=True, text=True, timeout=1200, cwd=ROOT)
    (runs / "driver.log").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, f"see {runs / 'driver.log'}\n" + proc.stdout[-2000:] + proc.stderr[-4000:]
    return runs / "smoke-docker", start, time.time()


def test_smoke_rl_run_on_docker(docker_smoke: tuple[Path, float, float]) -> None:
    run, start, end = docker_smoke
    summary = json.loads((run / "summary.json").read_text())
    assert summary["final_weight_version"] == 1 and summary["books_balanced"], summary
    import yaml

    assert yaml.safe_load((run / "config.yaml").read_text())["sandbox"]["backend"] == "docker"
    rollouts = [json.loads(x) for x in (run / "rollouts.jsonl").read_text().splitlines()]
    ran = [r for t in rollouts for r in tool_results(t)]
    assert len(ran) >= len(rollouts) == 8, ran  # every first turn is the grammar's cell
    assert all((r[1], r[2].strip()) == ("Finished", "True") for r in ran), ran[:3]  # run status, stdout
    assert sandbox_execs(start, end) >= 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def docker_api(tmp_path: Path) -> Iterator[str]:
    """`agentrl serve --sandbox docker` on a free port (its own embedded Redis in its data directory)."""
    import requests

    port = free_port()
    proc = subprocess.Popen([*AGENTRL, "serve", "--port", str(port), "--sandbox", "docker", "--max-sandbox", "2",
                             "--data-dir", str(tmp_path / "api"), "--runs-dir", str(tmp_path / "runs"),
                             "--log-level", "warning", "--import", str(PROBE_ENV)],
                            cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if requests.get(url + "/healthz", timeout=1).ok:
                    break
            except requests.ConnectionError:
                pass
            assert proc.poll() is None, f"agentrl serve exited: {proc.stderr.read()[-2000:]}"  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "agentrl serve did not answer within 60 s"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_rest_evaluation_on_docker(docker_api: str, sglang_url: str) -> None:
    from agentrl.client import EvalClient

    spec = {"environment": {"name": "docker_probe", "options": {}},
            "dataset": {"items": [{"prompt": "Hello.", "answer": "x"}, {"prompt": "Bye.", "answer": "y"}]},
            "model": {"url": sglang_url}, "sampling": {"temperature": 1.0, "max_new_tokens": 8},
            "samples_per_item": 2, "pass_k": [1], "max_turns": 1}
    start = time.time()
    with EvalClient(docker_api, timeout_s=30) as client:
        eval_id = client.submit(spec)
        state = client.wait(eval_id, poll_s=0.5, timeout_s=300)
        records = list(client.iter_results(eval_id, trajectories=False))
    assert state["status"] == "succeeded" and state["progress"]["errors"] == 0, state
    assert len(records) == 4 and state["metrics"]["mean_reward"] == 1.0, (state["metrics"], records)
    assert sandbox_execs(start, time.time()) >= 1
