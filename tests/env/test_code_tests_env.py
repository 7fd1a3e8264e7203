"""The built-in ``code_tests`` environment with the REAL local sandbox: the program in the ```python fence is run
against the task's tests; the model's failures score low, a sandbox failure is an infrastructure error."""

from __future__ import annotations

import pytest
from env_support import ScriptedEngine

from agentrl.async_rollout import EpisodeRunner
from agentrl.engine.base import SamplingParams
from agentrl.env import EnvResources, default_registry
from agentrl.env.code_tests import CodeTestsEnv
from agentrl.errors import ConfigError, SandboxError
from agentrl.rewards import RewardInput
from agentrl.types import FinishReason, Task

TESTS = [{"stdin": "2 3\n", "expected_stdout": "5\n"}, {"stdin": "10 -4\n", "expected_stdout": "6\n"},
         {"stdin": "0 0\n", "expected_stdout": "0\n"}]
TASK = Task(id="sum", prompt="Read two integers, print their sum.", metadata={"tests": TESTS})


def fenced(code: str) -> str:
    return f"Here is my solution.\n```python\n{code}\n```"


@pytest.mark.parametrize("program, score", [
    ("a, b = map(int, input().split())\nprint(a + b)", 1.0),
    ("a, b = map(int, input().split())\nprint(a + b if b > 0 else 0)", 2 / 3),  # wrong on "10 -4"
    ("print(5)", 1 / 3),
    ("raise SystemExit(1)", 0.0),
    ("while True: pass", 0.0),
])
async def test_pass_rate(env_resources, program, score):
    env = default_registry.make_env("code_tests", env_resources, time_limit_s=1.0)
    await env.reset(TASK)
    result = await env.score(RewardInput(text=fenced(program)))
    assert result.ok and result.score == pytest.approx(score)


async def test_no_program_scores_zero(env_resources):
    env = CodeTestsEnv(env_resources)
    await env.reset(TASK)
    result = await env.score(RewardInput(text="I would add the numbers."))
    assert result.ok and result.score == 0.0 and result.details["reason"] == "no_program"


async def test_binary_scoring(env_resources):
    env = CodeTestsEnv(env_resources, binary=True)
    await env.reset(TASK)
    assert (await env.score(RewardInput(text=fenced("print(5)")))).score == 0.0


async def test_a_sandbox_failure_is_an_infrastructure_error_not_a_zero(env_resources):
    class DownSandbox:
        async def run(self, request):
            raise SandboxError("sandbox unreachable")

    env = CodeTestsEnv(EnvResources(sandbox=DownSandbox()))
    await env.reset(TASK)
    result = await env.score(RewardInput(text=fenced("print(5)")))
    assert not result.ok


async def test_tasks_need_tests(env_resources):
    with pytest.raises(ConfigError, match="metadata\\['tests'\\]"):
        await CodeTestsEnv(env_resources).reset(Task(id="x", prompt="?"))
    with pytest.raises(ConfigError, match="bad code tests"):
        await CodeTestsEnv(env_resources).reset(Task(id="x", prompt="?", metadata={"tests": 3}))
    with pytest.raises(ConfigError, match="sandbox"):
        CodeTestsEnv(EnvResources())


async def test_episode(env_resources, chat_tokenizer):
    engine = ScriptedEngine(chat_tokenizer, [(fenced("import sys\nprint(sum(map(int, sys.stdin.read().split())))"),
                                              True)])
    runner = EpisodeRunner(engine, chat_tokenizer, SamplingParams(max_new_tokens=128))
    async with CodeTestsEnv(env_resources) as env:
        traj = await runner.run(env, TASK, env_name="code_tests")
    assert traj.reward == 1.0 and traj.finish_reason is FinishReason.STOP
    assert traj.token_ids.tolist() == engine.requests[0] + engine.outputs[0]


async def test_a_cpp_environment_on_livecodebench_rows(env_resources):
    """language=cpp: the prompt asks for C++; a LiveCodeBench row (no metadata['tests']) is accepted and scored;
    a row with no tests at all is refused before generating."""
    import json

    env = default_registry.make_env("code_tests", env_resources, language="cpp", time_limit_s=2.0)
    assert "```cpp" in env.system_prompt and "Python" not in env.system_prompt
    row = Task(id="lcb", prompt="Sum.", metadata={
        "public_test_cases": json.dumps([{"input": t["stdin"], "output": t["expected_stdout"], "testtype": "stdin"}
                                         for t in TESTS]), "metadata": "{}"})
    await env.reset(row)
    good = "```cpp\n#include <iostream>\nint main() { long a, b; std::cin >> a >> b; std::cout << a + b; }\n```"
    result = await env.score(RewardInput(text=good))
    assert result.ok and result.score == 1.0 and result.details["language"] == "cpp", result
    with pytest.raises(ConfigError, match="needs tests"):
        await env.reset(Task(id="none", prompt="?"))


async def test_the_prompt_asks_for_each_tasks_language(env_resources):
    """No language option: a task's metadata['language'] picks the language its prompt asks for (a dataset may mix
    Python and C++ problems); a system prompt given as an option is kept for every task."""
    env = default_registry.make_env("code_tests", env_resources)
    cpp = await env.reset(Task(id="c", prompt="Sum.", metadata={"tests": TESTS, "language": "cpp"}))
    assert "C++" in cpp[0]["content"] and "```cpp" in cpp[0]["content"] and "Python" not in cpp[0]["content"]
    js = await env.reset(Task(id="j", prompt="Sum.", metadata={"tests": TESTS, "language": "nodejs"}))
    assert "JavaScript" in js[0]["content"] and "```javascript" in js[0]["content"]
    py = await env.reset(TASK)
    assert "```python" in py[0]["content"]
    own = default_registry.make_env("code_tests", env_resources, system_prompt="Be brief.")
    assert (await own.reset(Task(id="c", prompt="Sum.", metadata={"tests": TESTS, "language": "cpp"})))[0] == \
        {"role": "system", "content": "Be brief."}
    with pytest.raises(ConfigError, match="cobol"):
        await env.reset(Task(id="x", prompt="?", metadata={"tests": TESTS, "language": "cobol"}))
