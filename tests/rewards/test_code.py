"""Code rewards: real programs in the real local sandbox; fake sandboxes only for infrastructure failures."""

from __future__ import annotations

import math

import pytest

from agentrl.errors import ConfigError, SandboxError
from agentrl.rewards import (
    CodeTestsReward,
    RewardInput,
    RewardStatus,
    TestCase,
    TestStatus,
    extract_program,
    outputs_match,
    parse_tests,
)
from agentrl.sandbox.base import Limits, RequestStatus, RunResult, RunStatus
from agentrl.types import Task

STDIO_TESTS = [
    {"stdin": "2 3\n", "expected_stdout": "5\n"},
    {"stdin": "10 -4\n", "expected_stdout": "6"},
    {"stdin": "0 0\n", "expected_stdout": "0\n"},
    {"stdin": "7 8\n", "expected_stdout": "15\n"},
]
ASSERT_TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(10, 5) == 15"]


def fenced(code: str, preamble: str = "Here is my solution.") -> str:
    return f"{preamble}\n```python\n{code}\n```\n"


def task(tests: object) -> Task:
    return Task(id="sum", prompt="Add two numbers.", metadata={"tests": tests})


@pytest.fixture
def reward(local_sandbox: object) -> CodeTestsReward:
    return CodeTestsReward(local_sandbox, limits=Limits(time_s=2.0), max_concurrency=4)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- the real sandbox


async def test_correct_program_scores_one(reward: CodeTestsReward) -> None:
    program = "a, b = map(int, input().split())\nprint(a + b)"
    result = await reward(task(STDIO_TESTS), RewardInput(text=fenced(program)))
    assert (result.score, result.status, result.details["passed"], result.details["total"]) == (
        1.0,
        RewardStatus.OK,
        4,
        4,
    )
    assert [t["status"] for t in result.details["tests"]] == ["passed"] * 4


async def test_partly_correct_program_scores_its_pass_rate(reward: CodeTestsReward) -> None:
    program = "a, b = map(int, input().split())\nprint(a + b if a >= 0 and b >= 0 else a - b)"
    result = await reward(task(STDIO_TESTS), RewardInput(text=fenced(program)))
    assert result.ok and result.score == pytest.approx(0.75)
    assert [t["status"] for t in result.details["tests"]] == ["passed", "wrong_answer", "passed", "passed"]


async def test_binary_mode_gives_zero_for_partial(local_sandbox: object) -> None:
    binary = CodeTestsReward(local_sandbox, limits=Limits(time_s=2.0), binary=True)  # type: ignore[arg-type]
    program = "a, b = map(int, input().split())\nprint(a + b if b >= 0 else 0)"
    result = await binary(task(STDIO_TESTS), RewardInput(text=fenced(program)))
    assert result.ok and result.score == 0.0 and result.details["passed"] == 3


@pytest.mark.timeout(120)
async def test_infinite_loop_scores_zero_within_the_time_limit(reward: CodeTestsReward) -> None:
    result = await reward(task(STDIO_TESTS[:2]), RewardInput(text=fenced("while True:\n    pass")))
    assert result.status is RewardStatus.OK and result.score == 0.0
    assert {t["status"] for t in result.details["tests"]} == {"time_limit_exceeded"}


async def test_crash_scores_zero(reward: CodeTestsReward) -> None:
    result = await reward(task(STDIO_TESTS), RewardInput(text=fenced("raise RuntimeError('boom')")))
    assert result.status is RewardStatus.OK and result.score == 0.0
    assert {t["status"] for t in result.details["tests"]} == {"runtime_error"}
    assert "boom" in result.details["tests"][0]["message"]


async def test_assert_tests(reward: CodeTestsReward) -> None:
    right = await reward(task(ASSERT_TESTS), RewardInput(text=fenced("def add(a, b):\n    return a + b")))
    half = await reward(task(ASSERT_TESTS), RewardInput(text=fenced("def add(a, b):\n    return abs(a) + b")))
    assert right.ok and right.score == 1.0
    assert half.ok and half.score == pytest.approx(2 / 3)
    assert [t["status"] for t in half.details["tests"]] == ["passed", "wrong_answer", "passed"]


async def test_main_block_does_not_run_under_assert_tests(reward: CodeTestsReward) -> None:
    program = (
        "def add(a, b):\n    return a + b\n\n"
        "if __name__ == '__main__':\n    print(add(*map(int, input().split())))"
    )
    result = await reward(task(ASSERT_TESTS), RewardInput(text=fenced(program)))
    assert result.ok and result.score == 1.0


@pytest.mark.parametrize("escape", ["import sys\nsys.exit(0)", "import os\nos._exit(0)", "exit()"])
async def test_exiting_early_does_not_skip_the_asserts(reward: CodeTestsReward, escape: str) -> None:
    program = f"def add(a, b):\n    return 0\n{escape}"
    result = await reward(task(ASSERT_TESTS), RewardInput(text=fenced(program)))
    assert result.ok and result.score == 0.0
    assert {t["status"] for t in result.details["tests"]} == {"wrong_answer"}


async def test_no_program_scores_zero_without_running_anything(reward: CodeTestsReward) -> None:
    result = await reward(task(STDIO_TESTS), RewardInput(text="I would add them."))
    assert result.ok and result.score == 0.0 and result.details["reason"] == "no_program"


# ----------------------------------------------------------------------------- infrastructure failures


async def test_sandbox_error_is_infrastructure_not_zero(fake_sandbox: type, sandbox_down: RunResult) -> None:
    reward = CodeTestsReward(fake_sandbox(sandbox_down))
    result = await reward(task(STDIO_TESTS), RewardInput(text=fenced("print(1)")))
    assert result.status is RewardStatus.INFRA_ERROR and math.isnan(result.score)
    assert "uid map" in result.details["error"]


async def test_one_failed_request_among_good_ones_still_voids_the_score(
    fake_sandbox: type, sandbox_down: RunResult
) -> None:
    """Stdio and assert tests go in two requests: one answered, one failed by the sandbox: no score."""
    five = RunResult(status=RequestStatus.SUCCESS, run_status=RunStatus.FINISHED, exit_code=0, stdout="5\n")
    ok = RunResult(status=RequestStatus.SUCCESS, run_status=RunStatus.FINISHED, exit_code=0, cases=(five,) * 4)
    reward = CodeTestsReward(fake_sandbox(ok, sandbox_down), max_concurrency=1)
    result = await reward(task([*STDIO_TESTS, *ASSERT_TESTS]), RewardInput(text=fenced("print(5)")))
    assert result.status is RewardStatus.INFRA_ERROR and math.isnan(result.score)


async def test_sandbox_client_exception_is_infrastructure(fake_sandbox: type) -> None:
    reward = CodeTestsReward(fake_sandbox(SandboxError("connection refused")))
    result = await reward(task(ASSERT_TESTS), RewardInput(text=fenced("def add(a, b): return a + b")))
    assert result.status is RewardStatus.INFRA_ERROR and "connection refused" in result.details["error"]


@pytest.mark.timeout(60)
async def test_sandbox_that_never_answers_is_infrastructure(fake_sandbox: type) -> None:
    reward = CodeTestsReward(fake_sandbox("hang"), limits=Limits(time_s=0.2), grace_s=0.3)
    result = await reward(task(STDIO_TESTS), RewardInput(text=fenced("print(5)")))
    assert result.status is RewardStatus.INFRA_ERROR and "did not answer" in result.details["error"]


async def test_assert_harness_passes_only_with_the_nonce(fake_sandbox: type) -> None:
    finished = RunResult(
        status=RequestStatus.SUCCESS, run_status=RunStatus.FINISHED, exit_code=0, stdout="ok\n"
    )
    sandbox = fake_sandbox(RunResult(RequestStatus.SUCCESS, RunStatus.FINISHED, 0, cases=(finished,)))
    result = await CodeTestsReward(sandbox)(task(ASSERT_TESTS[:1]), RewardInput(text=fenced("x = 1")))
    assert result.ok and result.score == 0.0  # exit 0 without the nonce the harness prints after the asserts
    nonce = sandbox.requests[0].cases[0].split("\n")[0]
    assert len(nonce) == 32 and nonce not in sandbox.requests[0].code  # the nonce is not in the source


async def test_missing_or_bad_tests_are_config_errors(fake_sandbox: type, sandbox_down: RunResult) -> None:
    reward = CodeTestsReward(fake_sandbox(sandbox_down))
    with pytest.raises(ConfigError, match="metadata"):
        await reward(Task(id="t", prompt="?"), RewardInput(text=fenced("print(1)")))
    with pytest.raises(ConfigError, match="bad code tests"):
        await reward(task([{"stdin": "1"}]), RewardInput(text=fenced("print(1)")))


# ----------------------------------------------------------------------------- parsing helpers


def test_extract_program_takes_the_last_python_block() -> None:
    text = "```python\nfirst()\n```\nthen\n```\nuntagged()\n```\n```py\nsecond()\n```\n```text\nlog\n```"
    assert extract_program(text) == "second()\n"
    assert extract_program("```\nonly_untagged()\n```") == "only_untagged()\n"
    assert extract_program("```python\nunterminated()") is None
    assert extract_program("no code at all") is None


@pytest.mark.timeout(60)
def test_extract_program_is_linear_on_adversarial_text() -> None:
    assert extract_program("```x" * 300_000) is None  # a backtracking regex would take hours here
    assert extract_program("a" * 1_000_000 + "```python\nprint(1)\n```") == "print(1)\n"


def test_parse_tests_shapes() -> None:
    assert parse_tests(["assert f() == 1"]) == (TestCase(assertion="assert f() == 1"),)
    assert parse_tests({"inputs": ["1\n"], "outputs": ["2\n"]}) == (
        TestCase(stdin="1\n", expected_stdout="2\n"),
    )
    assert parse_tests([{"input": "a", "output": "b"}]) == (TestCase(stdin="a", expected_stdout="b"),)
    assert parse_tests({"asserts": ["assert 1"]})[0].assertion == "assert 1"
    for bad in (
        [],
        {"inputs": ["1"], "outputs": []},
        [{"stdin": "1", "assertion": "x", "expected_stdout": "1"}],
        3,
    ):
        with pytest.raises(ConfigError):
            parse_tests(bad)


@pytest.mark.parametrize(
    ("got", "expected", "match"),
    [
        ("5\n", "5", True),
        ("1 2  \n3\n\n", "1 2\n3", True),
        ("0.3333333", "0.333333", True),
        ("5", "6", False),
        ("1 2", "1 2 3", False),
        ("abc", "abd", False),
        ("10", "10.0", True),
        ("1e9", "1000000000.0", True),
    ],
)
def test_outputs_match(got: str, expected: str, match: bool) -> None:
    assert outputs_match(got, expected) is match


def test_status_values_are_stable() -> None:
    assert {s.value for s in TestStatus} == {
        "passed",
        "wrong_answer",
        "compile_error",
        "runtime_error",
        "time_limit_exceeded",
        "sandbox_error",
    }
