"""Compiled CPU kernels for the SGLang server processes (``_attention.cpp``), built on the machine that runs them.

Why compiled: SGLang's decode attention on CPU (its per-request loop, and our batched PyTorch path) copies each
request's cached keys and values out of the paged KV cache before attending. On an AVX-512 EPYC in bf16 that copy and
the masked SDPA call cost 13-24 ms a layer for 32 requests (~35 MFLOP): more than the rest of the layer. No PyTorch op
attends through ``req_to_token`` in place, and PyPI has no CPU build of ``sgl_kernel``; the kernel does it in ~2 ms.

The library is compiled once with the machine's C++ compiler (``$CXX``, else ``g++``) for the machine's own
instruction set (``-march=native``) against the installed torch, into ``$AGENTRL_CACHE_DIR/kernels`` (default
``~/.cache/agentrl/kernels``) under a name keyed by the source, torch's version, the compiler and the CPU's flags
(a cache shared by different CPUs never loads code built for another); a file lock keeps concurrent server starts to
one build, written to a temporary file and renamed (atomic). Without a compiler, or when the build fails, the
servers keep the PyTorch paths and say why (``AGENTRL_CPU_KERNELS=0`` turns the compiled kernels off).

Standalone (torch and the standard library only): the SGLang processes import it as part of this stand-in, and
agentrl builds it ahead of a server start by loading this file by path (``agentrl.engine.server``).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import platform
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("_attention.cpp")
# a cold build takes ~10 s on one of our cores; bounded well under a server's start-up timeout (300 s by default)
BUILD_TIMEOUT_S = 180.0
# set by the launcher that built the library for this server (agentrl.engine.server): its processes load that file
# instead of asking the compiler for the cache key again (two compiler calls, ~0.1 s, in each process)
LIBRARY_ENV = "AGENTRL_CPU_KERNEL_LIB"
_loaded: dict[str, str | None] = {}  # library path → None (loaded) or why not


def cache_dir(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    return Path(env.get("AGENTRL_CACHE_DIR") or Path.home() / ".cache" / "agentrl") / "kernels"


def compiler(env: Mapping[str, str] | None = None) -> str | None:
    env = os.environ if env is None else env
    return shutil.which(env.get("CXX") or "g++", path=env.get("PATH"))


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """``cmd`` in its own process group, all of it killed on timeout (the compiler driver's cc1plus and ld too)."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace",
                          start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _cpu_flags() -> str:
    """The CPU's model and instruction-set flags (x86 ``flags``, Arm ``Features`` and part numbers)."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return platform.processor()
    keys = ("flags", "model name", "Features", "CPU implementer", "CPU part", "CPU variant")
    return "\n".join(sorted({ln for ln in text.splitlines() if ln.startswith(keys)}))


def library_path(cxx: str, env: Mapping[str, str] | None = None) -> Path:
    """Where the library for this source, torch, compiler, command line and CPU lives. The key holds what
    ``-march=native`` resolves to on this machine (``-Q --help=target``) as well as the CPU's flags: a cache shared
    by different CPUs never hands one the other's instructions."""
    version = _run([cxx, "--version"], 30).stdout.splitlines()[:1]
    target = _run([cxx, "-march=native", "-Q", "--help=target"], 30).stdout
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), torch.__version__, getattr(torch.version, "git_version", ""), str(version),
                 target, " ".join(_command(cxx, Path("lib.so"))), _cpu_flags(), platform.machine()):
        key.update(part if isinstance(part, bytes) else str(part).encode())
        key.update(b"\0")
    return cache_dir(env) / f"attention-{key.hexdigest()[:16]}.so"


def _command(cxx: str, out: Path) -> list[str]:
    root = Path(torch.__file__).resolve().parent
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))
    return [cxx, "-O3", "-march=native", "-std=c++20", "-shared", "-fPIC", "-fopenmp",
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-I", str(root / "include"),
            "-I", str(root / "include" / "torch" / "csrc" / "api" / "include"),
            str(SOURCE), "-o", str(out), "-L", str(root / "lib"), "-lc10", "-ltorch_cpu", "-ltorch",
            f"-Wl,-rpath,{root / 'lib'}"]


def build(env: Mapping[str, str] | None = None) -> Path:
    """The compiled library's path, building it first if it is not in the cache. ``env``: the environment whose
    ``CXX``, ``PATH`` and ``AGENTRL_CACHE_DIR`` count (default this process's: a launcher passes its server's).
    Raises ``RuntimeError`` saying why it could not (no compiler, a failed build: the compiler's last lines)."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64", "aarch64"):
        raise RuntimeError(f"compiled CPU kernels are built on Linux x86-64/aarch64 only, not {platform.platform()}")
    env = os.environ if env is None else env
    cxx = compiler(env)
    if cxx is None:
        raise RuntimeError(f"no C++ compiler ({env.get('CXX') or 'g++'} not on PATH; "
                           "apt-get install g++, or set CXX)")
    path = library_path(cxx, env)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building it: wait, then find it built
        if path.exists():
            return path
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.stem, suffix=".tmp.so")
        os.close(fd)
        try:
            done = _run(_command(cxx, Path(tmp)), BUILD_TIMEOUT_S)
            if done.returncode != 0:
                tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-8:])
                raise RuntimeError(f"building {SOURCE.name} with {cxx} failed (exit {done.returncode}):\n{tail}")
            os.chmod(tmp, 0o755)  # mkstemp's 0600 would hide it from the other users of a shared cache
            os.replace(tmp, path)
        except subprocess.TimeoutExpired as e:
            raise RuntimeError(f"building {SOURCE.name} with {cxx} took over {BUILD_TIMEOUT_S:.0f} s") from e
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return path


def try_build(env: Mapping[str, str] | None = None) -> tuple[Path | None, str | None]:
    """:func:`build` that never raises: ``(path, None)``, or ``(None, why not)``."""
    try:
        return build(env), None
    except Exception as e:  # noqa: BLE001  # a build that fails in any way leaves the server on the PyTorch path
        return None, str(e) if isinstance(e, RuntimeError) else f"{type(e).__name__}: {e}"


def load() -> str | None:
    """Build if needed and load the library into this process: None when ``torch.ops.agentrl_cpu`` is ready, else
    why not (the caller keeps its PyTorch path). Never raises: a server must start without the kernel. The file
    ``$AGENTRL_CPU_KERNEL_LIB`` names is loaded as it is, when it exists (the launcher built it on this host)."""
    if os.environ.get("AGENTRL_CPU_KERNELS", "1") == "0":
        return "AGENTRL_CPU_KERNELS=0"
    given = os.environ.get(LIBRARY_ENV)
    path, why_not = (Path(given), None) if given and os.path.isfile(given) else try_build()
    if path is None:
        return why_not
    key = str(path)
    if key not in _loaded:
        try:
            torch.ops.load_library(key)
            torch.ops.agentrl_cpu.decode_attention  # noqa: B018  # registered, or AttributeError
            _loaded[key] = None
        except Exception as e:  # noqa: BLE001  # any failure to load means: the PyTorch path
            _loaded[key] = f"loading {key} failed: {type(e).__name__}: {e}"
    return _loaded[key]
