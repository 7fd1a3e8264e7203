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


class Recording(Scripted):
    def __init__(self, tok, turns):
        super().__init__(tok, turns)
        self.regexes: list[str | None] = []

    async def generate(self, input_ids, sampling, *, sticky_key=None):
        self.regexes.append(sampling.regex)
        return await super().generate(input_ids, sampling, sticky_key=sticky_key)


@pytest.mark.parametrize("name", ["calculator_agent", "calculator_agent_forced"])
async def test_the_example_agent_calls_its_calculator_and_is_scored(chat_tokenizer, name: str):
    load_imports([str(EXAMPLE / "agent.py")])
    assert default_registry.get_env(name).kind == "agent"
    verifier = MathVerifier(workers=1)
    await verifier.start()
    engine = Recording(chat_tokenizer, [hermes_call_text("calculate", {"expression": "(49 + 18) * 22"}),
                                        "So it is \\boxed{1474}."])
    try:
        env = default_registry.make_env(name, EnvResources(verifier=verifier))
        async with LocalGateway(engine, chat_tokenizer, GatewayConfig()) as gw:
            [traj] = await AgentRunner(gw, chat_tokenizer, SamplingParams()).episode(
                env, Task(id="c", prompt="Compute (49 + 18) * 22.", answer="1474"), env_name=name)
    finally:
        await verifier.aclose()
    first, second = engine.regexes  # the forced variant constrains its first turn only, to a calculate call
    assert second is None and (first is not None) == name.endswith("forced")
    assert first is None or first.startswith(r'<tool_call>\n\{"name": "calculate"')
    assert traj.reward == 1.0 and traj.finish_reason is FinishReason.STOP
    first = traj.turns[0]
    assert first.tool_calls[0].name == "calculate"
    obs = chat_tokenizer.decode(traj.token_ids[first.token_end: first.token_end + first.observation_len])
    assert "1474" in obs  # the tool's answer, rendered by the chat template (mask 0)
    assert not traj.loss_mask[first.token_end: first.token_end + first.observation_len].any()


@pytest.mark.slow
@pytest.mark.sglang
@pytest.mark.redis  # the run starts its embedded Redis
def test_agentrl_train_on_the_example_agent(tmp_path, shared_server):
    # the tiny random model never calls a tool by itself: the forced variant's first turn is a calculate call, so
    # the episodes are multi-turn (the call, the tool's answer as mask-0 tokens, a free turn)
    proc = subprocess.run([sys.executable, "-m", "agentrl.cli", "train", str(EXAMPLE / "train.yaml"),
                           f"runs_dir={tmp_path}", "log_rollouts=full",
                           # the session's server (fp32): a server start-up less (~40 s); the runs that start
                           # their own are tests/test_smoke_e2e.py's
                           f"engine.url={shared_server}", "engine.dtype=float32", "env.name=calculator_agent_forced"],
                          capture_output=True, text=True, timeout=1200, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    run = tmp_path / "openai-agent"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["final_weight_version"] == 2 and summary["books_balanced"], summary
    rollouts = [json.loads(line) for line in (run / "rollouts.jsonl").read_text().splitlines()]
    assert rollouts and {r["env"] for r in rollouts} == {"calculator_agent_forced"}
    for r in rollouts:  # every trajectory came through a gateway session, with the engine's versions
        assert r["metadata"]["session"] and sum(r["loss_mask"]) > 0
        scored = [v for v, m in zip(r["weight_versions"], r["loss_mask"]) if m]
        assert min(scored) >= 0
    # turns: [index, text, token_start, token_end, observation_len, tool_calls, ...] (types.turns_to_lists)
    multi = [r for r in rollouts if len(r["turns"]) >= 2]
    assert multi, [len(r["turns"]) for r in rollouts]
    for r in multi:
        first = r["turns"][0]
        assert [c[0] for c in first[5]] == ["calculate"] and first[4] > 0  # the call, then the tool's answer
        assert not any(r["loss_mask"][first[3]: first[3] + first[4]])  # the observation is not trained
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and all(m["num_trajectories"] >= 4 for m in metrics)
