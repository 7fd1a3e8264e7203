"""Two Ray nodes on one machine, and a run that relies on no directory shared with the rollout side.

The test starts a Ray head node offering ``{"trainer_node": 2}`` and a second node offering ``{"rollout_node": 1}``
(``ray start --block``, each with its own temp dir), Debian's Redis 7 with its append-only file on, and then
``agentrl train`` with ``resources.ray_address``, ``weight_sync: distributed``, two SGLang servers and two trainer
ranks: the rollout actor (and the SGLang servers it starts) can only land on the second node, the trainer ranks
only on the head, where the controller also runs (it shares the run directory with the trainer).

How "no shared directory" is proven on one box: the second node runs in its own mount and PID namespaces
(``unshare --mount --propagation private --pid --fork --mount-proc``) with a private, empty tmpfs mounted over
``runs/<name>``. Everything of that node (its raylet, the rollout actor, SGLang, the sandboxes) sees only that
tmpfs there: the trainer's ``weights/`` (SFT's ``v0`` is written there) does not exist for it, and whatever it
writes stays in it. The run can only finish at version 2 if every version reached the servers by broadcast, and
the controller can only hold the held-out records and the rollout's log lines if they came over Ray. The node's
own files are read afterwards through ``/proc/<pid>/root`` of one of its processes (the view from its namespace).

Teardown, whatever happens: SIGTERM to each ``ray start --block`` (it stops its node), then SIGKILL to every
process that was under it; SIGKILL to the second node's PID-namespace init takes down everything left in that
namespace (also processes that were reparented in it). ``ray stop`` is not used: it stops every Ray process on the
machine, also other users' clusters.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

import agentrl

pytestmark = [pytest.mark.slow, pytest.mark.sglang, pytest.mark.redis]

REPO = Path(agentrl.__file__).resolve().parents[1]
RAY = [sys.executable, "-c", "from ray.scripts.scripts import main; main()"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env() -> dict[str, str]:
    """Every process of the test imports this checkout's agentrl (Ray workers inherit their raylet's
    environment) and runs at normal priority (Ray's workers default to nice 15). Ray's own OOM killer is off: it
    compares the whole machine's memory with 95 % of it, and on a machine shared with other runs it killed the
    rollout actor (0.5 GB) for memory other processes used."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env.update(RAY_AUTH_MODE="disabled", RAY_worker_niceness="0", RAY_DEDUP_LOGS="0", RAY_USAGE_STATS_ENABLED="0",
               RAY_memory_monitor_refresh_ms="0")
    return env


@dataclass
class Node:
    """One ``ray start --block`` and every process seen under it (pid, start time: a pid reused meanwhile by
    another process is left alone)."""

    proc: subprocess.Popen[bytes]
    log: Path
    seen: set[tuple[int, float]] = field(default_factory=set)

    def descendants(self) -> list[int]:
        import psutil

        try:
            found = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        for p in found:
            try:
                self.seen.add((p.pid, p.create_time()))
            except psutil.NoSuchProcess:
                pass
        return [p.pid for p in found]

    def raylet(self) -> int:
        import psutil

        for pid in self.descendants():
            try:
                if psutil.Process(pid).name() == "raylet":
                    return pid
            except psutil.NoSuchProcess:
                pass
        raise LookupError(f"no raylet under {self.proc.pid}; see {self.log}")

    def node_id(self) -> str:
        cmdline = Path(f"/proc/{self.raylet()}/cmdline").read_bytes().split(b"\0")
        return next(a.split(b"=", 1)[1].decode() for a in cmdline if a.startswith(b"--node_id="))

    def stop(self) -> None:
        import psutil

        self.descendants()
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)  # a PID-namespace init ignores it: SIGKILL follows
            self.proc.wait(5)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        for pid, started in self.seen:  # the second node's PID-namespace init among them: its whole namespace
            try:
                if psutil.Process(pid).create_time() == started:
                    os.kill(pid, signal.SIGKILL)
            except (psutil.NoSuchProcess, ProcessLookupError):
                pass
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(20)


def _start_node(args: list[str], temp_dir: Path, *, masked: Path | None = None) -> Node:
    log = temp_dir.with_suffix(".log")
    command = [*RAY, "start", "--block", f"--temp-dir={temp_dir}", "--disable-usage-stats", f"--dashboard-agent-listen-port={_free_port()}",
               "--object-store-memory=100000000", *args]
    if masked is not None:  # see the module docstring
        script = 'mount -t tmpfs -o size=256m,mode=0755 agentrl-rollout-node "$0" && exec "$@"'
        command = ["unshare", "--mount", "--propagation", "private", "--pid", "--fork", "--mount-proc",
                   "sh", "-c", script, str(masked), *command]
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=_env(), start_new_session=True)
    return Node(proc, log)


def _wait_until_started(node: Node, timeout_s: float = 180) -> None:
    """Until ``ray start`` says the node runs (it prints this once the node registered, then blocks)."""
    deadline = time.monotonic() + timeout_s
    while "Ray runtime started" not in node.log.read_text(errors="replace"):
        if node.proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"ray start did not start a node ({node.proc.poll()}):\n{node.log.read_text()[-3000:]}")
        time.sleep(0.5)


def _start_redis7(data: Path) -> tuple[subprocess.Popen[bytes], str]:
    import redis

    binary = shutil.which("redis-server") or "/usr/bin/redis-server"
    if not Path(binary).exists():
        pytest.skip("Debian's redis-server is not installed (scripts/install_system.sh test)")
    data.mkdir()
    port = _free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data), "--save", "",
                             "--appendonly", "yes", "--logfile", str(data / "redis.log")], start_new_session=True)
    client = redis.Redis(port=port, socket_timeout=1)
    deadline = time.monotonic() + 20
    while True:
        try:
            version = client.info("server")["redis_version"]
            break
        except redis.exceptions.RedisError:
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"redis-server did not start; see {data / 'redis.log'}")
            time.sleep(0.1)
    client.close()
    assert int(version.split(".")[0]) >= 7, version
    return proc, f"redis://127.0.0.1:{port}/0"


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[str, Node, Node, str, Path]]:
    """(ray address, head node, rollout node, Redis URL, the run directory the rollout node sees as a tmpfs)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("the rollout node's private mount namespace needs root and unshare (util-linux)")
    run_dir = tmp_path / "runs" / "twonode"
    run_dir.mkdir(parents=True)
    temp = Path(tempfile.mkdtemp(prefix="arl-", dir="/tmp"))  # Ray's socket paths must stay short
    started: list[Node] = []
    redis_proc = None
    try:
        redis_proc, redis_url = _start_redis7(tmp_path / "redis")
        port = _free_port()
        head = _start_node(["--head", "--include-dashboard=false", f"--port={port}",
                            f"--ray-client-server-port={_free_port()}",
                            "--num-cpus=2", '--resources={"trainer_node": 2}'], temp / "head")
        started.append(head)
        _wait_until_started(head)
        rollout = _start_node([f"--address=127.0.0.1:{port}", "--num-cpus=1", '--resources={"rollout_node": 1}'],
                              temp / "rollout", masked=run_dir)
        started.append(rollout)
        _wait_until_started(rollout)
        yield f"127.0.0.1:{port}", head, rollout, redis_url, run_dir
    finally:
        for node in reversed(started):
            node.stop()
        if redis_proc is not None:
            redis_proc.terminate()
            redis_proc.wait(10)
        shutil.rmtree(temp, ignore_errors=True)


def test_two_nodes_rollout_without_the_run_directory(cluster, tmp_path: Path) -> None:
    address, head, rollout_node, redis_url, run = cluster
    config = {
        "name": "twonode", "model": "tiny", "steps": 2, "runs_dir": str(run.parent),
        "redis": {"url": redis_url},
        "engine": {"num_servers": 2, "max_total_tokens": 4096},
        "weight_sync": {"mode": "distributed", "timeout_s": 60, "bucket_mb": 2},
        "sft": {"enabled": True, "steps": 1, "num_traces": 8, "batch_size": 4},
        "data": {"num_heldout": 2},
        "rollout": {"n_samples": 2, "groups_per_step": 2, "max_new_tokens": 16, "max_turns": 2,
                    "max_response_tokens": 48, "max_context_tokens": 192},
        "trainer": {"micro_batch_tokens": 2048},
        "resources": {"ray_address": address, "trainer_world_size": 2, "trainer_resources": {"trainer_node": 1},
                      "rollout_resources": {"rollout_node": 1}},
        "monitor": {"live": False, "prometheus_port": 0, "tensorboard": False},
    }
    path = tmp_path / "twonode.yaml"
    path.write_text(yaml.safe_dump(config))
    controller = subprocess.Popen([sys.executable, "-m", "agentrl.cli", "train", str(path)], cwd=tmp_path,
                                  env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  start_new_session=True)
    # what the rollout node sees at the run directory, read through one of its processes (module docstring)
    private = Path(f"/proc/{rollout_node.raylet()}/root") / run.relative_to("/")
    try:
        out, err = controller.communicate(timeout=600)
    finally:
        if controller.poll() is None:
            os.killpg(controller.pid, signal.SIGKILL)
            controller.wait(10)
    assert controller.returncode == 0, out[-2000:] + err[-6000:]

    summary = json.loads((run / "summary.json").read_text())
    assert summary["final_weight_version"] == 2 and summary["served_weight_version"] == 2, summary
    assert summary["books_balanced"] and summary["trajectories_consumed"] == 8 and summary["steps"] == 2, summary
    # placement: the rollout actor on the second node, both trainer ranks on the head
    assert summary["nodes"] == {"rollout": rollout_node.node_id(), "trainer": [head.node_id()] * 2}, summary
    ledger = [json.loads(x) for x in (private / "logs" / "processes.jsonl").read_text().splitlines()]
    assert sorted(r["name"] for r in ledger) == ["sglang-0", "sglang-1"]  # started there, recorded there
    assert {"rollout.log", "sglang-0.log", "sglang-1.log"} <= {p.name for p in (private / "logs").iterdir()}
    # the rollout node never saw weights/ (nothing of the trainer's directory), and no RL version was written but
    # the final one, after the servers had it: v1 and v2 reached both servers by broadcast only (the disk fallback
    # would have written v1 too); the rollout side says a server restarted after the trainer could not get v2
    assert not (private / "weights").exists() and (private / "rollouts.jsonl").exists()
    assert sorted(p.name for p in (run / "weights").iterdir()) == ["v0", "v2"]
    assert "a SGLang server restarted from now on cannot get weights v2" in err, err[-4000:]
    # what the controller holds came over Ray or Redis, not through files of the rollout node
    mine = {p.name for p in (run / "logs").iterdir()}
    assert {"trainer-0.log", "trainer-1.log"} <= mine and not mine & {"rollout.log", "sglang-0.log", "processes.jsonl"}
    assert not (run / "rollouts.jsonl").exists()
    for label in ("before", "sft", "after"):  # held-out records, returned by the rollout actor
        assert len((run / f"eval_{label}.jsonl").read_text().splitlines()) == 2
    assert [json.loads(x)["weight_version"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    # log lines of both sides reached the controller's terminal (Ray streams each node's actor output)
    assert "engine now serves weight version 2" in err, err[-4000:]  # the rollout actor's, on the second node
    assert "weights v2 broadcast to 2 server(s)" in err, err[-4000:]  # trainer rank 0's
    assert "RolloutActor" in err and "TrainerActor" in err
