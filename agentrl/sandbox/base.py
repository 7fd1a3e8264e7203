"""The sandbox contract: run untrusted code under hard limits and report what happened, as values.

Two-level status, as SandboxFusion has it:

- request status (:class:`RequestStatus`): ``Success`` (the program ran and exited 0), ``Failed`` (the program ran
  and failed: non-zero exit, killed, or over its time limit), ``SandboxError`` (the sandbox itself could not run
  it: that is infrastructure, never the program's fault, and must never be scored as a wrong answer);
- run status (:class:`RunStatus`): ``Finished | Error | TimeLimitExceeded``, ``None`` when nothing ran.

Backends raise nothing for the program's failures. ``Sandbox.run`` raises nothing for the sandbox's own either
(it could not start, died, or is unreachable): that is a ``SandboxError`` result, the same for every backend.
:class:`agentrl.errors.SandboxError` is raised where there is no result to carry it (``Sandbox.session``) and by
helpers that turn a ``SandboxError`` result into an exception (``RunResult.raise_for_sandbox``).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from agentrl.errors import SandboxError


class RequestStatus(str, enum.Enum):
    SUCCESS = "Success"
    FAILED = "Failed"
    SANDBOX_ERROR = "SandboxError"


class RunStatus(str, enum.Enum):
    FINISHED = "Finished"
    ERROR = "Error"
    TIME_LIMIT_EXCEEDED = "TimeLimitExceeded"


@dataclass(frozen=True, slots=True)
class Limits:
    """Hard limits for one run (or for one session's interpreter)."""

    time_s: float = 10.0  # wall-clock limit of the program
    memory_mb: int = 256
    pids: int = 64
    file_size_mb: int = 10
    output_bytes: int = 64 * 1024  # stdout and stderr are each truncated past this, with a marker


@dataclass(frozen=True, slots=True)
class RunRequest:
    code: str
    language: str = "python"  # "python" | "bash" at least
    stdin: str = ""
    files: Mapping[str, bytes] = field(default_factory=dict)  # written into the working dir before the run
    fetch_files: tuple[str, ...] = ()  # read back from the working dir after the run
    limits: Limits = field(default_factory=Limits)


@dataclass(frozen=True, slots=True)
class RunResult:
    status: RequestStatus
    run_status: RunStatus | None
    exit_code: int | None = None
    stdout: str = ""
    stderr: str = ""
    wall_s: float = 0.0
    cpu_s: float = 0.0
    files: Mapping[str, bytes] = field(default_factory=dict)
    message: str = ""  # why, for SandboxError / TimeLimitExceeded
    display: tuple[str, ...] = ()  # session cells: repr of a trailing expression, as Jupyter's text/plain

    @property
    def is_sandbox_error(self) -> bool:
        return self.status is RequestStatus.SANDBOX_ERROR

    def raise_for_sandbox(self) -> RunResult:
        if self.is_sandbox_error:
            raise SandboxError(self.message or "the sandbox failed to run the program")
        return self


@runtime_checkable
class Session(Protocol):
    """A persistent interpreter (one per episode): state survives between ``run`` calls."""

    async def run(self, code: str, *, time_s: float | None = None) -> RunResult: ...

    async def aclose(self) -> None: ...


@runtime_checkable
class Sandbox(Protocol):
    """A sandbox backend (local bubblewrap, Docker, or a remote sandbox server)."""

    async def run(self, request: RunRequest) -> RunResult: ...

    async def session(self, language: str = "python", limits: Limits | None = None) -> Session: ...

    async def aclose(self) -> None: ...
