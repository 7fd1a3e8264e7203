"""agentrl's errors: one root, two branches (bad input vs failed infrastructure), and a few leaves of their own.

    AgentRLError
    ├── ConfigError (ValueError)   bad user input: config, model name, dataset, environment options
    │   ├── DatasetError           data.loader: a dataset file that cannot be used as configured
    │   └── SpecError              eval.base: a field of an evaluation spec (``loc`` names it)
    │       └── UnknownEnvironmentError
    ├── InfrastructureError        something agentrl depends on failed; never the model's fault, never a reward of 0
    │   ├── EngineError            an inference server call failed (names the server and the call; ``status``:
    │   │                          the HTTP status where the server answered one)
    │   │   ├── EngineUnavailable  engine.base: the server cannot be reached or dropped the connection
    │   │   ├── EngineTimeout      engine.base: a call did not finish within its deadline
    │   │   ├── _Busy              engine.client (private): a 502/503 the client's retry waits out
    │   │   └── _Retryable         engine.openai_chat (private): a 429/5xx or dropped connection, retried
    │   ├── SandboxError           the sandbox could not run the program (not: the program failed)
    │   │   └── ServerUnavailable  sandbox.remote: a sandbox server unreachable or refusing (429/5xx) after
    │   │                          every attempt; nothing ran, so a fleet sends the run to another server
    │   ├── RewardError            a reward could not be computed (its sandbox or checker failed): the sample
    │   │                          has no score; the episode raises it, the scheduler retries or drops the group
    │   ├── VerifierError          rewards.base: the math checker pool failed (a reward returns it as INFRA_ERROR)
    │   ├── QueueError             Redis unreachable, too old, or a queue operation failed
    │   │   ├── QueueFullError     queue.base: the queue stayed full past the producer's timeout
    │   │   ├── AlreadyRunningError  queue.redis_server: another process runs this directory's Redis
    │   │   └── WeightVersionError queue.base: a weight version unknown (or rewound), or published twice
    │   │       └── VersionWaitTimeout (TimeoutError)  queue.weight_registry
    │   ├── McpServerError         mcp.base: an MCP server could not be started or reached, closed the
    │   │                          connection, answered a protocol error, or did not answer a call in time
    │   ├── AgentError             env.agent: an agent made no chat request or did not return in its time limit
    │   ├── ContinuityError        gateway.base: a session branch's tokens stopped being the engine's (a bug)
    │   ├── TrainerError           the trainer process failed
    │   ├── RolloutDiedError       launcher.placement: the rollout process died mid-run (continue with --resume)
    │   ├── WeightSyncError        weight_sync: a broadcast of weights to the servers failed (a peer did not join
    │   │                          or receive in time, a server refused a bucket); retried, then disk
    │   └── TooManyErrors          eval.runner: an evaluation's samples kept failing in a row
    ├── SchemaError (ValueError)   types: a trajectory payload of an unknown wire schema
    ├── ApiError                   client: the eval REST service answered an error or could not be reached
    ├── TaskNotFound (LookupError) api.base: no evaluation task has this id
    ├── TaskLost                   api.base: this worker no longer owns the task
    ├── StoreFull                  api.base: the eval task store is at its byte bound (a 507; a task past its own
    │                              records bound fails with it)
    ├── IdempotencyConflict        api.base: an Idempotency-Key reused with another request body (a 409)
    ├── SessionNotFound (LookupError)  gateway.base: no live gateway session has this id (or API key)
    │   └── _Unauthorized          gateway.app (private): the same, answered as 401 to a bad API key
    └── SessionClosed              gateway.base: the session was finalized or aborted, it takes no more requests

The model's own mistakes (malformed tool calls, code that raises, a wrong answer) are not exceptions: they become
observations or rewards (``env.tools.ToolArgumentsError``, a ValueError outside the tree, becomes an observation, and
so does ``mcp.base.McpToolError``, an MCP tool's answer with ``isError``).
Reward functions report an infrastructure failure as a value (``RewardResult.infra_error``, SandboxFusion's
two-level status); the episode turns it into :class:`RewardError`, so no trajectory carries one.
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
    """An inference-server call failed or timed out. ``status``: the HTTP status the server answered, where it
    answered one (None: no answer, a timeout, or not an HTTP failure)."""

    def __init__(self, *args: object, status: int | None = None) -> None:
        super().__init__(*args)
        self.status = status  # in __dict__, which BaseException's pickling carries (Ray sends errors between processes)


class SandboxError(InfrastructureError):
    """The sandbox could not run the program (as opposed to the program failing)."""


class QueueError(InfrastructureError):
    """Redis is unreachable, too old, or a queue operation failed."""


class RewardError(InfrastructureError):
    """A reward could not be computed (its sandbox or checker failed): the sample has no score."""


class TrainerError(InfrastructureError):
    """The trainer failed."""


def closest(word: str, choices: Iterable[str]) -> str | None:
    """The known name closest to a misspelt one (difflib ratio >= 0.6), for "did you mean" in error messages."""
    found = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return found[0] if found else None
