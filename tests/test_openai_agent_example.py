"""examples/openai_agent: an agent written with the plain ``openai`` client, registered with ``@agentrl.agent``,
trained with `agentrl train` (end to end against real SGLang, Redis, FSDP2, the gateway in the rollout process)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_custom_env_example import Scripted  # the same scripted engine (tests/ is on sys.path)

from agentrl.async_rollout.agent_episode import AgentRunner
from agentrl.engine.base import SamplingParams
from agentrl.env.registry import EnvResources, default_registry, load_imports
from agentrl.gateway import GatewayConfig, LocalGateway
from agentrl.rewards import MathVerifier
from agentrl.tokenizer import hermes_call_text
from agentrl.types import FinishReason, Task

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "openai_agent"


async def test_the_example_agent_calls_its_calculator_and_is_scored(chat_tokenizer):
    load_imports([str(EXAMPLE / "agent.py")])
    assert default_registry.get_env("calculator_agent").kind == "agent"
    verifier = MathVerifier(workers=1)
    await verifier.start()
    engine = Scripted(chat_tokenizer, [hermes_call_text("calculate", {"expression": "(49 + 18) * 22"}),
                                       "So it is \\boxed{1474}."])
    try:
        env = default_registry.make_env("calculator_agent", EnvResources(verifier=verifier))
        async with LocalGateway(engine, chat_tokenizer, GatewayConfig()) as gw:
            [traj] = await AgentRunner(gw, chat_tokenizer, SamplingParams()).episode(
                env, Task(id="c", prompt="Compute (49 + 18) * 22.", answer="1474"), env_name="calculator_agent")
    finally:
        await verifier.aclose()
    assert traj.reward == 1.0 and traj.finish_reason is FinishReason.STOP
    first = traj.turns[0]
    assert first.tool_calls[0].name == "calculate"
    obs = chat_tokenizer.decode(traj.token_ids[first.token_end: first.token_end + first.observation_len])
    assert "1474" in obs  # the tool's answer, rendered by the chat template (mask 0)
    assert not traj.loss_mask[first.token_end: first.token_end + first.observation_len].any()


@pytest.mark.slow
@pytest.mark.sglang
@pytest.mark.redis  # the run starts its embedded Redis
def test_agentrl_train_on_the_example_agent(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "agentrl.cli", "train", str(EXAMPLE / "train.yaml"),
                           f"runs_dir={tmp_path}", "log_rollouts=full"],
                          capture_output=True, text=True, timeout=1200, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    run = tmp_path / "openai-agent"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["final_weight_version"] == 2 and summary["books_balanced"], summary
    rollouts = [json.loads(line) for line in (run / "rollouts.jsonl").read_text().splitlines()]
    assert rollouts and {r["env"] for r in rollouts} == {"calculator_agent"}
    for r in rollouts:  # every trajectory came through a gateway session, with the engine's versions
        assert r["metadata"]["session"] and sum(r["loss_mask"]) > 0
        scored = [v for v, m in zip(r["weight_versions"], r["loss_mask"]) if m]
        assert min(scored) >= 0
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and all(m["num_trajectories"] >= 4 for m in metrics)
