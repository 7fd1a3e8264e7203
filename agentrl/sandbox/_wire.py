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
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from agentrl.sandbox.base import CompileResult, Limits, RequestStatus, RunRequest, RunResult, RunStatus
from agentrl.sandbox.languages import LANGUAGE_TABLE, LANGUAGES, heap_mb

COMPILE_PIDS = 128  # the compile step's pids floor: compilers fork (cc1plus, as, ld) and JVMs start threads
MAX_CASES_OUTPUT = 48 << 20  # cases x 2 streams x output_bytes must fit in one result frame
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
        if kind not in (b"O", b"E", b"R", b"K", b"C") or \
                n > (MAX_RESULT_FRAME if kind in (b"R", b"K", b"C") else max_chunk):
            raise ProtocolError(f"bad frame from the sandbox: kind {kind!r}, {n} bytes")
        return kind, await self.reader.readexactly(n)


@dataclass
class Collected:
    """What one run (or one cell) sent back; ``result`` is None if the stream ended first."""

    stdout: bytearray = field(default_factory=bytearray)
    stderr: bytearray = field(default_factory=bytearray)
    result: dict[str, Any] | None = None
    compiled: dict[str, Any] | None = None  # the C frame: the compile step succeeded
    started: bool = False  # the launcher acknowledged the request (K): failures after it are the program's
    error: str = ""  # why the stream ended early


async def collect(conn: Conn, out_limit: int, got: Collected,
                  on_compiled: Callable[[], Awaitable[bool]] | None = None) -> Collected:
    """Read O/E frames into ``got`` until R (or the end of the stream), keeping at most ``out_limit`` bytes per
    stream. Filling a caller's object keeps the partial output when the caller's deadline cancels us. After a
    compile step (C), ``on_compiled`` prepares the run and says whether it may go; the launcher is told."""
    try:
        while True:
            kind, payload = await conn.frame(max(out_limit, 1))
            if kind == b"C":
                got.compiled = json.loads(payload)
                go = await on_compiled() if on_compiled is not None else True
                await conn.send({"op": "go" if go else "abort"})
                continue
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
        raise ConfigError(f"sandbox language must be one of {', '.join(LANGUAGES)}; got {request.language!r}")
    if request.limits.time_s <= 0 or request.limits.compile_time_s <= 0:
        raise ConfigError(f"limits.time_s and limits.compile_time_s must be > 0, got {request.limits.time_s} "
                          f"and {request.limits.compile_time_s}")
    if request.cases and request.run_time_s <= 0:
        raise ConfigError(f"total_time_s must be > 0, got {request.total_time_s}")
    if len(request.cases) * 2 * request.limits.output_bytes > MAX_CASES_OUTPUT:
        raise ConfigError(f"{len(request.cases)} cases x 2 streams x output_bytes {request.limits.output_bytes} "
                          f"exceed {MAX_CASES_OUTPUT >> 20} MiB: send fewer cases per request or a smaller "
                          "output_bytes")


def compile_limits(limits: Limits) -> Limits:
    """The compile step's limits: its own time and memory (never less than the program's), at least COMPILE_PIDS
    processes, files up to 256 MiB (a binary can pass the program's file-size limit; the scratch bounds it)."""
    return Limits(time_s=limits.compile_time_s, memory_mb=max(limits.compile_memory_mb, limits.memory_mb),
                  pids=max(limits.pids, COMPILE_PIDS), file_size_mb=max(limits.file_size_mb, 256),
                  output_bytes=limits.output_bytes)


def rlimits(limits: Limits, *, cgroup_memory: bool, nproc: int | None = None,
            vm_reserve_mb: int = 0) -> dict[str, int | None]:
    """rlimits for the launcher to apply. With a memory cgroup, RLIMIT_AS is a loose backstop (address space
    overshoots resident memory: thread stacks, malloc arenas); without one it is the memory limit. Runtimes
    that reserve address space up front (JVM, V8, Go) get ``vm_reserve_mb`` more."""
    mem = limits.memory_mb << 20
    return {
        "cpu_s": math.ceil(limits.time_s) + 1,
        "fsize": limits.file_size_mb << 20,
        "nofile": NOFILE,
        "as_bytes": (2 * mem + (256 << 20) if cgroup_memory else mem + (64 << 20)) + (vm_reserve_mb << 20),
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


def _argv(template: tuple[str, ...], memory_mb: int) -> list[str]:
    return [a.format(heap_mb=heap_mb(memory_mb)) if "{" in a and "heap_mb" in a else a for a in template]


def run_message(request: RunRequest, *, cgroup_memory: bool, nproc: int | None = None,
                wipe: tuple[str, ...] = (), check_clean: bool = False, keep: bool = False) -> dict[str, Any]:
    lang = LANGUAGE_TABLE[request.language]
    lim = request.limits
    build = None
    if lang.compiled:
        comp = compile_limits(lim)
        build = {"argv": _argv(lang.compile, comp.memory_mb), "env": dict(lang.env), "time_s": comp.time_s,
                 "limits": rlimits(comp, cgroup_memory=cgroup_memory, nproc=nproc, vm_reserve_mb=lang.vm_reserve_mb)}
    return {
        "op": "run",
        "language": request.language,
        "code": request.code,
        "source": lang.source,
        "argv": _argv(lang.run, lim.memory_mb),
        "env": dict(lang.env),
        "tools": list(lang.tools),
        "compile": build,
        "cases": list(request.cases) if request.cases else None,
        "total_time_s": request.run_time_s,
        "stdin": request.stdin,
        "files": {k: base64.b64encode(v).decode("ascii") for k, v in request.files.items()},
        "fetch_files": list(request.fetch_files),
        "fetch_cap": FETCH_CAP,
        "limits": rlimits(lim, cgroup_memory=cgroup_memory, nproc=nproc, vm_reserve_mb=lang.vm_reserve_mb),
        "time_s": lim.time_s,
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


def run_result(got: Collected, request: RunRequest, *, host_timeout: bool, oom: bool, wall_s: float) -> RunResult:
    """The program's outcome. The stream ending early or the host's deadline passing happen only after the
    program started, so they are the program's doing (it killed its launcher, or ran out of memory)."""
    limits = request.limits
    r = got.result or {}
    raw_compile = r.get("compile") or got.compiled
    comp = _compile_result(raw_compile, limits) if raw_compile else None
    if comp is None and LANGUAGE_TABLE[request.language].compiled and got.result is None:
        # the stream ended (or the deadline passed) before the compile step reported
        comp = CompileResult(RunStatus.TIME_LIMIT_EXCEEDED if host_timeout else RunStatus.ERROR, None, wall_s=wall_s)
    if comp is not None and not comp.ok:
        why = {RunStatus.TIME_LIMIT_EXCEEDED: f"ran past its time limit of {limits.compile_time_s:g}s",
               RunStatus.ERROR: "was killed" + (" (out of memory)" if oom else "")}.get(
            comp.status, f"exited with code {comp.exit_code}")
        return RunResult(RequestStatus.FAILED, None, None, wall_s=comp.wall_s, compile=comp,
                         message=f"the program did not compile: the compiler {why}")
    if r.get("aborted"):
        return RunResult(RequestStatus.FAILED, None, None, wall_s=wall_s, compile=comp,
                         message="the build left more in the sandbox than the run's memory limit allows")
    files = {k: base64.b64decode(v) for k, v in (r.get("files") or {}).items()}
    if r.get("cases") is not None and not host_timeout:
        cases = tuple(_outcome(c, text(c.get("stdout", "").encode(), int(c.get("out_bytes", 0)),
                                       limits.output_bytes),
                               text(c.get("stderr", "").encode(), int(c.get("err_bytes", 0)), limits.output_bytes),
                               limits, timed_out=bool(c.get("timed_out")), oom=False)
                      for c in r["cases"])
        return _summary(cases, len(request.cases), comp, files, wall_s)
    stdout = text(got.stdout, int(r.get("out_bytes", len(got.stdout))), limits.output_bytes)
    stderr = text(got.stderr, int(r.get("err_bytes", len(got.stderr))), limits.output_bytes)
    if host_timeout or r.get("timed_out"):
        return RunResult(RequestStatus.FAILED, RunStatus.TIME_LIMIT_EXCEEDED, None, stdout, stderr,
                         float(r.get("wall_s", wall_s)), float(r.get("cpu_s", 0.0)), compile=comp,
                         message=f"the program ran past its time limit of {request.run_time_s:g}s and was killed")
    if got.result is None:
        why = "ran out of memory" if oom else got.error or "ended its sandbox before the result was reported"
        return RunResult(RequestStatus.FAILED, RunStatus.ERROR, None, stdout, stderr, wall_s, compile=comp,
                         message=f"the program {why}")
    return _outcome(r, stdout, stderr, limits, timed_out=False, oom=oom, files=files, compile=comp)


def _compile_result(c: dict[str, Any], limits: Limits) -> CompileResult:
    out = text(c.get("stdout", "").encode(), int(c.get("out_bytes", 0)), limits.output_bytes)
    err = text(c.get("stderr", "").encode(), int(c.get("err_bytes", 0)), limits.output_bytes)
    wall = float(c.get("wall_s", 0.0))
    if c.get("timed_out") or c.get("signal") == signal.SIGXCPU:
        return CompileResult(RunStatus.TIME_LIMIT_EXCEEDED, None, out, err, wall)
    if c.get("signal") is not None:
        return CompileResult(RunStatus.ERROR, -int(c["signal"]), out, err, wall)
    return CompileResult(RunStatus.FINISHED, c.get("exit_code"), out, err, wall)


def _outcome(r: dict[str, Any], stdout: str, stderr: str, limits: Limits, *, timed_out: bool, oom: bool,
             files: dict[str, bytes] | None = None, compile: CompileResult | None = None) -> RunResult:
    """One finished process of the program (a run, or a case) as a result."""
    common: dict[str, Any] = {"stdout": stdout, "stderr": stderr, "wall_s": float(r.get("wall_s", 0.0)),
                              "cpu_s": float(r.get("cpu_s", 0.0)), "files": files or {}, "compile": compile}
    code, sig = r.get("exit_code"), r.get("signal")
    if timed_out:
        return RunResult(RequestStatus.FAILED, RunStatus.TIME_LIMIT_EXCEEDED, None, **common,
                         message=f"the program ran past its time limit of {limits.time_s:g}s and was killed")
    if sig == signal.SIGXCPU:
        return RunResult(RequestStatus.FAILED, RunStatus.TIME_LIMIT_EXCEEDED, -sig, **common,
                         message="the program used up its CPU time limit")
    if code == 0:
        return RunResult(RequestStatus.SUCCESS, RunStatus.FINISHED, 0, **common)
    if sig is not None:
        why = f"killed by {_signal_name(sig)}" + (" (out of memory)" if oom else "")
        return RunResult(RequestStatus.FAILED, RunStatus.ERROR, -sig, **common, message=why)
    return RunResult(RequestStatus.FAILED, RunStatus.ERROR, code, **common,
                     message=f"the program exited with code {code}")


def _summary(cases: tuple[RunResult, ...], wanted: int, comp: CompileResult | None, files: dict[str, bytes],
             wall_s: float) -> RunResult:
    """A request with cases: Success when every case ran and succeeded; else Failed, with the run status of the
    first case that did not (TimeLimitExceeded when the total time ran out before all cases ran)."""
    first_bad = next((c for c in cases if c.status is not RequestStatus.SUCCESS), None)
    common: dict[str, Any] = {"wall_s": wall_s, "cpu_s": sum(c.cpu_s for c in cases), "files": files,
                              "compile": comp, "cases": cases}
    if first_bad is not None:
        return RunResult(RequestStatus.FAILED, first_bad.run_status, first_bad.exit_code, **common,
                         message=f"case {cases.index(first_bad)}: {first_bad.message}")
    if len(cases) < wanted:
        return RunResult(RequestStatus.FAILED, RunStatus.TIME_LIMIT_EXCEEDED, None, **common,
                         message=f"the total time limit ran out after {len(cases)} of {wanted} cases")
    return RunResult(RequestStatus.SUCCESS, RunStatus.FINISHED, 0, **common)
