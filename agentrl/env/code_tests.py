"""``code_tests``: a programming problem answered in one turn with a program in a ```` ```python ```` fence; the
reward is its pass rate on ``task.metadata["tests"]`` (stdin/stdout or assert cases, see
:func:`agentrl.rewards.parse_tests`), each test one run in the shared sandbox (``EnvResources.sandbox``) via
:class:`agentrl.rewards.CodeTestsReward`. A sandbox failure is an infrastructure error (the sample is retried),
never a score of 0.
"""

from __future__ import annotations

from agentrl.env.base import SingleTurnEnv
from agentrl.env.registry import EnvResources
from agentrl.errors import ConfigError
from agentrl.rewards import CodeTestsReward, parse_tests
from agentrl.sandbox.base import Limits
from agentrl.types import Task

SYSTEM_PROMPT = (
    "Solve the programming problem. Answer with a complete Python program in a ```python code block; "
    "it reads its input from stdin and prints the answer to stdout."
)


class CodeTestsEnv(SingleTurnEnv):
    """Programming problems scored by their tests in the sandbox (pass rate, or 0/1 with ``binary``)."""

    name = "code_tests"

    def __init__(self, resources: EnvResources, *, system_prompt: str = SYSTEM_PROMPT, time_limit_s: float = 5.0,
                 memory_mb: int = 256, binary: bool = False, max_concurrency: int = 4) -> None:
        if resources.sandbox is None:
            raise ConfigError("the code_tests environment needs a sandbox (EnvResources.sandbox)")
        self.system_prompt = system_prompt
        self.reward = CodeTestsReward(resources.sandbox, limits=Limits(time_s=time_limit_s, memory_mb=memory_mb),
                                      binary=binary,
                                      max_concurrency=max_concurrency)

    def validate(self, task: Task) -> None:
        if "tests" not in task.metadata:
            raise ConfigError(f"task {task.id!r} has no metadata['tests']; the code_tests environment needs them")
        parse_tests(task.metadata["tests"])  # a bad test spec is the dataset's error: say so before generating
