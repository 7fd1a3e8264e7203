"""The sandbox server's wire format (pydantic v2): SandboxFusion's ``/run_code`` and ``/run_jupyter`` models
(same field names, defaults and status values), agentrl's own lossless ``/v1/...`` models, and the load a server
reports on ``GET /v1/ping`` (:class:`ServerLoad`, in headers) for a fleet's client to steer by.

SandboxFusion's meaning of the run status differs from ours in one place: there, ``Error`` means the sandbox
could not run the command (request status ``SandboxError``), and a program that exits non-zero is ``Finished``
with its ``return_code`` (request status ``Failed``). :func:`to_fusion` and :func:`from_fusion` translate.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from agentrl.sandbox.base import CompileResult, Limits, RequestStatus, RunRequest, RunResult, RunStatus

# ---------------------------------------------------------------------------------------------- SandboxFusion


class CommandRunStatus(str, Enum):
    Finished = "Finished"
    Error = "Error"
    TimeLimitExceeded = "TimeLimitExceeded"


class CommandRunResult(BaseModel):
    status: CommandRunStatus
    execution_time: float | None = None
    return_code: int | None = None
    stdout: str | None = None
    stderr: str | None = None


class RunCodeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    compile_timeout: float = Field(default=10, gt=0, le=600, description="compile timeout of compiled languages")
    run_timeout: float = Field(default=10, gt=0, le=600, description="code run timeout")
    memory_limit_MB: int = Field(default=-1, description="memory limit; -1: the server's default")
    code: str
    stdin: str | None = None
    language: str
    files: dict[str, str | None] = Field(default_factory=dict, description="file path -> base64 content")
    fetch_files: list[str] = Field(default_factory=list)


class RunCodeResponse(BaseModel):
    status: RequestStatus
    message: str
    compile_result: CommandRunResult | None = None
    run_result: CommandRunResult | None = None
    executor_pod_name: str | None = None
    files: dict[str, str] = Field(default_factory=dict)


class RunJupyterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    cells: list[str]
    cell_timeout: float = Field(default=0, ge=0, description="max run time of each cell (0: only the total applies)")
    total_timeout: float = Field(default=45, gt=0, le=3600)
    kernel: Literal["python3"] = "python3"
    files: dict[str, str] = Field(default_factory=dict)
    fetch_files: list[str] = Field(default_factory=list)


class CellRunResult(BaseModel):
    stdout: str
    stderr: str
    display: list[dict[str, Any]]
    error: list[dict[str, Any]]


class RunJupyterResponse(BaseModel):
    status: RequestStatus
    message: str
    driver: CommandRunResult | None = None
    cells: list[CellRunResult] = Field(default_factory=list)
    executor_pod_name: str | None = None
    files: dict[str, str] = Field(default_factory=dict)


def to_fusion(r: RunResult) -> CommandRunResult | None:
    if r.run_status is None:
        return None
    status = CommandRunStatus.TimeLimitExceeded if r.run_status is RunStatus.TIME_LIMIT_EXCEEDED \
        else CommandRunStatus.Finished
    return CommandRunResult(status=status, execution_time=r.wall_s, return_code=r.exit_code, stdout=r.stdout,
                            stderr=r.stderr)


def compile_to_fusion(c: CompileResult | None) -> CommandRunResult | None:
    """SandboxFusion's ``compile_result``: ``Finished`` with the compiler's exit code (minus the signal when it
    was killed), or ``TimeLimitExceeded``."""
    if c is None:
        return None
    status = CommandRunStatus.TimeLimitExceeded if c.status is RunStatus.TIME_LIMIT_EXCEEDED \
        else CommandRunStatus.Finished
    return CommandRunResult(status=status, execution_time=c.wall_s, return_code=c.exit_code, stdout=c.stdout,
                            stderr=c.stderr)


def from_fusion(resp: RunCodeResponse) -> RunResult:
    """A SandboxFusion answer as our RunResult (for clients of real SandboxFusion servers)."""
    rr, cr = resp.run_result, resp.compile_result
    comp = None
    if cr is not None and cr.status is not CommandRunStatus.Error:
        comp = CompileResult(RunStatus.TIME_LIMIT_EXCEEDED if cr.status is CommandRunStatus.TimeLimitExceeded
                             else RunStatus.FINISHED, cr.return_code, cr.stdout or "", cr.stderr or "",
                             cr.execution_time or 0.0)
    if resp.status is not RequestStatus.SANDBOX_ERROR and comp is not None and not comp.ok and rr is None:
        return RunResult(RequestStatus.FAILED, None, None, compile=comp, message=resp.message or "did not compile")
    if resp.status is RequestStatus.SANDBOX_ERROR or rr is None or rr.status is CommandRunStatus.Error:
        return RunResult(RequestStatus.SANDBOX_ERROR, None, message=resp.message or "sandbox error")
    run_status = {CommandRunStatus.TimeLimitExceeded: RunStatus.TIME_LIMIT_EXCEEDED}.get(
        rr.status, RunStatus.FINISHED if rr.return_code == 0 else RunStatus.ERROR)
    files = {k: base64.b64decode(v) for k, v in resp.files.items()}
    return RunResult(resp.status, run_status, rr.return_code, rr.stdout or "", rr.stderr or "",
                     rr.execution_time or 0.0, files=files, message=resp.message, compile=comp)


# ---------------------------------------------------------------------------------------------- agentrl /v1


class LimitsModel(BaseModel):
    time_s: float = Field(default=10.0, gt=0, le=600)
    memory_mb: int = Field(default=256, ge=16, le=16384)
    pids: int = Field(default=64, ge=1, le=4096)
    file_size_mb: int = Field(default=10, ge=0, le=4096)
    output_bytes: int = Field(default=64 * 1024, ge=0, le=64 << 20)
    compile_time_s: float = Field(default=10.0, gt=0, le=600)
    compile_memory_mb: int = Field(default=1024, ge=16, le=16384)

    def to_limits(self) -> Limits:
        return Limits(**self.model_dump())

    @classmethod
    def of(cls, limits: Limits) -> LimitsModel:
        return cls(time_s=limits.time_s, memory_mb=limits.memory_mb, pids=limits.pids,
                   file_size_mb=limits.file_size_mb, output_bytes=limits.output_bytes,
                   compile_time_s=limits.compile_time_s, compile_memory_mb=limits.compile_memory_mb)


class RunModel(BaseModel):
    code: str
    language: str = "python"
    stdin: str = ""
    files: dict[str, str] = Field(default_factory=dict, description="file path -> base64 content")
    fetch_files: list[str] = Field(default_factory=list)
    limits: LimitsModel = Field(default_factory=lambda: LimitsModel())
    cases: list[str] = Field(default_factory=list, description="stdin of each case: compile once, run per case")
    total_time_s: float | None = Field(default=None, gt=0, le=3600)

    def to_request(self) -> RunRequest:
        return RunRequest(code=self.code, language=self.language, stdin=self.stdin,
                          files={k: base64.b64decode(v) for k, v in self.files.items()},
                          fetch_files=tuple(self.fetch_files), limits=self.limits.to_limits(),
                          cases=tuple(self.cases), total_time_s=self.total_time_s)

    @classmethod
    def of(cls, r: RunRequest) -> RunModel:
        return cls(code=r.code, language=r.language, stdin=r.stdin,
                   files={k: base64.b64encode(v).decode("ascii") for k, v in r.files.items()},
                   fetch_files=list(r.fetch_files), limits=LimitsModel.of(r.limits), cases=list(r.cases),
                   total_time_s=r.total_time_s)


class CompileModel(BaseModel):
    status: RunStatus
    exit_code: int | None = None
    stdout: str = ""
    stderr: str = ""
    wall_s: float = 0.0

    @classmethod
    def of(cls, c: CompileResult | None) -> CompileModel | None:
        return None if c is None else cls(status=c.status, exit_code=c.exit_code, stdout=c.stdout,
                                          stderr=c.stderr, wall_s=c.wall_s)

    def to_result(self) -> CompileResult:
        return CompileResult(self.status, self.exit_code, self.stdout, self.stderr, self.wall_s)


class ResultModel(BaseModel):
    status: RequestStatus
    run_status: RunStatus | None
    exit_code: int | None = None
    stdout: str = ""
    stderr: str = ""
    wall_s: float = 0.0
    cpu_s: float = 0.0
    files: dict[str, str] = Field(default_factory=dict)
    message: str = ""
    display: list[str] = Field(default_factory=list)
    compile: CompileModel | None = None
    cases: list[ResultModel] = Field(default_factory=list)

    @classmethod
    def of(cls, r: RunResult) -> ResultModel:
        return cls(status=r.status, run_status=r.run_status, exit_code=r.exit_code, stdout=r.stdout,
                   stderr=r.stderr, wall_s=r.wall_s, cpu_s=r.cpu_s, message=r.message, display=list(r.display),
                   files={k: base64.b64encode(v).decode("ascii") for k, v in r.files.items()},
                   compile=CompileModel.of(r.compile), cases=[cls.of(c) for c in r.cases])

    def to_result(self) -> RunResult:
        return RunResult(self.status, self.run_status, self.exit_code, self.stdout, self.stderr, self.wall_s,
                         self.cpu_s, {k: base64.b64decode(v) for k, v in self.files.items()}, self.message,
                         tuple(self.display), self.compile.to_result() if self.compile else None,
                         tuple(c.to_result() for c in self.cases))


class SessionOpen(BaseModel):
    language: str = "python"
    limits: LimitsModel = Field(default_factory=lambda: LimitsModel())


class SessionOpened(BaseModel):
    session_id: str


class CellModel(BaseModel):
    code: str
    time_s: float | None = Field(default=None, gt=0, le=600)


# ------------------------------------------------------------------------------------------------ server load

LOAD_HEADERS = ("X-Sandbox-Running", "X-Sandbox-Queued", "X-Sandbox-Capacity", "X-Sandbox-Sessions")


@dataclass(frozen=True, slots=True)
class ServerLoad:
    """What a sandbox server is doing now, as ``GET /v1/ping`` reports it in headers (the body stays SandboxFusion's
    ``"pong"``): requests holding a slot, requests waiting for one, slots (``max_concurrency``), open sessions."""

    running: int
    queued: int
    capacity: int
    sessions: int = 0

    @property
    def busy(self) -> int:
        """Requests the server holds: running or queued."""
        return self.running + self.queued

    def headers(self) -> dict[str, str]:
        return dict(zip(LOAD_HEADERS, map(str, (self.running, self.queued, self.capacity, self.sessions))))

    @classmethod
    def from_headers(cls, headers: Mapping[str, str]) -> ServerLoad | None:
        """The load a server reported, or None from a server that does not report it (an older one, or
        SandboxFusion itself)."""
        try:
            running, queued, capacity, sessions = (int(headers[h]) for h in LOAD_HEADERS)
        except (KeyError, ValueError):
            return None
        return cls(running, queued, max(1, capacity), sessions)
