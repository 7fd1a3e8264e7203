"""Start, watch and stop SGLang servers (``python -m sglang.launch_server``) as subprocesses.

agentrl talks to SGLang only over HTTP, so the server may run from another Python environment
(``SGLangServerConfig.python``), as it would in its own container on a cluster. On CPU the server gets the flags
seen working on our machines (ENVIRONMENT.md) and our ``sgl_kernel`` stand-in on its ``PYTHONPATH``; on GPU those
are left out and ``extra_args`` pass anything else through.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import IO, Literal

import aiohttp
from pydantic import BaseModel, ConfigDict, Field, field_validator

from agentrl.errors import EngineError
from agentrl.hardware import engine_dtype

logger = logging.getLogger(__name__)

SGL_KERNEL_CPU_DIR = Path(__file__).resolve().parent / "sgl_kernel_cpu"
SGLANG_PLUGIN_DIR = Path(__file__).resolve().parent / "sglang_plugin"  # agentrl_sglang_plugin.py: what it does


def build_cpu_kernels(env: Mapping[str, str] | None = None) -> tuple[Path | None, str | None]:
    """Build the stand-in's compiled CPU kernels (``sgl_kernel/_native.py``, in a child process), before a CPU server
    starts, with ``env``'s ``CXX``, ``PATH`` and ``AGENTRL_CACHE_DIR`` (default this process's): the build (~10 s,
    once per machine and torch version) then happens once, not in every server process, and a failure is logged
    here (and tried again at the next server start). A later call in a new process finds the library by a memo
    (:func:`_kernel_memo`) without the child. ``(library, None)`` when built (or cached), else ``(None, why not)``;
    the servers then keep the PyTorch paths. Never raises."""
    env = os.environ if env is None else env
    return _build_cpu_kernels(env.get("CXX"), env.get("PATH"), env.get("AGENTRL_CACHE_DIR"))


def describe_cpu_kernel_build(env: Mapping[str, str] | None = None) -> str:
    """:func:`build_cpu_kernels`, as the line ``make install`` prints (``scripts/install_venv.sh``)."""
    built, why = build_cpu_kernels(env)
    return "agentrl: SGLang CPU decode kernel " + (
        "ready" if built is not None else f"not built, the servers decode in PyTorch: {why}")


# The build and its cache key need torch (its version, headers and C++ ABI): a child process imports it, so that the
# process starting servers does not hold torch's ~280 MB of anonymous memory for its whole life (the rollout actor
# imports no torch otherwise). Loads _native.py by path: the child imports neither agentrl nor the stand-in. Once
# it has answered, a memo of its inputs' file stamps answers for it in later processes (_kernel_memo).
_BUILD_SCRIPT = """import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("agentrl_sgl_kernel_native", sys.argv[1])
native = importlib.util.module_from_spec(spec)
spec.loader.exec_module(native)
built, why = native.try_build(json.loads(sys.argv[2]))
print(json.dumps([None if built is None else str(built), why]))
"""
_BUILD_CHILD_TIMEOUT_S = 300.0  # the build's own bound (180 s, _native.BUILD_TIMEOUT_S) and torch's import
_BUILT: dict[tuple[str | None, str | None, str | None], Path] = {}  # successes only: a failure is tried again


def _kernel_memo(cxx: str | None, path: str | None, cache: str | None) -> Path | None:
    """Where the library the child found last time for these inputs is written down, named by a fingerprint of what
    its cache key depends on, read without importing torch: the kernel's source, torch's files (``version.py``,
    ``libtorch_cpu.so``: path, size and mtime), the compiler (the driver and, behind a wrapper such as ccache, its
    ``cc1plus``: resolved path, size, mtime), the CPU's flags (the lines ``_native._cpu_flags`` keys on). The
    child costs ~3 s at each server start in a new process (it imports torch), e.g. in each run's rollout actor;
    the memo, a few stats and one compiler call. None when a part cannot be read (then the child decides)."""
    import hashlib
    import importlib.util

    try:
        spec = importlib.util.find_spec("torch")
        compiler = shutil.which(cxx or "g++", path=path)
        if spec is None or spec.origin is None or compiler is None:
            return None
        torch_dir = Path(spec.origin).parent
        key = hashlib.sha256()
        for source in (SGL_KERNEL_CPU_DIR / "sgl_kernel" / "_native.py",
                       SGL_KERNEL_CPU_DIR / "sgl_kernel" / "_attention.cpp"):
            key.update(source.read_bytes())
        stamped = [torch_dir / "version.py", torch_dir / "lib" / "libtorch_cpu.so", Path(compiler).resolve()]
        proper = subprocess.run([compiler, "-print-prog-name=cc1plus"], capture_output=True, text=True, timeout=30,
                                check=False).stdout.strip()
        if os.path.isabs(proper) and os.path.isfile(proper):  # gcc's compiler proper (clang answers a bare name)
            stamped.append(Path(proper).resolve())
        for f in stamped:
            st = f.stat()
            key.update(f"{f}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
        prefixes = ("flags", "model name", "Features", "CPU implementer", "CPU part", "CPU variant")
        with open("/proc/cpuinfo", errors="replace") as info:
            key.update("".join(sorted({ln for ln in info if ln.startswith(prefixes)})).encode())
        key.update(platform.machine().encode())
    except (OSError, ValueError, subprocess.SubprocessError):  # ValueError: find_spec on a broken torch entry
        return None
    root = Path(cache) if cache else Path.home() / ".cache" / "agentrl"
    return root / "kernels" / f"attention-{key.hexdigest()[:24]}.memo"


def _build_cpu_kernels(cxx: str | None, path: str | None, cache: str | None) -> tuple[Path | None, str | None]:
    import json

    if (cxx, path, cache) in _BUILT:
        return _BUILT[cxx, path, cache], None
    memo = _kernel_memo(cxx, path, cache)
    try:
        known = Path(memo.read_text().strip()) if memo is not None else None
    except (OSError, ValueError):  # ValueError: not UTF-8 (a damaged file): the child answers, the memo is rewritten
        known = None
    if known is not None and known.is_file():
        _BUILT[cxx, path, cache] = known
        return known, None

    env = {k: v for k, v in (("CXX", cxx), ("PATH", path), ("AGENTRL_CACHE_DIR", cache)) if v is not None}
    cmd = [sys.executable, "-c", _BUILD_SCRIPT, str(SGL_KERNEL_CPU_DIR / "sgl_kernel" / "_native.py"), json.dumps(env)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=_BUILD_CHILD_TIMEOUT_S,
                              check=False)
        last = done.stdout.strip().splitlines()[-1:]
        if done.returncode != 0 or not last:
            tail = " | ".join(done.stderr.strip().splitlines()[-3:]) or "(no output)"
            raise ValueError(f"exited with {done.returncode}: {tail}")
        found, why = json.loads(last[0])
        built = Path(found) if found else None
    except subprocess.TimeoutExpired:
        built, why = None, f"the build process took over {_BUILD_CHILD_TIMEOUT_S:.0f} s"
    except (OSError, ValueError, TypeError) as e:  # JSONDecodeError is a ValueError
        built, why = None, f"the build process failed: {e}"
    if built is None:
        logger.warning("SGLang CPU servers keep the PyTorch decode attention: the compiled kernel is unavailable (%s)",
                       why)
        return None, why
    logger.info("compiled CPU decode attention for SGLang: %s", built)
    _BUILT[cxx, path, cache] = built
    if memo is not None:
        import tempfile

        tmp: str | None = None
        try:  # atomic: a concurrent reader sees no half-written path; a temporary file of its own per writer
            fd, tmp = tempfile.mkstemp(dir=memo.parent, prefix=memo.name, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                f.write(str(built.resolve()))
            os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide it from the other users of a shared cache
            os.replace(tmp, memo)
        except OSError as e:
            logger.debug("could not write %s: %s", memo, e)
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
    return built, None


# SGLang's crash diagnostics (sglang.srt.environ): off on CPU unless set, see SGLangServer.environment
ONEDNN_CACHE_CAPACITY = 64  # oneDNN kernels a CPU server keeps (see SGLangServer.environment)
CPU_CRASH_DIAGNOSTICS = ("SGLANG_PYSPY_DUMP_BEFORE_CRASH", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH")


def sglang_model_module(model_path: str | Path) -> str | None:
    """The ``sglang.srt.models`` module that defines and exports (``EntryClass``) the first architecture of the
    model's ``config.json``, found by reading the modules' text (importing them is what this saves); None if the
    model, its config or such a module is not found (then SGLang imports every model module, as it does itself)."""
    import json

    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    archs = config.get("architectures") if isinstance(config, dict) else None
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        return None
    return _module_defining(archs[0])


@functools.lru_cache(maxsize=32)
def _module_defining(arch: str) -> str | None:
    """:func:`sglang_model_module`'s scan of SGLang's model modules (~0.1 s; one answer per architecture, as the
    installed SGLang does not change while agentrl runs)."""
    import importlib.util

    spec = importlib.util.find_spec("sglang")
    if spec is None or spec.origin is None:
        return None
    defines = re.compile(rf"^class {re.escape(arch)}\(", re.MULTILINE)
    models = Path(spec.origin).parent / "srt" / "models"
    for source in sorted(models.glob("*.py")):
        try:
            text = source.read_text(errors="replace")
        except OSError:
            continue
        entry = text.rfind("\nEntryClass")  # the module's export: a class or a list of them, at its end
        if entry >= 0 and defines.search(text) and re.search(rf"\b{re.escape(arch)}\b", text[entry:]):
            return f"sglang.srt.models.{source.stem}"
    return None


class SGLangServerConfig(BaseModel):
    """How to start one SGLang server."""

    model_config = ConfigDict(extra="forbid")

    model_path: str = ""
    host: str = "127.0.0.1"
    port: int = 0  # 0: pick a free port
    device: Literal["cpu", "cuda"] = "cpu"
    dtype: str = "auto"  # SGLang's --dtype; auto on CPU: float32 or bfloat16 by agentrl.hardware.engine_dtype
    max_total_tokens: int | None = 16384
    context_length: int | None = None
    tp_size: int = 1
    base_gpu_id: int | None = None  # first GPU of this server (several servers on one node); GPU only
    mem_fraction_static: float | None = None
    python: str | None = None  # interpreter of the SGLang environment (None: the one running agentrl)
    startup_timeout_s: float = 300.0
    extra_args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    log_level: str = "warning"
    # where the server's detokenizer runs: thread (in its launcher process, agentrl's SGLang plugin: ~650 MiB less
    # anonymous memory, its work then shares the launcher's GIL), process (SGLang's default), auto: thread on CPU,
    # process on GPU (a server streaming thousands of requests keeps it parallel)
    detokenizer: Literal["auto", "process", "thread"] = "auto"

    @field_validator("env", mode="before")
    @classmethod
    def _numbers_as_text(cls, value: object) -> object:
        """``engine.env.OMP_NUM_THREADS=2`` on the command line (or ``2`` unquoted in YAML) is a number: an
        environment value is text, so numbers become their text; anything else is left for the type check."""
        if isinstance(value, Mapping):
            return {k: str(v) if isinstance(v, int | float) and not isinstance(v, bool) else v
                    for k, v in value.items()}
        return value


def pool_configs(base: SGLangServerConfig, num_servers: int) -> list[SGLangServerConfig]:
    """Configs of ``num_servers`` servers like ``base``, each on its own free port and, on GPU, on its own
    ``tp_size`` GPUs (``--base-gpu-id`` = i · tp_size)."""
    if num_servers < 1:
        raise EngineError(f"expected at least one server, got num_servers={num_servers}")
    # Several servers on port 0 get their ports chosen together here: one free_port() call each could return the
    # same port twice (the kernel may hand a just-released ephemeral port out again), and two servers cannot share it.
    ports = free_ports(num_servers, base.host) if num_servers > 1 else [base.port]
    out = []
    for i in range(num_servers):
        update: dict[str, object] = {"port": ports[i]}
        if base.device != "cpu":
            update["base_gpu_id"] = (base.base_gpu_id or 0) + i * base.tp_size
        out.append(base.model_copy(update=update))
    return out


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


UVICORN_STARTUP_FAILURE = 3  # uvicorn's exit code when it cannot start (its port taken, among other causes)
FREEZE_GC_TIMEOUT_S = 10.0  # POST /freeze_gc once the server is ready (SGLangServer._freeze_gc)
PORT_MOVES = 3  # other ports a starting server tries when its own was taken meanwhile (see SGLangServer._wait_ready)


def port_is_free(host: str, port: int) -> bool:
    """Whether ``port`` can be bound on ``host`` now, as uvicorn binds it (SO_REUSEADDR: a connection still in
    TIME_WAIT on it does not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct free ports: every socket stays bound until all are chosen."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in sockets:
            s.bind((host, 0))
        return [int(s.getsockname()[1]) for s in sockets]


class SGLangServer:
    """One SGLang server process. ``start()`` returns when ``/health`` answers; ``stop()`` kills its process group.

    Use as a context manager, or call ``stop()`` in a ``finally``: a server is never left running.
    """

    def __init__(self, config: SGLangServerConfig, *, log_path: Path | None = None, name: str = "sglang",
                 on_spawn: Callable[[SGLangServer], None] | None = None, port_chosen: bool | None = None) -> None:
        if not config.model_path:
            raise EngineError("SGLangServerConfig.model_path is empty: expected a local HF model folder")
        self.config = config
        self.name = name
        self.port = config.port or free_port(config.host)
        # A port agentrl chose (port 0, or ``port_chosen``: e.g. pool_configs' ports) may be given up for another
        # while the server has not served yet: see _wait_ready. A restart keeps its port (its clients hold the URL).
        self._may_move_port = (not config.port) if port_chosen is None else port_chosen
        self._port_configured = not self._may_move_port
        # held while the process is swapped: stop() from another thread and a move in _wait_ready never interleave
        self._lock = threading.RLock()
        self.log_path = log_path
        self.on_spawn = on_spawn  # told of every process group started (also restarts), before readiness
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_file: IO[bytes] | None = None
        self._log_start = 0
        self._shm_files: set[str] = set()  # SGLang's /dev/shm files of the running group, unlinked by stop()
        self.gc_frozen = False  # whether the server took POST /freeze_gc at its last start (_freeze_gc)

    @property
    def detokenizer(self) -> Literal["process", "thread"]:
        """Where this server's detokenizer runs (``SGLangServerConfig.detokenizer`` with auto resolved; an
        ``AGENTRL_SGLANG_DETOKENIZER`` of ``engine.env``, which the plugin reads, wins over the key)."""
        set_in_env = self.config.env.get("AGENTRL_SGLANG_DETOKENIZER")
        if set_in_env is not None:  # the plugin runs the thread for "thread" only
            return "thread" if set_in_env == "thread" else "process"
        d = self.config.detokenizer
        if d == "auto":
            return "thread" if self.config.device == "cpu" else "process"
        return d

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    def command(self) -> list[str]:
        c = self.config
        cmd = [
            c.python or sys.executable, "-m", "sglang.launch_server",
            "--model-path", c.model_path,
            "--host", c.host, "--port", str(self.port),
            "--dtype", engine_dtype(c.dtype, c.device),
            "--tp-size", str(c.tp_size),
            "--log-level", c.log_level,
            "--skip-server-warmup",
        ]
        if c.device == "cpu":
            # torch-native kernels; the scheduler sleeps when idle (else it busy-spins a whole core)
            cmd += ["--device", "cpu", "--attention-backend", "torch_native", "--sampling-backend", "pytorch",
                    "--sleep-on-idle", "--disable-cuda-graph"]
        if c.max_total_tokens:
            cmd += ["--max-total-tokens", str(c.max_total_tokens)]
        if c.context_length:
            cmd += ["--context-length", str(c.context_length)]
        if c.base_gpu_id is not None and c.device != "cpu":
            cmd += ["--base-gpu-id", str(c.base_gpu_id)]
        if c.mem_fraction_static is not None:
            cmd += ["--mem-fraction-static", str(c.mem_fraction_static)]
        return cmd + list(c.extra_args)

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("AGENTRL_CPU_KERNEL_LIB", None)  # only :meth:`prepare` names it: the library it built for this server
        thread = self.detokenizer == "thread"
        paths = []
        if self.config.device == "cpu":
            env["SGLANG_USE_CPU_ENGINE"] = "1"
            paths.append(str(SGL_KERNEL_CPU_DIR))
            # SGLang's launcher treats every SIGTERM/SIGQUIT as a crash: with these on (its defaults) it sleeps 5 s
            # "to let GPU activity settle" before a py-spy/CUDA dump, so each stop or restart of a CPU server
            # took 5 s longer. No GPU to settle on a CPU; either can be set back on in the environment or in
            # ``engine.env``. On GPU SGLang's defaults stay (a real crash's dump is worth the 5 s there).
            for name in CPU_CRASH_DIAGNOSTICS:
                env.setdefault(name, "0")
            # oneDNN compiles a kernel per matmul shape and keeps up to 1,024 (its default): every decode batch
            # size and extend length is a shape, so a run's server grew by ~0.5 GB of kernels it rarely reuses
            # (docs/results.md). A few dozen cover the shapes of one forward; the environment or engine.env wins.
            given = {**env, **self.config.env}
            if "DNNL_PRIMITIVE_CACHE_CAPACITY" not in given:  # oneDNN's older name, which its new one would beat
                env.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(ONEDNN_CACHE_CAPACITY))
            # SGLang imports every model module it has at each start (~4 s here) unless an external model package
            # is named: ours imports only the served model's (agentrl_sglang_models). Not when a user names a
            # package, disables the module (SGLANG_DISABLED_MODEL_ARCHS: module names), or runs another SGLang
            # (engine.python: its modules may differ from the ones read here).
            module = sglang_model_module(self.config.model_path) \
                if "SGLANG_EXTERNAL_MODEL_PACKAGE" not in given and self.config.python is None else None
            disabled = {m.strip() for m in given.get("SGLANG_DISABLED_MODEL_ARCHS", "").split(",")}
            if module is not None and module.rsplit(".", 1)[1] not in disabled:
                env["SGLANG_EXTERNAL_MODEL_PACKAGE"] = "agentrl_sglang_models"
                env["AGENTRL_SGLANG_MODEL_MODULE"] = module
        if thread:
            env["AGENTRL_SGLANG_DETOKENIZER"] = "thread"
            paths.append(str(SGLANG_PLUGIN_DIR))
        if paths:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (*paths, env.get("PYTHONPATH")) if p)
        env.update(self.config.env)
        allowed = env.get("SGLANG_PLUGINS")  # SGLang loads only the plugins it names, when it is set
        if thread and allowed and "agentrl" not in {x.strip() for x in allowed.split(",")}:
            env["SGLANG_PLUGINS"] = f"{allowed},agentrl"
        return env

    def prepare(self) -> dict[str, str]:
        """Build what the server's processes load (on CPU: the compiled decode attention, ``build_cpu_kernels``),
        blocking (from async code: in a thread, before :meth:`start_background`, which calls it too; it is cached).
        Returns environment overrides: ``AGENTRL_CPU_KERNEL_LIB`` naming the library built here (the server's
        processes load it without recomputing its cache key), or ``AGENTRL_CPU_KERNELS=0`` when it could not be built,
        so that they do not try again (the reason is logged once, here)."""
        env = self.environment()
        if (self.config.device != "cpu" or self.config.python is not None
                or "0" in (env.get("AGENTRL_SGLANG_CPU_PATCHES"), env.get("AGENTRL_CPU_KERNELS"))):
            return {}  # another interpreter builds its own (its torch may differ), at its first import
        built, _ = build_cpu_kernels(env)
        return {"AGENTRL_CPU_KERNEL_LIB": str(built)} if built is not None else {"AGENTRL_CPU_KERNELS": "0"}

    def start(self) -> SGLangServer:
        """Start the server and block until it is ready (or raise, with the log's tail, and stop it)."""
        self.start_background()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    async def wait_ready_async(self) -> None:
        """The asyncio form of waiting for readiness (the process must have been started)."""
        import asyncio

        try:
            await asyncio.to_thread(self._wait_ready)
        except BaseException:
            self.stop()
            raise

    def start_background(self) -> SGLangServer:
        """Launch the server process and return at once; see :meth:`wait_ready_async`."""
        env = {**self.environment(), **self.prepare()}
        with self._lock:
            if self._proc is not None:
                raise EngineError(f"{self.name} is already started at {self.url}")
            if self._may_move_port and not port_is_free(self.config.host, self.port):
                taken, self.port = self.port, free_port(self.config.host)
                logger.warning("%s: port %d is taken by another process; using %d", self.name, taken, self.port)
            if self.log_path is not None:
                self.log_path.parent.mkdir(parents=True, exist_ok=True)
                self._log_file = open(self.log_path, "ab")
                self._log_start = self._log_file.tell()  # this launch's part of the log (a restart appends)
            out = self._log_file if self._log_file is not None else subprocess.DEVNULL
            self.gc_frozen = False  # this launch's processes: _wait_ready asks them
            logger.info("starting %s on %s with %s", self.name, self.url, self.config.model_path)
            self._proc = subprocess.Popen(
                self.command(), env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        if self.on_spawn is not None:
            self.on_spawn(self)
        return self

    def _wait_ready(self) -> None:
        import http.client
        import urllib.error
        import urllib.request

        proc = self._proc
        deadline = time.monotonic() + self.config.startup_timeout_s
        moves = 0
        foreign_logged = False
        while time.monotonic() < deadline:
            if self._proc is not proc or proc is None:
                raise EngineError(f"{self.name} was stopped while starting")
            if proc.poll() is not None:
                if not self._port_was_taken(proc.returncode):
                    raise EngineError(
                        f"{self.name} exited with code {proc.returncode} while starting; see {self.log_path}:\n"
                        + self.log_tail()
                    )
                # Another process bound the port between its choice and SGLang's bind (~30 s later, after the
                # model is loaded): any socket bound to port 0 meanwhile may get it, the server's own scheduler's
                # among them. A port agentrl chose is given up for another (SGLang's default single HTTP process;
                # with --tokenizer-worker-num > 1 uvicorn's message names no port: that start fails as before).
                if not self._may_move_port or moves >= PORT_MOVES:
                    raise EngineError(
                        f"{self.name} could not listen on {self.config.host}:{self.port}: another process took the "
                        f"port while the server started ({self._port_hint(moves)}); see {self.log_path}:\n"
                        + self.log_tail()
                    )
                moves += 1
                moved = self._move_port(proc)
                if moved is None:
                    raise EngineError(f"{self.name} was stopped while starting")
                proc, foreign_logged = moved, False
                deadline = time.monotonic() + self.config.startup_timeout_s
                continue
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    ours = r.status == 200 and group_listens_on(proc.pid, self.port) is not False
                    if ours:
                        logger.info("%s ready at %s", self.name, self.url)
                        self._shm_files |= group_shm_files(proc.pid)
                        self._may_move_port = False  # served: its URL is known to clients from now on
                        self.gc_frozen = self._freeze_gc()
                        return
                    if r.status == 200 and not foreign_logged:
                        foreign_logged = True  # our process cannot bind it and will exit: then another port
                        logger.warning("%s: %s answers, but not from this server's processes", self.name, self.url)
            except (urllib.error.URLError, OSError, TimeoutError, http.client.HTTPException):
                pass  # not up yet, or what answers there is no HTTP server (a squatter: ours will exit, then move)
            time.sleep(0.5)
        raise EngineError(
            f"{self.name} did not become ready at {self.url} within {self.config.startup_timeout_s:.0f}s; "
            f"see {self.log_path}:\n" + self.log_tail()
        )

    def _freeze_gc(self) -> bool:
        """Ask the ready server to freeze its processes' garbage collectors (``POST /freeze_gc``: the objects of
        start-up, the model's among them, are left out of every later full collection), as SGLang does after its
        warm-up: with ``--skip-server-warmup`` its own request is sent before its HTTP server listens, and is
        refused (``post-warmup freeze_gc failed`` and a traceback in ``sglang.log``: harmless, this one follows).
        True if the server took it; a server that does not (an older SGLang, a stand-in) serves on."""
        import http.client
        import urllib.error
        import urllib.request

        try:
            with urllib.request.urlopen(urllib.request.Request(self.url + "/freeze_gc", method="POST"),
                                        timeout=FREEZE_GC_TIMEOUT_S) as r:
                return bool(r.status == 200)
        except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as exc:  # HTTPError: URLError
            logger.debug("%s: POST /freeze_gc failed (its collectors stay as they are): %r", self.name, exc)
            return False

    def _move_port(self, proc: subprocess.Popen[bytes]) -> subprocess.Popen[bytes] | None:
        """Launch again on a new free port after ``proc`` could not bind its own; None if the server was stopped
        meanwhile (by another thread: then nothing is launched)."""
        with self._lock:
            if self._proc is not proc:
                return None
            taken = self.port
            self.stop()
            self.port = free_port(self.config.host)
            logger.warning("%s: port %d was taken by another process while the server started; starting it again "
                           "on %d", self.name, taken, self.port)
            self.start_background()
            return self._proc

    def _port_hint(self, moves: int) -> str:
        if moves:
            return f"{moves} other ports tried"
        if self._port_configured:
            return "engine.port: choose a free one, or 0 to let agentrl choose"
        return "a restarted server keeps its port: its clients hold its URL"

    def _port_was_taken(self, returncode: int | None) -> bool:
        """Whether this launch's log says the HTTP server could not bind its port (uvicorn then exits with 3;
        without a log, that exit code is taken for it)."""
        if self.log_path is None:  # uvicorn's exit code, and someone holds the port now
            return returncode == UVICORN_STARTUP_FAILURE and not port_is_free(self.config.host, self.port)
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_start)
                text = f.read().decode(errors="replace")
        except OSError:
            return False
        # asyncio's message names the address: ('127.0.0.1', 46011) or ('::1', 46011, 0, 0)
        address = re.compile(rf", {self.port}[,)]")
        return any(address.search(line) for line in text.splitlines() if "address already in use" in line.lower())

    def log_tail(self, lines: int = 20) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def cpu_seconds(self) -> float | None:
        """CPU time (user + system) used so far by the server's processes (its process group: HTTP server,
        scheduler, detokenizer); None where /proc cannot tell. A server whose CPU time grows is working."""
        return None if self._proc is None else group_cpu_seconds(self._proc.pid)

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM the server's process group, then SIGKILL what is left after ``timeout_s``."""
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is not None:  # the leader may be gone while its scheduler still holds its file
            self._shm_files |= group_shm_files(proc.pid)
        if proc is not None and proc.poll() is None:
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("%s did not stop within %.0fs; killing it", self.name, timeout_s)
        if proc is not None:
            _signal_group(proc.pid, signal.SIGKILL)  # scheduler/detokenizer children too
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        # SGLang unlinks its load-report file only on a clean exit, which a killed process group never has: 16 KB
        # per server start left in /dev/shm (tmpfs, RAM) otherwise
        for path in self._shm_files:
            with contextlib.suppress(OSError):
                os.unlink(path)
        self._shm_files.clear()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def restart(self) -> SGLangServer:
        """Stop whatever is left of the process group, then start again on the same port (same URL)."""
        self.stop(timeout_s=5.0)
        return self.start()

    def kill(self) -> None:
        """SIGKILL the whole process group without cleanup, as a crash would (for fault-tolerance tests)."""
        if self._proc is not None:
            _signal_group(self._proc.pid, signal.SIGKILL)

    def __enter__(self) -> SGLangServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _group_stats(pgid: int) -> dict[int, list[bytes]] | None:
    """pid → the fields of ``/proc/<pid>/stat`` after the command name, for the live processes of process group
    ``pgid`` (fields: state ppid pgrp … utime(11) stime(12)); None where /proc cannot be listed."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    out = {}
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()  # after the command name, which may hold spaces
        except OSError:
            continue  # the process ended meanwhile
        if int(fields[2]) == pgid:
            out[int(entry)] = fields
    return out


def group_cpu_seconds(pgid: int) -> float | None:
    """Sum of utime + stime of the live processes in process group ``pgid`` (Linux /proc), or None."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    stats = _group_stats(pgid)
    if not stats:
        return None
    return sum(int(f[11]) + int(f[12]) for f in stats.values()) / tick


SHM_PREFIXES = ("/dev/shm/sglang_loads_",)  # SGLang's per-server load-report slots (managers/load_snapshot.py)


def _group_open_files(pids: Iterable[int]) -> Iterator[str]:
    """What the open file descriptors of ``pids`` name (``/proc/<pid>/fd`` links: paths, ``socket:[inode]``…)."""
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue  # the process ended meanwhile
        for fd in fds:
            with contextlib.suppress(OSError):
                yield os.readlink(f"/proc/{pid}/fd/{fd}")


def group_shm_files(pgid: int) -> set[str]:
    """SGLang's files in ``/dev/shm`` (:data:`SHM_PREFIXES`) that the processes of group ``pgid`` hold open."""
    return {t for t in _group_open_files(_group_stats(pgid) or ()) if t.startswith(SHM_PREFIXES)}


def group_listens_on(pgid: int, port: int) -> bool | None:
    """Whether a process of group ``pgid`` holds the socket listening on TCP ``port`` (Linux /proc: the listening
    sockets' inodes in ``/proc/net/tcp{,6}`` against the group's open files); None where /proc cannot tell."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()  # sl local_address(hex ip:hex port) rem_address st(0A: LISTEN) … inode(9)
            if len(fields) > 9 and fields[3] == "0A" and fields[1].rsplit(":", 1)[-1] == f"{port:04X}":
                inodes.add(f"socket:[{fields[9]}]")
    stats = _group_stats(pgid)
    if not inodes or not stats:
        return None
    return any(t in inodes for t in _group_open_files(stats))


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


async def wait_healthy(url: str, *, timeout_s: float = 10.0) -> bool:
    """True if ``GET {url}/health`` answers 200 within ``timeout_s``."""
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as s:
            async with s.get(url + "/health") as r:
                return r.status == 200
    except (aiohttp.ClientError, TimeoutError, OSError):
        return False
