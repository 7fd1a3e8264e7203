"""ReTool: math with a Python code interpreter.

The model writes ``<code>…</code>`` (optionally with a ```python fence inside); generation stops at ``</code>``;
the sandbox runs the code in a persistent interpreter (state carries across turns) and the answer is appended as
``\\n<interpreter>\\n…\\n</interpreter>\\n`` — tool tokens, loss mask 0. The final ``\\boxed{}`` answer is checked
by the math reward.
"""

from __future__ import annotations

import re
import time
import warnings
from dataclasses import dataclass
from typing import Any

from agentrl.env.base import Environment, Observation, StepResult, prompt_messages
from agentrl.env.registry import EnvResources
from agentrl.errors import ConfigError
from agentrl.retool_format import format_interpreter
from agentrl.rewards import FormatReward, MathReward, RewardFn, RewardInput, RewardResult, WeightedReward
from agentrl.types import Task, ToolCall, ToolResult

CODE_OPEN, CODE_CLOSE = "<code>", "</code>"

SYSTEM_PROMPT = (
    "You are a helpful assistant that solves math problems. You may run Python by writing code between "
    "<code> and </code>; the result appears between <interpreter> and </interpreter>. "
    "Put the final answer in \\boxed{}."
)

_FENCE = re.compile(r"^\s*```[a-zA-Z0-9_+-]*\s*\n(.*?)\n?\s*```\s*$", re.S)


@dataclass(frozen=True, slots=True)
class CodeCall:
    """The code cell of one turn. ``error`` is set (and ``code`` empty) when the call is malformed."""

    code: str
    raw: str
    error: str | None = None


def parse_code_call(text: str) -> CodeCall | None:
    """The code cell of one model turn, or None if the turn has no ``<code>`` tag (an answer turn).

    - complete: ``…<code>X</code>…`` → ``X`` (a ```python fence around X is removed);
    - truncated: ``<code>`` without ``</code>`` → malformed ("not closed");
    - nested: a second ``<code>`` before the first ``</code>`` → malformed;
    - a stray ``</code>`` with no opening tag → malformed; empty code → malformed.
    """
    start = text.find(CODE_OPEN)
    close = text.find(CODE_CLOSE)
    if start < 0:
        if close >= 0:
            return CodeCall("", text[: close + len(CODE_CLOSE)], "found </code> without an opening <code>")
        return None
    body_start = start + len(CODE_OPEN)
    end = text.find(CODE_CLOSE, body_start)
    if end < 0:
        return CodeCall("", text[start:], "the <code> block is not closed with </code>")
    body = text[body_start:end]
    raw = text[start : end + len(CODE_CLOSE)]
    if CODE_OPEN in body:
        return CodeCall("", raw, "nested <code> tags: close each block with </code> before opening another")
    fenced = _FENCE.match(body)
    code = (fenced.group(1) if fenced else body).strip("\n")
    if not code.strip():
        return CodeCall("", raw, "the <code> block is empty")
    return CodeCall(code, raw)


def syntax_error(code: str) -> str | None:
    """What the interpreter would print for code that does not parse (its traceback's last line, e.g.
    ``SyntaxError: '(' was never closed``), or None if it parses. Only compiled, never run: CPython's compile
    folds constants within size limits, so no input makes it expensive beyond its length."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # SyntaxWarnings (e.g. `x is 1`) are not errors
            compile(code, "<cell>", "exec", dont_inherit=True)
    except SyntaxError as exc:  # also IndentationError, TabError
        return f"{type(exc).__name__}: {exc.msg}"
    except (ValueError, RecursionError, MemoryError) as exc:  # e.g. absurd nesting
        return f"{type(exc).__name__}: {exc}"
    return None


def render_run_output(stdout: str, stderr: str, status: str, *, max_chars: int) -> str:
    """What the model sees of a run: stdout, then stderr on error, capped; a timeout says so."""
    if status == "TimeLimitExceeded":
        text = (stdout + "\n" if stdout else "") + "TimeoutError: the code ran past its time limit and was stopped"
    elif status == "Finished":
        text = stdout if stdout.strip() else "(no output; use print() to see values)"
    else:
        text = (stdout + "\n" if stdout else "") + (stderr.strip().splitlines()[-1] if stderr.strip() else "Error")
    if len(text) > max_chars:
        text = text[:max_chars] + f"\n…[truncated {len(text) - max_chars} characters]"
    return text


class ReToolEnv(Environment):
    """Math problems solved with a Python interpreter in the sandbox (one stateful session per episode)."""

    name = "retool"
    stop = (CODE_CLOSE,)

    def __init__(self, resources: EnvResources, *, max_tool_calls: int = 4, code_timeout_s: float = 5.0,
                 max_output_chars: int = 1024, system_prompt: str = SYSTEM_PROMPT, stateful: bool = True,
                 format_weight: float = 0.0) -> None:
        if resources.sandbox is None:
            raise ConfigError("the retool environment needs a sandbox (EnvResources.sandbox)")
        if resources.verifier is None:
            raise ConfigError("the retool environment needs a math checker pool (EnvResources.verifier)")
        self.resources = resources
        self.max_tool_calls = max_tool_calls
        self.code_timeout_s = code_timeout_s
        self.max_output_chars = max_output_chars
        self.system_prompt = system_prompt
        self.stateful = stateful
        components: dict[str, tuple[RewardFn, float]] = {"correct": (MathReward(resources.verifier), 1.0)}
        if format_weight:
            components["format"] = (FormatReward(), format_weight)
        self.reward = WeightedReward(components)
        self.task: Task | None = None
        self.calls = 0
        self._session: Any = None

    async def reset(self, task: Task) -> list[dict[str, Any]]:
        self.task = task
        self.calls = 0
        return prompt_messages(task, self.system_prompt)

    async def step(self, text: str) -> StepResult:
        call = parse_code_call(text)
        if call is None:
            return StepResult(observation=None, done=True)
        if call.error is not None:
            tc = ToolCall(name="python", arguments={}, raw=call.raw, error=call.error)
            tr = ToolResult(name="python", status="malformed", output=call.error)
            return StepResult(Observation(text=format_interpreter(f"Error: {call.error}")), False, (tc,), (tr,))
        self.calls += 1
        tc = ToolCall(name="python", arguments={"code": call.code}, raw=call.raw)
        if self.calls > self.max_tool_calls:
            tr = ToolResult(name="python", status="budget", output="tool-call budget exhausted")
            return StepResult(None, True, (tc,), (tr,))
        if (bad_syntax := syntax_error(call.code)) is not None:
            # Code that does not parse is a malformed call (it counts against the format reward), answered with
            # exactly what the interpreter would print. Without this a SyntaxError scored like a wrong answer, and
            # RL on wordings whose solutions end in `))` unlearned the closing `)` of `print(a * b + c)`: the
            # demo's pass rate fell from 0.6 to 0.1 within 6 steps (docs/results.md).
            tc = ToolCall(name="python", arguments={"code": call.code}, raw=call.raw, error=bad_syntax)
            tr = ToolResult(name="python", status="malformed", output=bad_syntax)
            return StepResult(Observation(text=format_interpreter(bad_syntax)), False, (tc,), (tr,))
        t0 = time.monotonic()
        result = await self._run(call.code)
        run_status = result.run_status.value if result.run_status is not None else "SandboxError"
        if result.is_sandbox_error:
            output = "Error: the sandbox failed to run this code"
        else:
            output = render_run_output(result.stdout, result.stderr, run_status, max_chars=self.max_output_chars)
        tr = ToolResult(name="python", status=run_status, output=output, latency_s=time.monotonic() - t0)
        return StepResult(Observation(text=format_interpreter(output)), False, (tc,), (tr,))

    async def _run(self, code: str) -> Any:
        from agentrl.sandbox.base import Limits, RunRequest

        if not self.stateful:
            return await self.resources.sandbox.run(RunRequest(code=code, limits=Limits(time_s=self.code_timeout_s)))
        if self._session is None:
            self._session = await self.resources.sandbox.session("python", Limits(time_s=self.code_timeout_s))
        return await self._session.run(code, time_s=self.code_timeout_s)

    async def score(self, response: RewardInput) -> RewardResult:
        """``correct`` (1 if the last ``\\boxed{}`` of the model's own text equals the answer) plus
        ``format_weight`` × ``format``; interpreter output never counts as the model's answer."""
        if self.task is None:
            raise RuntimeError("score() called before reset()")
        return await self.reward(self.task, response)

    async def close(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.aclose()
