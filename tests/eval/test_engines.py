"""ModelServers: one server per model folder, reused; at most max_servers, the idle LRU one stopped for a new model;
failed starts reported and retried. The launcher is a fake here (the logic around it); the real SGLang launch is
in the ``slow`` test at the end, and the URL path against a real server in test_sglang_eval.py."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from agentrl.errors import EngineError
from agentrl.eval import EvalSpec, ModelServers, ResolvedModel, run_eval


@dataclass
class FakeServer:
    url: str
    stopped: bool = False

    def stop(self) -> None:
        self.stopped = True


@dataclass
class FakeLauncher:
    delay_s: float = 0.05
    fail: set[str] = field(default_factory=set)
    started: list[FakeServer] = field(default_factory=list)

    async def __call__(self, path: Path) -> FakeServer:
        await asyncio.sleep(self.delay_s)
        if path.name in self.fail:
            raise EngineError(f"{path.name} does not load")
        server = FakeServer(f"http://127.0.0.1:1/{path.name}/{len(self.started)}")
        self.started.append(server)
        return server


def model(tiny_model_path: Path, name: str) -> ResolvedModel:
    # every fake "model" uses the tiny tokenizer; the folder name tells the launcher which model it is
    return ResolvedModel(label=name, path=Path("/models") / name, tokenizer=str(tiny_model_path))


async def test_one_server_per_model_reused_and_evicted_when_idle(tiny_model_path: Path) -> None:
    launcher = FakeLauncher()
    async with ModelServers(max_servers=1, launcher=launcher) as pool:
        a = model(tiny_model_path, "a")

        async def use(m: ResolvedModel, hold_s: float, leased: asyncio.Event | None = None) -> str:
            async with pool.lease(m) as lease:
                if leased is not None:
                    leased.set()
                await asyncio.sleep(hold_s)
                return lease.url

        urls = await asyncio.gather(*(use(a, 0.05) for _ in range(3)))
        assert len(set(urls)) == 1 and len(launcher.started) == 1  # started once, shared
        assert await use(a, 0) == urls[0]  # an idle server is reused
        b = model(tiny_model_path, "b")
        a_leased = asyncio.Event()
        slow_a = asyncio.ensure_future(use(a, 0.3, a_leased))
        await a_leased.wait()
        url_b = await use(b, 0)  # waits until `a` is idle, then stops it for `b`
        assert slow_a.done() and launcher.started[0].stopped and len(launcher.started) == 2
        assert "/b/" in url_b
    assert all(s.stopped for s in launcher.started)


async def test_two_servers_side_by_side(tiny_model_path: Path) -> None:
    launcher = FakeLauncher()
    pool = ModelServers(max_servers=2, launcher=launcher)
    async with pool, pool.lease(model(tiny_model_path, "a")) as la, pool.lease(model(tiny_model_path, "b")) as lb:
        assert la.url != lb.url
        assert [e["leases"] for e in pool.status()] == [1, 1]
    assert len(launcher.started) == 2 and all(s.stopped for s in launcher.started)


async def test_a_failed_start_is_reported_to_every_waiter_and_retried(tiny_model_path: Path) -> None:
    launcher = FakeLauncher(fail={"bad"})
    async with ModelServers(max_servers=1, launcher=launcher) as pool:
        bad = model(tiny_model_path, "bad")

        async def use() -> None:
            async with pool.lease(bad):
                pass

        results = await asyncio.gather(use(), use(), return_exceptions=True)
        assert all(isinstance(r, EngineError) and "does not load" in str(r) for r in results)
        launcher.fail.clear()
        await use()  # the failed entry does not block the slot; the next lease starts again
        assert len(launcher.started) == 1


async def test_limited_engine_caps_generate_calls(chat_tokenizer) -> None:
    from eval_support import ScriptedEngine

    from agentrl.engine.base import SamplingParams
    from agentrl.eval import LimitedEngine

    inner = ScriptedEngine(chat_tokenizer, lambda seed, turn: "hi", delay_s=0.05)
    engine = LimitedEngine(inner, asyncio.Semaphore(2))
    await asyncio.gather(*(engine.generate([1, 2], SamplingParams(), sticky_key=str(i)) for i in range(6)))
    assert inner.calls == 6 and inner.max_in_flight == 2
    with pytest.raises(EngineError, match="read-only"):
        await engine.update_weights("/x", 1)


@pytest.mark.slow
@pytest.mark.sglang
async def test_a_weight_version_gets_its_own_real_sglang_server(tiny_model_path: Path, resources,
                                                                tmp_path: Path) -> None:
    """runs/<run>/weights/v3 (here a link to the tiny model): the pool starts SGLang on it, and the tokens the
    evaluation records carry version 3."""
    from agentrl.engine.server import SGLangServerConfig
    from agentrl.eval import resolve_model_spec

    (tmp_path / "runs" / "r1" / "weights").mkdir(parents=True)
    (tmp_path / "runs" / "r1" / "weights" / "v3").symlink_to(tiny_model_path, target_is_directory=True)
    spec = EvalSpec.model_validate({"dataset": {"items": [{"prompt": "Say hi.", "answer": "hi"}]},
                                    "model": {"run": "r1", "version": 3}, "sampling": {"max_new_tokens": 8},
                                    "max_turns": 1})
    model = resolve_model_spec(spec.model, runs_dir=tmp_path / "runs")
    async with ModelServers(max_servers=1, server_config=SGLangServerConfig(max_total_tokens=4096, dtype="float32"),
                          log_dir=tmp_path) as pool:
        async with pool.lease(model) as lease:
            result = await run_eval(spec, engine=lease.engine, tokenizer=lease.tokenizer, resources=resources)
        assert result.status == "succeeded" and result.metrics["num_samples"] == 1 and pool.started == 1
        t = result.records[0].trajectory
        assert t is not None and {v for v, m in zip(t["weight_versions"], t["loss_mask"]) if m} == {3}
        assert list(tmp_path.glob("sglang-*.log"))
