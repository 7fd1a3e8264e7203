"""``code_tests``: a programming problem answered in one turn with a program in a ```` ```python ```` fence; the
reward is its pass rate on the task's tests (``metadata["tests"]``, LiveCodeBench's columns or verl's
``reward_model.ground_truth``: stdin/stdout, assert or function-call cases, see :func:`agentrl.rewards.parse_tests`;
``tests_key`` names another column, e.g. TACO's ``input_output``), compiled once and run per test in the shared
sandbox (``EnvResources.sandbox``) via :class:`agentrl.rewards.CodeTestsReward`. ``language`` fixes the program's
language (any sandbox language for stdin/stdout tests); unset, each task's ``metadata["language"]`` does (the
prompt then asks for that language: a dataset may mix Python and C++ problems), else the answer's fence tag. A
sandbox failure is an infrastructure error (the sample is retried), never a score of 0.
"""

from __future__ import annotations

from typing import Any

from agentrl.env.base import SingleTurnEnv, prompt_messages
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
#: how the prompt names a language and its fence (the other languages by their own name)
_NAMES = {"cpp": ("C++", "cpp"), "c": ("C", "c"), "java": ("Java", "java"), "go": ("Go", "go"),
          "rust": ("Rust", "rust"), "nodejs": ("JavaScript (Node.js)", "javascript"),
          "typescript": ("TypeScript", "typescript"), "bash": ("Bash", "bash")}


def system_prompt_for(language: str | None) -> str:
    """The default system prompt asking for a program in ``language`` (None or python: Python)."""
    if language in (None, "python"):
        return SYSTEM_PROMPT
    name, fence = _NAMES.get(language, (language, language))
    return SYSTEM_PROMPT.replace("Python", name).replace("```python", f"```{fence}")


class CodeTestsEnv(SingleTurnEnv):
    """Programming problems scored by their tests in the sandbox (pass rate, or 0/1 with ``binary``)."""

    name = "code_tests"

    def __init__(self, resources: EnvResources, *, system_prompt: str | None = None, time_limit_s: float = 5.0,
                 memory_mb: int = 256, binary: bool = False, max_concurrency: int = 4, language: str | None = None,
                 compare: CompareMode = "float", total_time_s: float | None = None,
                 compile_time_s: float = 10.0, tests_key: str = "tests") -> None:
        if resources.sandbox is None:
            raise ConfigError("the code_tests environment needs a sandbox (EnvResources.sandbox)")
        self._own_prompt = system_prompt
        self.system_prompt = system_prompt or system_prompt_for(language)
        limits = Limits(time_s=time_limit_s, memory_mb=memory_mb, compile_time_s=compile_time_s)
        self.reward = CodeTestsReward(resources.sandbox, limits=limits, binary=binary, language=language,
                                      max_concurrency=max_concurrency, compare=compare, total_time_s=total_time_s,
                                      tests_key=tests_key)

    def validate(self, task: Task) -> None:
        self.reward.tests_of(task)  # no tests, or a bad spec, is the dataset's error: say so before generating
        self.reward.language_of(task)

    async def reset(self, task: Task) -> list[dict[str, Any]]:
        self.validate(task)
        self.task = task
        return prompt_messages(task, self._own_prompt or system_prompt_for(self.reward.language_of(task)))
