"""The sandbox contract: run untrusted code under hard limits and report what happened, as values.

Two-level status, as SandboxFusion has it:

- request status (:class:`RequestStatus`): ``Success`` (the program ran and exited 0), ``Failed`` (the program ran
  and failed: non-zero exit, killed, or over its time limit), ``SandboxError`` (the sandbox itself could not run
  it: that is infrastructure, never the program's fault, and must never be scored as a wrong answer);
- run status (:class:`RunStatus`): ``Finished | Error | TimeLimitExceeded``, ``None`` when nothing ran.

A compiled language (``cpp``, ``c``, ``java``, ``go``, ``rust``, ``typescript``) first compiles, under its own
limits (``Limits.compile_time_s``, ``compile_memory_mb``), reported in ``RunResult.compile``; a program that
does not compile is the program's failure (``Failed``), never a sandbox error. A language whose toolchain the
sandbox lacks is a ``SandboxError`` naming the Debian package to install.

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
    compile_time_s: float = 10.0  # wall-clock limit of the compile step (compiled languages only)
    compile_memory_mb: int = 1024  # memory of the compile step: compilers need more than the program


@dataclass(frozen=True, slots=True)
class RunRequest:
    """One program. ``language`` is one of :data:`agentrl.sandbox.languages.LANGUAGES` (SandboxFusion's names).

    With ``cases``, the program is compiled once and run once per case, each case's string as its stdin and
    ``limits.time_s`` as its time limit, all cases within ``total_time_s`` (default: ``time_s`` per case);
    ``stdin`` is then unused and the result's ``cases`` holds one result per case that ran, in order.
    """

    code: str
    language: str = "python"
    stdin: str = ""
    files: Mapping[str, bytes] = field(default_factory=dict)  # written into the working dir before the run
    fetch_files: tuple[str, ...] = ()  # read back from the working dir after the run
    limits: Limits = field(default_factory=Limits)
    cases: tuple[str, ...] = ()
    total_time_s: float | None = None

    @property
    def run_time_s(self) -> float:
        """Wall time the program may take after its compile step: one run, or all cases."""
        if not self.cases:
            return self.limits.time_s
        return self.total_time_s if self.total_time_s is not None else self.limits.time_s * len(self.cases)


@dataclass(frozen=True, slots=True)
class CompileResult:
    """The compile step of a compiled language (SandboxFusion's ``compile_result``): ``FINISHED`` with the
    compiler's exit code (non-zero: the program does not compile), ``TIME_LIMIT_EXCEEDED`` past
    ``limits.compile_time_s``, ``ERROR`` when the compiler was killed (e.g. out of memory; ``exit_code`` is
    minus the signal)."""

    status: RunStatus
    exit_code: int | None
    stdout: str = ""
    stderr: str = ""
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status is RunStatus.FINISHED and self.exit_code == 0


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
    compile: CompileResult | None = None  # compiled languages; a failed compile: FAILED, run_status None
    cases: tuple[RunResult, ...] = ()  # a request with cases: one result per case that ran

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
