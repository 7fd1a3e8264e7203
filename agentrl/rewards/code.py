"""Code rewards: compile the response's program once and run it on the task's test cases in the sandbox.

Tests come from the task (see :meth:`CodeTestsReward.tests_of`) in the public datasets' formats
(:func:`agentrl.rewards.parse_tests`): stdin/stdout cases in any sandbox language (``python``, ``cpp``, ``c``,
``java``, ``go``, ``rust``, ``nodejs``, ``typescript``, ``bash``), assert cases and function-call cases
(``fn_name``) in Python. The program is the response's last fenced block of the language (see
:meth:`CodeTestsReward.language_of`). One sandbox request per kind of test: the program is compiled once and run
once per case (``RunRequest.cases``), each case within ``limits.time_s``, all within ``total_time_s``.

Outcomes are kept apart, as the sandbox reports them:

- the program failed (does not compile, wrong output, an exception, a failed assert, over its time or memory
  limit): the test fails and the score is the pass rate (or 0/1 with ``binary=True``);
- the sandbox failed (``RequestStatus.SANDBOX_ERROR``, a missing toolchain included, an exception from the
  sandbox client, or no answer within the limits plus ``grace_s``): the result is ``INFRA_ERROR`` with no score.

Assert and function-call tests run inside a harness that loads the program under ``__name__ ==
"__solution__"`` (so an ``if __name__ == "__main__"`` block does not run), runs the test, then prints a nonce
it read from stdin (after the return value's JSON, for a call). A test passes only if that nonce ends stdout, so a
program that calls ``sys.exit(0)`` or ``os._exit(0)`` to skip the test fails. (A program that inspects the
harness's frames could still find the nonce; that is beyond what we defend against here.)
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from agentrl.errors import ConfigError
from agentrl.rewards._code_tests import (
    CompareMode,
    TestCase,
    extract_program,
    find_program,
    outputs_match,
    parse_tests,
    returns_match,
)
from agentrl.rewards.base import RewardInput, RewardResult
from agentrl.sandbox.base import Limits, RequestStatus, RunRequest, RunResult, RunStatus, Sandbox
from agentrl.sandbox.languages import LANGUAGE_TABLE, LANGUAGES
from agentrl.types import Task

log = logging.getLogger(__name__)

__all__ = ["CodeTestsReward", "TestCase", "TestOutcome", "TestReport", "TestStatus", "extract_program",
           "find_program", "outputs_match", "parse_tests", "returns_match"]

_EXIT_ASSERT = 3  # the harness's exit code for a failed assert (any other non-zero exit is a runtime error)
_LCB_KEYS = ("public_test_cases", "private_test_cases")


class TestStatus(str, enum.Enum):
    __test__ = False

    PASSED = "passed"
    WRONG_ANSWER = "wrong_answer"  # wrong stdout or return value, a failed assert, or exited before the test
    COMPILE_ERROR = "compile_error"  # the program does not compile (every test fails)
    RUNTIME_ERROR = "runtime_error"  # an exception, a non-zero exit, or killed (e.g. memory)
    TIME_LIMIT_EXCEEDED = "time_limit_exceeded"  # its own limit, or the total ran out before it
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


_PRELUDE = """\
import json, os, sys, traceback
def _agentrl_load(solution):
    namespace = {"__name__": "__solution__", "__builtins__": __builtins__}
    exec(compile(solution, "solution.py", "exec"), namespace)
    return namespace
def _agentrl_end(nonce, tail=""):
    sys.stdout.flush()
    print()
    print(nonce + tail)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
def _agentrl_fail(why):
    print(why, file=sys.stderr)
    sys.stderr.flush()
    os._exit(%(assert_code)d)
"""
# stdin: the nonce, a newline, the test's Python statements
_ASSERT_HARNESS = _PRELUDE + """\
def _agentrl_harness(solution):
    nonce, _, tests = sys.stdin.read().partition("\\n")
    try:
        namespace = _agentrl_load(solution)
        exec(compile(tests, "tests.py", "exec"), namespace)
    except SystemExit as exc:
        _agentrl_fail(f"the program exited ({exc.code!r}) before the tests finished")
    except AssertionError:
        _agentrl_fail(traceback.format_exc())
    _agentrl_end(nonce)
_agentrl_harness(%(solution)r)
"""
# stdin: the nonce, a newline, the JSON list of arguments; stdout ends with the nonce and the result's JSON
_CALL_HARNESS = _PRELUDE + """\
def _agentrl_harness(solution, fn_name):
    nonce, _, args = sys.stdin.read().partition("\\n")
    try:
        namespace = _agentrl_load(solution)
        fn = namespace.get(fn_name)
        if not callable(fn) and isinstance(namespace.get("Solution"), type):
            fn = getattr(namespace["Solution"](), fn_name, None)
        if not callable(fn):
            _agentrl_fail(f"the program defines no function {fn_name!r} (nor a method of Solution)")
        result = json.dumps(fn(*json.loads(args)), default=repr)
    except SystemExit as exc:
        _agentrl_fail(f"the program exited ({exc.code!r}) before returning")
    _agentrl_end(nonce, result)
_agentrl_harness(%(solution)r, %(fn_name)r)
"""


class CodeTestsReward:
    """Pass rate of the response's program on the task's tests (see the module docstring).

    ``language``: the program's language, fixed; None: ``task.metadata["language"]``, else the language of the
    response's last fenced block with a known tag (python when untagged). ``compare`` and ``float_tol``: how
    stdout is compared (:func:`outputs_match`); function-call results are compared as JSON, floats within
    ``float_tol``. ``limits.time_s`` is each test's time limit, ``total_time_s`` all tests' (default: the sum);
    ``limits.compile_time_s`` and ``compile_memory_mb`` bound the compile step. ``limiter`` bounds concurrent
    sandbox requests (pass one shared semaphore to bound several rewards together; default:
    ``max_concurrency``). ``grace_s`` is how long past the limits a request may take before the sandbox counts
    as failed; it must cover the sandbox's own queueing. The sandbox is the caller's: this reward never closes it.
    """

    def __init__(self, sandbox: Sandbox, *, limits: Limits | None = None, max_concurrency: int = 4,
                 limiter: asyncio.Semaphore | None = None, grace_s: float = 30.0, binary: bool = False,
                 tests_key: str = "tests", language: str | None = None, compare: CompareMode = "float",
                 float_tol: float = 1e-6, total_time_s: float | None = None) -> None:
        if language is not None and language not in LANGUAGES:
            raise ConfigError(f"the code reward's language must be one of {', '.join(LANGUAGES)}; got {language!r}")
        if compare not in ("exact", "whitespace", "float"):
            raise ConfigError(f"compare must be exact, whitespace or float; got {compare!r}")
        if total_time_s is not None and total_time_s <= 0:
            raise ConfigError(f"total_time_s must be > 0, got {total_time_s}")
        self._sandbox = sandbox
        self._limits = limits or Limits(time_s=5.0)
        self._limiter = limiter or asyncio.Semaphore(max_concurrency)
        self._grace_s, self._binary, self._tests_key = grace_s, binary, tests_key
        self._language, self._compare, self._tol, self._total_s = language, compare, float_tol, total_time_s

    def tests_of(self, task: Task) -> tuple[TestCase, ...]:
        """The task's tests: ``metadata[tests_key]`` (a dotted key walks nested columns, e.g.
        ``reward_model.ground_truth``); when the key is absent, LiveCodeBench's columns (``public_test_cases``,
        ``private_test_cases``, ``metadata``) in the task's metadata, else verl's ``reward_model.ground_truth``."""
        value: Any = task.metadata
        for part in self._tests_key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        # a column a row leaves null counts as absent: a dataset mixing formats has every column in every row
        if value is None and any(task.metadata.get(k) is not None for k in _LCB_KEYS):
            value = {k: v for k, v in task.metadata.items() if k in (*_LCB_KEYS, "metadata") and v is not None}
        if value is None and isinstance(task.metadata.get("reward_model"), dict):
            value = task.metadata["reward_model"].get("ground_truth")
        if value is None:
            raise ConfigError(f"task {task.id!r} has no metadata[{self._tests_key!r}] (nor LiveCodeBench's "
                              "public_test_cases / verl's reward_model.ground_truth); the code reward needs tests")
        return parse_tests(value)

    def language_of(self, task: Task) -> str | None:
        language = self._language or task.metadata.get("language")
        if language is not None and language not in LANGUAGES:
            raise ConfigError(f"task {task.id!r}: metadata['language'] must be one of {', '.join(LANGUAGES)}; "
                              f"got {language!r}")
        return language

    async def __call__(self, task: Task, response: RewardInput, /) -> RewardResult:
        tests = self.tests_of(task)
        found = find_program(response.text, self.language_of(task))
        if found is None:
            return RewardResult.scored(0.0, reason="no_program", passed=0, total=len(tests), tests=())
        language, program = found
        report = await self.run_tests(program, tests, language=language)
        tests_detail = tuple({"status": o.status.value, "wall_s": round(o.wall_s, 4), "message": o.message}
                             for o in report.outcomes)
        if report.infra_error is not None:
            return RewardResult.infra_error(report.infra_error, tests=tests_detail, language=language)
        score = report.pass_rate if not self._binary else float(report.passed == report.total)
        return RewardResult.scored(score, passed=report.passed, total=report.total, tests=tests_detail,
                                   language=language)

    async def run_tests(self, program: str, tests: Sequence[TestCase], *, language: str = "python") -> TestReport:
        """Run every test: one sandbox request per kind of test (stdio, assert, call), concurrently within the
        limiter; a sandbox failure voids the report."""
        groups: dict[str, list[tuple[int, TestCase]]] = {}
        for i, t in enumerate(tests):
            groups.setdefault(t.kind, []).append((i, t))
        infra: list[str] = []
        try:
            async with asyncio.TaskGroup() as tg:
                runs = [tg.create_task(self._run_group(program, language, kind, group))
                        for kind, group in groups.items()]
        except* _SandboxFailed as failed:
            infra.extend(str(e) for e in failed.exceptions)
        if infra:
            return TestReport((), len(tests), infra_error=infra[0])
        outcomes = [o for run in runs for o in run.result()]
        return TestReport(tuple(sorted(outcomes, key=lambda o: o.index)), len(tests))

    async def _run_group(self, program: str, language: str, kind: str,
                         group: list[tuple[int, TestCase]]) -> list[TestOutcome]:
        if kind != "stdio" and language != "python":
            why = f"{'assert' if kind == 'assert' else 'function-call'} tests need a Python program, got {language}"
            return [TestOutcome(i, TestStatus.WRONG_ANSWER, message=why) for i, _ in group]
        nonces = [secrets.token_hex(16) if kind != "stdio" else "" for _ in group]
        if kind == "stdio":
            code, cases = program, tuple(t.stdin for _, t in group)
        elif kind == "assert":
            code = _ASSERT_HARNESS % {"solution": program, "assert_code": _EXIT_ASSERT}
            cases = tuple(f"{n}\n{t.assertion}" for n, (_, t) in zip(nonces, group))
        else:
            fn_name = group[0][1].fn_name
            code = _CALL_HARNESS % {"solution": program, "fn_name": fn_name, "assert_code": _EXIT_ASSERT}
            cases = tuple(f"{n}\n{json.dumps(list(t.args))}" for n, (_, t) in zip(nonces, group))
        request = RunRequest(code=code, language=language, cases=cases, limits=self._limits,
                             total_time_s=self._total_s)
        budget = request.run_time_s + self._grace_s + \
            (self._limits.compile_time_s if LANGUAGE_TABLE[language].compiled else 0.0)
        async with self._limiter:
            try:
                async with asyncio.timeout(budget):
                    result = await self._sandbox.run(request)
            except TimeoutError:
                raise _SandboxFailed(f"the sandbox did not answer within {budget:.0f}s") from None
            except Exception as exc:  # any failure of the sandbox client is infrastructure, not the program
                log.warning("sandbox run failed: %r", exc)
                raise _SandboxFailed(repr(exc)) from exc
        if result.status is RequestStatus.SANDBOX_ERROR:
            raise _SandboxFailed(result.message or "sandbox error")
        if result.compile is not None and not result.compile.ok:
            why = (result.compile.stderr or result.compile.stdout or result.message)[-500:]
            return [TestOutcome(i, TestStatus.COMPILE_ERROR, result.compile.wall_s, why) for i, _ in group]
        out = []
        for k, (i, test) in enumerate(group):
            if k >= len(result.cases):
                out.append(TestOutcome(i, TestStatus.TIME_LIMIT_EXCEEDED,
                                       message="the total time limit ran out before this test ran"))
            else:
                out.append(self._judge(i, result.cases[k], test, nonces[k]))
        return out

    def _judge(self, index: int, result: RunResult, test: TestCase, nonce: str) -> TestOutcome:
        """One case's result as a test outcome."""
        tail, wall = result.stderr[-500:], result.wall_s
        if result.run_status is RunStatus.TIME_LIMIT_EXCEEDED:
            return TestOutcome(index, TestStatus.TIME_LIMIT_EXCEEDED, wall, result.message)
        if test.kind != "stdio" and result.exit_code == _EXIT_ASSERT:
            return TestOutcome(index, TestStatus.WRONG_ANSWER, wall, tail)
        if result.status is not RequestStatus.SUCCESS:
            return TestOutcome(index, TestStatus.RUNTIME_ERROR, wall, tail or result.message)
        if test.kind == "stdio":
            assert test.expected_stdout is not None
            if outputs_match(result.stdout, test.expected_stdout, self._tol, self._compare):
                return TestOutcome(index, TestStatus.PASSED, wall)
            return TestOutcome(index, TestStatus.WRONG_ANSWER, wall, "stdout differs from the expected output")
        lines = result.stdout.rstrip("\n").splitlines()
        last = lines[-1] if lines else ""
        if not last.startswith(nonce):
            return TestOutcome(index, TestStatus.WRONG_ANSWER, wall, "the program ended before the test ran")
        if test.kind == "assert" or _returns(last[len(nonce):], test.returns, self._tol):
            return TestOutcome(index, TestStatus.PASSED, wall)
        return TestOutcome(index, TestStatus.WRONG_ANSWER, wall,
                           f"{test.fn_name} returned {last[len(nonce):][:200]}, expected {json.dumps(test.returns)[:200]}")


def _returns(got_json: str, expected: Any, tol: float) -> bool:
    try:
        got = json.loads(got_json)
    except ValueError:
        return False
    return returns_match(got, expected, tol)


class _SandboxFailed(Exception):
    """The sandbox (not the program) failed: the report has no score."""
