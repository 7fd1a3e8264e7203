"""``code_tests``: a programming problem answered in one turn with a program in a ```` ```python ```` fence; the
reward is its pass rate on the task's tests (``metadata["tests"]``, LiveCodeBench's columns or verl's
``reward_model.ground_truth``: stdin/stdout, assert or function-call cases, see :func:`agentrl.rewards.parse_tests`),
compiled once and run per test in the shared sandbox (``EnvResources.sandbox``) via
:class:`agentrl.rewards.CodeTestsReward`. ``language`` fixes the program's language (any sandbox language for
stdin/stdout tests; default: the task's ``metadata["language"]`` or the answer's fence tag). A sandbox failure is
an infrastructure error (the sample is retried), never a score of 0.
"""

from __future__ import annotations

from agentrl.env.base import SingleTurnEnv
from agentrl.env.registry import EnvResources
from agentrl.errors import ConfigError
from agentrl.rewards import CodeTestsReward
from agentrl.rewards._code_tests import CompareMode
from agentrl.sandbox.base import Limits
from agentrl.types import Task

SYSTEM_PROMPT = (
    "Solve the programming problem. Answer with a complete Python program in a ```python code block; "
    "it reads its input from stdin and prints the answer to stdout."
)


class CodeTestsEnv(SingleTurnEnv):
    """Programming problems scored by their tests in the sandbox (pass rate, or 0/1 with ``binary``)."""

    name = "code_tests"

    def __init__(self, resources: EnvResources, *, system_prompt: str | None = None, time_limit_s: float = 5.0,
                 memory_mb: int = 256, binary: bool = False, max_concurrency: int = 4, language: str | None = None,
                 compare: CompareMode = "float", total_time_s: float | None = None,
                 compile_time_s: float = 10.0) -> None:
        if resources.sandbox is None:
            raise ConfigError("the code_tests environment needs a sandbox (EnvResources.sandbox)")
        self.system_prompt = system_prompt or (SYSTEM_PROMPT if language in (None, "python") else
                                               SYSTEM_PROMPT.replace("Python", language or "").replace(
                                                   "```python", f"```{language}"))
        limits = Limits(time_s=time_limit_s, memory_mb=memory_mb, compile_time_s=compile_time_s)
        self.reward = CodeTestsReward(resources.sandbox, limits=limits, binary=binary, language=language,
                                      max_concurrency=max_concurrency, compare=compare, total_time_s=total_time_s)

    def validate(self, task: Task) -> None:
        self.reward.tests_of(task)  # no tests, or a bad spec, is the dataset's error: say so before generating
        self.reward.language_of(task)
