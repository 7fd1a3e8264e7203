"""Host side of the launcher protocol (see ``runtime/launcher.py``): frames in, requests out, results built.

Everything read from a sandbox is untrusted: frames are bounded, output is capped, unknown kinds end the
conversation. Shared by the local and Docker backends.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import json
import math
import signal
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from agentrl.sandbox.base import Limits, RequestStatus, RunRequest, RunResult, RunStatus

LANGUAGES = ("python", "bash")
MAX_RESULT_FRAME = 96 << 20  # an R frame carries fetched files (base64)
FETCH_CAP = 16 << 20
NOFILE = 1024
# The whole environment a sandboxed program sees (one BLAS thread: address-space limits and 1-CPU quotas).
SANDBOX_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8",
    "USER": "nobody", "LOGNAME": "nobody", "PYTHONDONTWRITEBYTECODE": "1", "MALLOC_ARENA_MAX": "2",
    "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
}


@functools.cache
def launcher_source() -> str:
    return (Path(__file__).parent / "runtime" / "launcher.py").read_text(encoding="utf-8")


class ByteReader(Protocol):
    async def readexactly(self, n: int) -> bytes: ...


class ByteWriter(Protocol):
    def write(self, data: bytes) -> None: ...

    async def drain(self) -> None: ...


class ProtocolError(Exception):
    """The sandbox sent something that is not a valid frame."""


class Conn:
    """One launcher's duplex stream."""

    def __init__(self, reader: ByteReader, writer: ByteWriter) -> None:
        self.reader, self.writer = reader, writer

    async def send(self, obj: dict[str, Any]) -> None:
        body = json.dumps(obj).encode("utf-8")
        self.writer.write(struct.pack(">I", len(body)) + body)
        await self.writer.drain()

    async def frame(self, max_chunk: int) -> tuple[bytes, bytes]:
        """(kind, payload); raises ``asyncio.IncompleteReadError`` at EOF, ProtocolError on garbage."""
        head = await self.reader.readexactly(5)
        kind, (n,) = head[:1], struct.unpack(">I", head[1:])
        if kind not in (b"O", b"E", b"R", b"K") or n > (MAX_RESULT_FRAME if kind in (b"R", b"K") else max_chunk):
            raise ProtocolError(f"bad frame from the sandbox: kind {kind!r}, {n} bytes")
        return kind, await self.reader.readexactly(n)


@dataclass
class Collected:
    """What one run (or one cell) sent back; ``result`` is None if the stream ended first."""

    stdout: bytearray = field(default_factory=bytearray)
    stderr: bytearray = field(default_factory=bytearray)
    result: dict[str, Any] | None = None
    started: bool = False  # the launcher acknowledged the request (K): failures after it are the program's
    error: str = ""  # why the stream ended early


async def collect(conn: Conn, out_limit: int, got: Collected) -> Collected:
    """Read O/E frames into ``got`` until R (or the end of the stream), keeping at most ``out_limit`` bytes per
    stream. Filling a caller's object keeps the partial output when the caller's deadline cancels us."""
    try:
        while True:
            kind, payload = await conn.frame(max(out_limit, 1))
            if kind == b"R":
                got.result = json.loads(payload)
                if not isinstance(got.result, dict):
                    raise ProtocolError("the result frame is not a JSON object")
                return got
            if kind == b"K":
                got.started = True
                continue
            buf = got.stdout if kind == b"O" else got.stderr
            buf += payload[: max(0, out_limit - len(buf))]
    except asyncio.IncompleteReadError:
        got.error = "ended its sandbox before the result was reported (it killed or crashed the launcher)"
    except (ProtocolError, ValueError) as exc:
        got.error = f"broke the sandbox's protocol ({exc})"
    return got


async def ping(conn: Conn) -> dict[str, Any]:
    await conn.send({"op": "ping"})
    kind, payload = await conn.frame(0)
    if kind != b"K":
        raise ProtocolError(f"expected the launcher's ready frame, got {kind!r}")
    return json.loads(payload)


def text(data: bytes | bytearray, total: int, limit: int) -> str:
    """Decoded output; past ``limit`` bytes it is cut and ends with a marker naming how much was dropped."""
    out = bytes(data[:limit]).decode("utf-8", errors="replace")
    if total > limit:
        out += f"\n[agentrl: output truncated, {total - limit} more bytes not shown]"
    return out


def check_request(request: RunRequest) -> None:
    from agentrl.errors import ConfigError

    if request.language not in LANGUAGES:
        raise ConfigError(f"sandbox language must be one of {LANGUAGES}, got {request.language!r}")
    if request.limits.time_s <= 0:
        raise ConfigError(f"limits.time_s must be > 0, got {request.limits.time_s}")


def rlimits(limits: Limits, *, cgroup_memory: bool, nproc: int | None = None) -> dict[str, int | None]:
    """rlimits for the launcher to apply. With a memory cgroup, RLIMIT_AS is a loose backstop (address space
    overshoots resident memory: thread stacks, malloc arenas); without one it is the memory limit."""
    mem = limits.memory_mb << 20
    return {
        "cpu_s": math.ceil(limits.time_s) + 1,
        "fsize": limits.file_size_mb << 20,
        "nofile": NOFILE,
        "as_bytes": 2 * mem + (256 << 20) if cgroup_memory else mem + (64 << 20),
        "nproc": nproc,
    }


def repl_message(limits: Limits, *, cgroup_memory: bool, nproc: int | None = None) -> dict[str, Any]:
    """Start a session's interpreter: the rlimits hold for its whole life, except CPU (budgeted per cell)."""
    return {"op": "repl", "workdir": "/tmp",
            "limits": dict(rlimits(limits, cgroup_memory=cgroup_memory, nproc=nproc), cpu_s=None)}


async def start_repl(conn: Conn, message: dict[str, Any]) -> None:
    await conn.send(message)
    kind, payload = await conn.frame(0)
    if kind != b"R" or not json.loads(payload).get("ok"):
        raise ProtocolError(f"the interpreter did not start: {payload[:500]!r}")


def run_message(request: RunRequest, *, cgroup_memory: bool, nproc: int | None = None,
                wipe: tuple[str, ...] = (), check_clean: bool = False, keep: bool = False) -> dict[str, Any]:
    return {
        "op": "run",
        "language": request.language,
        "code": request.code,
        "stdin": request.stdin,
        "files": {k: base64.b64encode(v).decode("ascii") for k, v in request.files.items()},
        "fetch_files": list(request.fetch_files),
        "fetch_cap": FETCH_CAP,
        "limits": rlimits(request.limits, cgroup_memory=cgroup_memory, nproc=nproc),
        "time_s": request.limits.time_s,
        "out_limit": request.limits.output_bytes,
        "workdir": "/tmp",
        "wipe": list(wipe),
        "check_clean": check_clean,
        "keep": keep,
    }


def sandbox_error(message: str, wall_s: float = 0.0) -> RunResult:
    return RunResult(RequestStatus.SANDBOX_ERROR, None, wall_s=wall_s, message=message)


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def run_result(got: Collected, limits: Limits, *, host_timeout: bool, oom: bool, wall_s: float) -> RunResult:
    """The program's outcome. The stream ending early or the host's deadline passing happen only after the
    program started, so they are the program's doing (it killed its launcher, or ran out of memory)."""
    r = got.result or {}
    stdout = text(got.stdout, int(r.get("out_bytes", len(got.stdout))), limits.output_bytes)
    stderr = text(got.stderr, int(r.get("err_bytes", len(got.stderr))), limits.output_bytes)
    common: dict[str, Any] = {"stdout": stdout, "stderr": stderr,
                              "wall_s": float(r.get("wall_s", wall_s)), "cpu_s": float(r.get("cpu_s", 0.0))}
    if host_timeout or r.get("timed_out"):
        return RunResult(RequestStatus.FAILED, RunStatus.TIME_LIMIT_EXCEEDED, None, **common,
                         message=f"the program ran past its time limit of {limits.time_s:g}s and was killed")
    if got.result is None:
        why = "ran out of memory" if oom else got.error or "ended its sandbox before the result was reported"
        return RunResult(RequestStatus.FAILED, RunStatus.ERROR, None, **common, message=f"the program {why}")
    files = {k: base64.b64decode(v) for k, v in (r.get("files") or {}).items()}
    code, sig = r.get("exit_code"), r.get("signal")
    if sig == signal.SIGXCPU:
        return RunResult(RequestStatus.FAILED, RunStatus.TIME_LIMIT_EXCEEDED, -sig, **common, files=files,
                         message="the program used up its CPU time limit")
    if code == 0:
        return RunResult(RequestStatus.SUCCESS, RunStatus.FINISHED, 0, **common, files=files)
    if sig is not None:
        why = f"killed by {_signal_name(sig)}" + (" (out of memory)" if oom else "")
        return RunResult(RequestStatus.FAILED, RunStatus.ERROR, -sig, **common, files=files, message=why)
    return RunResult(RequestStatus.FAILED, RunStatus.ERROR, code, **common, files=files,
                     message=f"the program exited with code {code}")
