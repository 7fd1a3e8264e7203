"""agentrl's errors: one root, two branches.

    AgentRLError
    ├── ConfigError            bad user input: config, model name, dataset, environment options
    └── InfrastructureError    something agentrl depends on failed; never the model's fault, never a reward of 0
        ├── EngineError        an inference server call failed (names the server and the call)
        ├── SandboxError       the sandbox could not run the program (not: the program failed)
        ├── QueueError         Redis unreachable, too old, or a queue operation failed
        └── TrainerError       the trainer process failed

The model's own mistakes (malformed tool calls, code that raises, a wrong answer) are not exceptions: they become
observations or rewards.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class AgentRLError(Exception):
    """Root of every error agentrl raises on purpose."""


class ConfigError(AgentRLError, ValueError):
    """Invalid user input; the message says what was expected and what came."""


class InfrastructureError(AgentRLError):
    """A component agentrl depends on failed (retry or drop the sample; never score it)."""


class EngineError(InfrastructureError):
    """An inference-server call failed or timed out."""


class SandboxError(InfrastructureError):
    """The sandbox could not run the program (as opposed to the program failing)."""


class QueueError(InfrastructureError):
    """Redis is unreachable, too old, or a queue operation failed."""


class TrainerError(InfrastructureError):
    """The trainer failed."""


def closest(word: str, choices: Iterable[str]) -> str | None:
    """The known name closest to a misspelt one (difflib ratio >= 0.6), for "did you mean" in error messages."""
    found = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return found[0] if found else None
