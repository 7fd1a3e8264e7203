"""examples/custom_env: a user's environment in one file, registered with the Python API, trained with
`agentrl train` (end to end against real SGLang, Redis, FSDP2)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from agentrl.async_rollout.episode import EpisodeRunner
from agentrl.engine.base import EngineFinish, GenerateResult, SamplingParams
from agentrl.env.registry import EnvResources, default_registry, load_imports
from agentrl.rewards import MathVerifier
from agentrl.types import Task

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "custom_env"


class Scripted:
    def __init__(self, tok, turns):
        self.tok, self.turns = tok, list(turns)

    async def generate(self, input_ids, sampling, *, sticky_key=None):
        ids = self.tok.encode_text(self.turns.pop(0)) + [self.tok.eos_token_id]
        return GenerateResult(ids, [-0.5] * len(ids), [0] * len(ids), EngineFinish.STOP)


async def test_the_example_env_registers_calls_its_tool_and_scores(chat_tokenizer):
    load_imports([str(EXAMPLE / "unit_env.py")])
    assert "unit_convert" in [e.name for e in default_registry.list_envs()]
    verifier = MathVerifier(workers=1)
    await verifier.start()
    try:
        env = default_registry.make_env("unit_convert", EnvResources(verifier=verifier))
        engine = Scripted(chat_tokenizer, [
            '<tool_call>{"name": "multiply", "arguments": {"a": 3.5, "b": 1000}}</tool_call>',
            "So it is \\boxed{3500}.",
        ])
        async with env:
            traj = await EpisodeRunner(engine, chat_tokenizer, SamplingParams()).run(
                env, Task(id="u", prompt="How many m are 3.5 km?", answer="3500"), env_name="unit_convert")
    finally:
        await verifier.aclose()
    assert traj.turns[0].tool_results[0].status == "ok" and traj.turns[0].tool_results[0].output == "3500.0"
    obs = traj.token_ids[traj.turns[0].token_end: traj.turns[0].token_end + traj.turns[0].observation_len]
    assert "<|im_start|>tool\n3500.0<|im_end|>" in chat_tokenizer.decode(obs)
    assert traj.reward == 1.0


@pytest.mark.slow
@pytest.mark.sglang
@pytest.mark.redis  # the run starts its embedded Redis
def test_agentrl_train_on_the_example_recipe(tmp_path, shared_server):
    proc = subprocess.run([sys.executable, "-m", "agentrl.cli", "train", str(EXAMPLE / "train.yaml"),
                           f"runs_dir={tmp_path}", "log_rollouts=full",
                           # the session's server (fp32): a server start-up less (~40 s); the runs that start
                           # their own are tests/test_smoke_e2e.py's
                           f"engine.url={shared_server}", "engine.dtype=float32"],
                          capture_output=True, text=True, timeout=1200, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    run = tmp_path / "unit-convert"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["final_weight_version"] == 2 and summary["books_balanced"]
    rollouts = [json.loads(line) for line in (run / "rollouts.jsonl").read_text().splitlines()]
    assert rollouts and {r["env"] for r in rollouts} == {"unit_convert"}
