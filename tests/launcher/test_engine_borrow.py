"""resources.engine_borrows_idle_cores: when it is on, the trainer's wait flag, the scheduler's reading of it, and a
real SGLang server on CPU that widens to the trainer's core while the flag is up and narrows back when it goes
(agentrl.launcher.cores, sgl_kernel/_borrow.py of our CPU stand-in)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import psutil
import pytest
import torch

from agentrl.errors import ConfigError
from agentrl.launcher.colocation import apply_placement, choose_placement
from agentrl.launcher.config import load_config
from agentrl.launcher.cores import TrainerWaitFlag, engine_borrow_flag, pin_to_cores

SPLIT = ["rollout.max_staleness=1", "resources.rollout_cores=[0]", "resources.trainer_cores=[1]",
         "resources.engine_borrows_idle_cores=auto"]
TWO_CORES = sorted(os.sched_getaffinity(0))[:2]
needs_two_cores = pytest.mark.skipif(len(TWO_CORES) < 2, reason="needs two cores to lend one")


def _borrow_module() -> ModuleType:
    """The stand-in's module on its own (it needs only torch): the test process must not import the stand-in as
    sgl_kernel."""
    from agentrl.engine.server import SGL_KERNEL_CPU_DIR

    spec = importlib.util.spec_from_file_location("agentrl_test_borrow", SGL_KERNEL_CPU_DIR / "sgl_kernel" /
                                                  "_borrow.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- when it is on -----------------------------------------------------------------------------------------------------

def test_auto_lends_the_trainer_cores_to_the_run_s_server_and_tells_it_how(tmp_path: Path) -> None:
    cfg = load_config(None, [*SPLIT, f"runs_dir={tmp_path}", "name=b"])
    choice = choose_placement(cfg, available=[0, 1])
    assert choice.engine_borrows == [1] and "trainer waits" in choice.engine_borrow_reason
    applied = apply_placement(cfg, choice)
    assert applied.resources.engine_borrows_idle_cores is True
    env = applied.engine.server.env
    assert env["AGENTRL_BORROW_CORES"] == "1"
    assert env["AGENTRL_BORROW_FLAG"] == str(engine_borrow_flag(tmp_path / "b"))
    assert choice.trainer_borrows is None  # the two are set apart


@pytest.mark.parametrize(("overrides", "why"), [
    (["engine.url=http://127.0.0.1:1"], "one SGLang server started by the run"),
    (["engine.num_servers=2"], "one SGLang server started by the run"),
    (["engine.device=cuda"], "an SGLang server on CPU"),
    (["engine.env={AGENTRL_SGLANG_CPU_PATCHES: '0'}"], "AGENTRL_SGLANG_CPU_PATCHES=0"),
    (["resources.trainer_world_size=2"], "one trainer rank"),
    (["resources.ray_address=auto"], "both sides on this host"),
])
def test_auto_stays_off_where_the_engine_cannot_borrow_and_says_why(overrides: list[str], why: str) -> None:
    cfg = load_config(None, [*SPLIT, *overrides])
    choice = choose_placement(cfg, available=[0, 1])
    assert choice.engine_borrows is None and why in choice.engine_borrow_reason
    applied = apply_placement(cfg, choice)
    assert applied.resources.engine_borrows_idle_cores is False
    assert "AGENTRL_BORROW_FLAG" not in applied.engine.server.env


def test_off_by_default_and_true_where_it_cannot_work_is_refused() -> None:
    default = choose_placement(load_config(None, SPLIT[:3]), available=[0, 1])
    assert default.engine_borrows is None and "false" in default.engine_borrow_reason
    with pytest.raises(ConfigError, match="engine_borrows_idle_cores: true needs resources.rollout_cores"):
        load_config(None, ["resources.engine_borrows_idle_cores=true"])
    cfg = load_config(None, [*SPLIT[:3], "resources.engine_borrows_idle_cores=true", "engine.num_servers=2"])
    with pytest.raises(ConfigError, match="engine_borrows_idle_cores: true needs one SGLang server"):
        choose_placement(cfg, available=[0, 1])


# --- the flag and the scheduler's reading of it -------------------------------------------------------------------------

def test_the_flag_is_host_local_per_run_and_up_only_while_the_trainer_waits(tmp_path: Path) -> None:
    path = engine_borrow_flag(tmp_path / "run")
    assert path == engine_borrow_flag(tmp_path / "x" / ".." / "run") != engine_borrow_flag(tmp_path / "other")
    assert str(path).startswith("/dev/shm/") or not Path("/dev/shm").is_dir()
    path.write_text("12345")  # a crashed trainer's flag: a new trainer takes it down at start
    flag = TrainerWaitFlag(path)
    assert not path.exists()
    with flag.raised():
        assert path.read_text() == str(os.getpid())
    assert not path.exists()
    with pytest.raises(RuntimeError), flag.raised():  # an error while waiting takes it down too
        raise RuntimeError
    assert not path.exists()


def test_the_scheduler_reads_a_live_settled_pid_only(tmp_path: Path) -> None:
    borrow = _borrow_module()
    path = tmp_path / "flag"
    reader = borrow.EngineCoreBorrowing(str(path), [1], settle_s=0.5)
    assert not reader.trainer_waiting()  # no flag
    path.write_text(str(os.getpid()))
    assert not reader.trainer_waiting()  # just raised: a wait of a few ms between two ready batches is not worth it
    old = time.time() - 1
    os.utime(path, (old, old))
    assert reader.trainer_waiting()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    for text in (str(dead.pid), "not a pid", ""):
        path.write_text(text)
        os.utime(path, (old, old))
        assert not reader.trainer_waiting(), text
    os.environ.pop("AGENTRL_BORROW_FLAG", None)
    assert borrow.from_environment() is None


@needs_two_cores
def test_the_scheduler_widens_while_the_trainer_waits_and_narrows_after(tmp_path: Path, restore_cores: None) -> None:
    borrow = _borrow_module()
    own, lend = TWO_CORES[:1], TWO_CORES[1:]
    pin_to_cores(own)
    torch.set_num_threads(1)
    path = tmp_path / "flag"
    said: list[str] = []
    engine = borrow.EngineCoreBorrowing(str(path), lend, check_s=0.0, settle_s=0.0, log=said.append)
    engine.adjust()
    assert torch.get_num_threads() == 1 and sorted(os.sched_getaffinity(0)) == own and not engine.borrowing
    path.write_text(str(os.getpid()))
    engine.adjust()
    assert torch.get_num_threads() == 2 and sorted(os.sched_getaffinity(0)) == TWO_CORES and engine.borrowing
    path.unlink()
    engine.adjust()
    assert torch.get_num_threads() == 1 and sorted(os.sched_getaffinity(0)) == own and not engine.borrowing
    assert engine.forwards == 3 and engine.borrowed_forwards == 1
    assert len(said) == 1 and f"borrowed cores {lend}" in said[0]


# --- a real SGLang server ------------------------------------------------------------------------------------------------

def _scheduler(server_pid: int) -> psutil.Process:
    for child in psutil.Process(server_pid).children(recursive=True):
        if "scheduler" in " ".join(child.cmdline()) or "scheduler" in child.name():
            return child
    raise AssertionError(f"no scheduler process under {server_pid}")


def _cores_of_threads(proc: psutil.Process) -> set[int]:
    cores: set[int] = set()
    for tid in os.listdir(f"/proc/{proc.pid}/task"):
        try:
            cores |= os.sched_getaffinity(int(tid))
        except (ProcessLookupError, FileNotFoundError):
            pass
    return cores


@needs_two_cores
@pytest.mark.slow
@pytest.mark.sglang
def test_a_real_sglang_server_decodes_on_the_waiting_trainer_s_core(tiny_model_path: Path, tmp_path: Path,
                                                                     restore_cores: None) -> None:
    import asyncio

    from agentrl.engine.base import SamplingParams
    from agentrl.engine.client import SGLangClient
    from agentrl.engine.server import SGLangServer, SGLangServerConfig

    own, lend = TWO_CORES[:1], TWO_CORES[1:]
    path = tmp_path / "flag"
    pin_to_cores(own)  # the server inherits it, as it inherits the rollout actor's cores in a run
    server = SGLangServer(SGLangServerConfig(
        model_path=str(tiny_model_path), max_total_tokens=4096, dtype="float32",
        env={"OMP_NUM_THREADS": "1", "AGENTRL_BORROW_FLAG": str(path),
             "AGENTRL_BORROW_CORES": ",".join(map(str, lend))}), log_path=tmp_path / "sglang.log")
    server.start()
    try:
        scheduler = _scheduler(server.pid)

        async def generate() -> None:
            async with SGLangClient(server.url) as client:
                await client.generate([1, 2, 3, 4], SamplingParams(max_new_tokens=8, temperature=0.0))

        asyncio.run(generate())
        assert _cores_of_threads(scheduler) == set(own)
        threads = scheduler.num_threads()
        path.write_text(str(os.getpid()))  # the trainer waits: this process stands in for it
        time.sleep(0.6)  # past the settling time
        asyncio.run(generate())
        assert _cores_of_threads(scheduler) == set(TWO_CORES)
        assert scheduler.num_threads() > threads  # an OpenMP worker for the lent core
        path.unlink()  # the batch is there: the trainer computes again
        time.sleep(0.2)  # past the scheduler's check interval
        asyncio.run(generate())
        assert _cores_of_threads(scheduler) == set(own)
        log = (tmp_path / "sglang.log").read_text()
        assert f"the scheduler borrows cores {lend}" in log and f"agentrl: borrowed cores {lend} for" in log
    finally:
        server.stop()


async def test_the_trainer_raises_the_flag_only_while_it_reads_the_queue(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """rl_step holds the flag around its wait for a batch, and takes it down when the wait ends, also by an error."""
    from types import SimpleNamespace

    from agentrl.launcher import trainer_process

    path = engine_borrow_flag(tmp_path / "run")
    seen: list[bool] = []

    async def read_groups(*args: object, **kwargs: object) -> list[object]:
        seen.append(path.exists() and path.read_text() == str(os.getpid()))
        raise RuntimeError("the queue is gone")

    monkeypatch.setattr(trainer_process, "read_groups", read_groups)
    r0 = SimpleNamespace(queue=None, carry={}, wait_flag=TrainerWaitFlag(path), borrower=None)
    with pytest.raises(RuntimeError, match="the queue is gone"):
        await trainer_process.rl_step(load_config(None, []), tmp_path, None, r0, None)  # type: ignore[arg-type]
    assert seen == [True] and not path.exists()
