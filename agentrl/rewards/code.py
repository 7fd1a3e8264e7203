"""Code rewards: run the response's program against the task's test cases in the sandbox.

Tests come from ``task.metadata["tests"]`` (see :func:`parse_tests` for the accepted shapes): stdin/stdout
cases (the program reads stdin, its stdout must match) and assert-based cases (Python statements run after
the program's definitions). Each test is one sandbox run with its own time limit.

Outcomes are kept apart, as the sandbox reports them:

- the program failed (wrong output, an exception, a failed assert, over its time or memory limit): the test
  fails and the score is the pass rate (or 0/1 with ``binary=True``);
- the sandbox failed (``RequestStatus.SANDBOX_ERROR``, an exception from the sandbox client, or no answer
  within the limit plus ``grace_s``): the result is ``INFRA_ERROR`` with no score; remaining tests are
  cancelled.

Assert tests run inside a harness that loads the program under ``__name__ == "__solution__"`` (so a
``if __name__ == "__main__"`` block does not run), then the asserts, then prints a nonce it read from stdin.
A test passes only if that nonce is the last line of stdout, so a program that calls ``sys.exit(0)`` or
``os._exit(0)`` to skip the asserts fails. (A program that inspects the harness's frames could still find the
nonce; that is beyond what we defend against here.)
"""

from __future__ import annotations

import asyncio
import enum
import logging
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from agentrl.errors import ConfigError
from agentrl.rewards.base import RewardInput, RewardResult
from agentrl.sandbox.base import Limits, RequestStatus, RunRequest, RunResult, RunStatus, Sandbox
from agentrl.types import Task

log = logging.getLogger(__name__)

_PYTHON_TAGS = frozenset({"python", "py", "python3", "py3"})
_EXIT_ASSERT = 3  # the harness's exit code for a failed assert (any other non-zero exit is a runtime error)


def extract_program(text: str) -> str | None:
    """The last ```` ```python ```` fenced block (also ``py``, ``python3``); else the last untagged fence.

    Linear in the length of ``text`` (plain ``str.find``; no regex that could backtrack on a huge response).
    """
    blocks: list[tuple[str, str]] = []
    pos = 0
    while (start := text.find("```", pos)) >= 0:
        line_end = text.find("\n", start)
        end = -1 if line_end < 0 else text.find("```", line_end + 1)
        if end < 0:
            break
        info = text[start + 3 : line_end].split()
        blocks.append((info[0].lower() if info else "", text[line_end + 1 : end]))
        pos = end + 3
    for tags in (_PYTHON_TAGS, frozenset({""})):
        code = next((body for tag, body in reversed(blocks) if tag in tags), None)
        if code is not None and code.strip():
            return code
    return None


class TestCase(BaseModel):
    """One test: ``stdin`` + ``expected_stdout``, or an ``assertion`` (Python statements)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    __test__ = False  # not a pytest test class

    stdin: str = ""
    expected_stdout: str | None = None
    assertion: str | None = None

    @model_validator(mode="after")
    def _one_kind(self) -> TestCase:
        if (self.expected_stdout is None) == (self.assertion is None):
            raise ValueError("a test needs exactly one of expected_stdout and assertion")
        return self


_ALIASES = {
    "input": "stdin",
    "output": "expected_stdout",
    "stdout": "expected_stdout",
    "expected_output": "expected_stdout",
    "assert": "assertion",
    "code": "assertion",
}


def parse_tests(raw: Any) -> tuple[TestCase, ...]:
    """Test cases from a task's metadata. Accepted shapes:

    - ``[{"stdin": ..., "expected_stdout": ...}, {"assertion": "assert f(1) == 2"}, ...]`` (also the keys
      ``input``/``output``/``stdout``/``expected_output``/``assert``/``code``);
    - ``["assert f(1) == 2", ...]``;
    - ``{"inputs": [...], "outputs": [...]}`` (APPS style) or ``{"asserts": [...]}``.
    """
    try:
        if isinstance(raw, dict) and "inputs" in raw:
            if len(raw["inputs"]) != len(raw.get("outputs", ())):
                raise ValueError("inputs and outputs differ in length")
            raw = [{"stdin": i, "expected_stdout": o} for i, o in zip(raw["inputs"], raw["outputs"])]
        elif isinstance(raw, dict) and "asserts" in raw:
            raw = list(raw["asserts"])
        if not isinstance(raw, list) or not raw:
            raise ValueError(f"expected a non-empty list of tests, got {type(raw).__name__}")
        return tuple(
            TestCase(assertion=t)
            if isinstance(t, str)
            else TestCase(**{_ALIASES.get(k, k): v for k, v in t.items()})
            for t in raw
        )
    except (ValidationError, ValueError, TypeError, AttributeError, KeyError) as exc:
        raise ConfigError(
            f"bad code tests ({exc}); expected a list of {{stdin, expected_stdout}} / {{assertion}} objects, "
            "a list of assert strings, or {inputs, outputs}"
        ) from exc


class TestStatus(str, enum.Enum):
    __test__ = False

    PASSED = "passed"
    WRONG_ANSWER = "wrong_answer"  # wrong stdout, a failed assert, or the program exited before the asserts
    RUNTIME_ERROR = "runtime_error"  # an exception, a non-zero exit, or killed (e.g. memory)
    TIME_LIMIT_EXCEEDED = "time_limit_exceeded"
    SANDBOX_ERROR = "sandbox_error"  # infrastructure: never a verdict on the program


@dataclass(frozen=True, slots=True)
class TestOutcome:
    __test__ = False

    index: int
    status: TestStatus
    wall_s: float = 0.0
    message: str = ""  # the tail of stderr, or the sandbox's error


@dataclass(frozen=True, slots=True)
class TestReport:
    """Per-test outcomes; ``infra_error`` is set when the sandbox failed (then the report has no score)."""

    __test__ = False

    outcomes: tuple[TestOutcome, ...]
    total: int
    infra_error: str | None = None

    @property
    def passed(self) -> int:
        return sum(o.status is TestStatus.PASSED for o in self.outcomes)

    @property
    def pass_rate(self) -> float:
        return self.passed / self.total if self.total else 0.0


def outputs_match(got: str, expected: str, rel_tol: float = 1e-6) -> bool:
    """Lines equal up to trailing whitespace; else tokens equal, numbers within ``rel_tol``."""

    def lines(s: str) -> list[str]:
        return [line.rstrip() for line in s.strip().splitlines()]

    if lines(got) == lines(expected):
        return True
    got_tokens, expected_tokens = got.split(), expected.split()
    return len(got_tokens) == len(expected_tokens) and all(
        _tokens_match(g, e, rel_tol) for g, e in zip(got_tokens, expected_tokens)
    )


def _tokens_match(got: str, expected: str, rel_tol: float) -> bool:
    if got == expected:
        return True
    if not any(c in expected for c in ".eE"):
        return False
    try:
        g, e = float(got), float(expected)
    except ValueError:
        return False
    return abs(g - e) <= rel_tol * max(1.0, abs(e))


_HARNESS = """\
import os, sys, traceback
def _agentrl_harness(solution, tests):
    nonce = sys.stdin.readline().strip()
    namespace = {"__name__": "__solution__", "__builtins__": __builtins__}
    try:
        exec(compile(solution, "solution.py", "exec"), namespace)
        exec(compile(tests, "tests.py", "exec"), namespace)
    except SystemExit as exc:
        print(f"the program exited ({exc.code!r}) before the tests finished", file=sys.stderr)
        sys.stderr.flush()
        os._exit(%(assert_code)d)
    except AssertionError:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(%(assert_code)d)
    sys.stdout.flush()
    print()
    print(nonce)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
_agentrl_harness(%(solution)r, %(tests)r)
"""


class CodeTestsReward:
    """Pass rate of the response's program on ``task.metadata[tests_key]`` (see the module docstring).

    ``limiter`` bounds concurrent sandbox runs (pass one shared semaphore to bound several rewards together;
    default: ``max_concurrency``). ``grace_s`` is how long past ``limits.time_s`` a run may take before the
    sandbox counts as failed; it must cover the sandbox's own queueing. The sandbox is the caller's: this
    reward never closes it.
    """

    def __init__(
        self,
        sandbox: Sandbox,
        *,
        limits: Limits | None = None,
        max_concurrency: int = 4,
        limiter: asyncio.Semaphore | None = None,
        grace_s: float = 30.0,
        binary: bool = False,
        tests_key: str = "tests",
    ) -> None:
        self._sandbox = sandbox
        self._limits = limits or Limits(time_s=5.0)
        self._limiter = limiter or asyncio.Semaphore(max_concurrency)
        self._grace_s = grace_s
        self._binary = binary
        self._tests_key = tests_key

    async def __call__(self, task: Task, response: RewardInput, /) -> RewardResult:
        if self._tests_key not in task.metadata:
            raise ConfigError(
                f"task {task.id!r} has no metadata[{self._tests_key!r}]; the code reward needs tests"
            )
        tests = parse_tests(task.metadata[self._tests_key])
        program = extract_program(response.text)
        if program is None:
            return RewardResult.scored(0.0, reason="no_program", passed=0, total=len(tests), tests=())
        report = await self.run_tests(program, tests)
        tests_detail = tuple(
            {"status": o.status.value, "wall_s": round(o.wall_s, 4), "message": o.message}
            for o in report.outcomes
        )
        if report.infra_error is not None:
            return RewardResult.infra_error(report.infra_error, tests=tests_detail)
        score = report.pass_rate if not self._binary else float(report.passed == report.total)
        return RewardResult.scored(score, passed=report.passed, total=report.total, tests=tests_detail)

    async def run_tests(self, program: str, tests: Sequence[TestCase]) -> TestReport:
        """Run every test (concurrently, within the limiter); stops early when the sandbox fails."""
        failures: list[TestOutcome] = []
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(self._run_one(i, program, t)) for i, t in enumerate(tests)]
        except* _SandboxFailed as group_error:
            failures.extend(e.outcome for e in group_error.exceptions if isinstance(e, _SandboxFailed))
        if failures:
            done = tuple(
                t.result() for t in tasks if t.done() and not t.cancelled() and t.exception() is None
            )
            return TestReport(done + tuple(failures), len(tests), infra_error=failures[0].message)
        return TestReport(tuple(t.result() for t in tasks), len(tests))

    async def _run_one(self, index: int, program: str, test: TestCase) -> TestOutcome:
        nonce = ""
        if test.assertion is not None:
            nonce = secrets.token_hex(16)
            code = _HARNESS % {"solution": program, "tests": test.assertion, "assert_code": _EXIT_ASSERT}
            request = RunRequest(code=code, stdin=nonce + "\n", limits=self._limits)
        else:
            request = RunRequest(code=program, stdin=test.stdin, limits=self._limits)
        async with self._limiter:
            try:
                async with asyncio.timeout(self._limits.time_s + self._grace_s):
                    result = await self._sandbox.run(request)
            except TimeoutError:
                raise _SandboxFailed(
                    TestOutcome(
                        index,
                        TestStatus.SANDBOX_ERROR,
                        message=(
                            f"the sandbox did not answer within {self._limits.time_s + self._grace_s:.0f}s"
                        ),
                    )
                ) from None
            except Exception as exc:  # any failure of the sandbox client is infrastructure, not the program
                log.warning("sandbox run failed: %r", exc)
                raise _SandboxFailed(TestOutcome(index, TestStatus.SANDBOX_ERROR, message=repr(exc))) from exc
        outcome = _judge(index, result, test, nonce)
        if outcome.status is TestStatus.SANDBOX_ERROR:
            raise _SandboxFailed(outcome)
        return outcome


class _SandboxFailed(Exception):
    def __init__(self, outcome: TestOutcome) -> None:
        super().__init__(outcome.message)
        self.outcome = outcome


def _judge(index: int, result: RunResult, test: TestCase, nonce: str) -> TestOutcome:
    """Turn one sandbox result into a test outcome."""
    tail = result.stderr[-500:]
    if result.status is RequestStatus.SANDBOX_ERROR:
        return TestOutcome(index, TestStatus.SANDBOX_ERROR, result.wall_s, result.message or "sandbox error")
    if result.run_status is RunStatus.TIME_LIMIT_EXCEEDED:
        return TestOutcome(index, TestStatus.TIME_LIMIT_EXCEEDED, result.wall_s, result.message)
    if test.assertion is not None:
        if result.exit_code == _EXIT_ASSERT:
            return TestOutcome(index, TestStatus.WRONG_ANSWER, result.wall_s, tail)
        if result.status is not RequestStatus.SUCCESS:
            return TestOutcome(index, TestStatus.RUNTIME_ERROR, result.wall_s, tail or result.message)
        lines = result.stdout.rstrip("\n").splitlines()
        passed = bool(lines) and lines[-1] == nonce
        return TestOutcome(
            index,
            TestStatus.PASSED if passed else TestStatus.WRONG_ANSWER,
            result.wall_s,
            "" if passed else "the program ended before the tests ran",
        )
    if result.status is not RequestStatus.SUCCESS:
        return TestOutcome(index, TestStatus.RUNTIME_ERROR, result.wall_s, tail or result.message)
    assert test.expected_stdout is not None
    if outputs_match(result.stdout, test.expected_stdout):
        return TestOutcome(index, TestStatus.PASSED, result.wall_s)
    return TestOutcome(
        index, TestStatus.WRONG_ANSWER, result.wall_s, "stdout differs from the expected output"
    )
