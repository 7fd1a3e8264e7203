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
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("_attention.cpp")
BUILD_TIMEOUT_S = 600.0  # a cold build takes ~10 s on one of our cores; a loaded machine, far longer
_loaded: dict[str, str | None] = {}  # library path → None (loaded) or why not


def cache_dir() -> Path:
    return Path(os.environ.get("AGENTRL_CACHE_DIR") or Path.home() / ".cache" / "agentrl") / "kernels"


def compiler() -> str | None:
    return shutil.which(os.environ.get("CXX") or "g++")


def _cpu_flags() -> str:
    """The CPU's model and instruction-set flags: ``-march=native`` compiles for exactly these."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    lines = [ln for ln in text.splitlines() if ln.startswith(("flags", "model name"))]
    return "\n".join(sorted(set(lines)))


def library_path(cxx: str) -> Path:
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout.splitlines()[:1]
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), torch.__version__.encode(), str(version).encode(), _cpu_flags().encode(),
                 platform.machine().encode()):
        key.update(part)
        key.update(b"\0")
    return cache_dir() / f"attention-{key.hexdigest()[:16]}.so"


def _command(cxx: str, out: Path) -> list[str]:
    root = Path(torch.__file__).resolve().parent
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))
    return [cxx, "-O3", "-march=native", "-std=c++20", "-shared", "-fPIC", "-fopenmp",
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-I", str(root / "include"),
            "-I", str(root / "include" / "torch" / "csrc" / "api" / "include"),
            str(SOURCE), "-o", str(out), "-L", str(root / "lib"), "-lc10", "-ltorch_cpu", "-ltorch",
            f"-Wl,-rpath,{root / 'lib'}"]


def build() -> Path:
    """The compiled library's path, building it first if it is not in the cache. Raises ``RuntimeError`` saying why
    it could not (no compiler, a failed build: the compiler's last lines)."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64", "aarch64"):
        raise RuntimeError(f"compiled CPU kernels are built on Linux x86-64/aarch64 only, not {platform.platform()}")
    cxx = compiler()
    if cxx is None:
        raise RuntimeError(f"no C++ compiler ({os.environ.get('CXX') or 'g++'} not on PATH; "
                           "apt-get install g++, or set CXX)")
    path = library_path(cxx)
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
            done = subprocess.run(_command(cxx, Path(tmp)), capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
            if done.returncode != 0:
                tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-8:])
                raise RuntimeError(f"building {SOURCE.name} with {cxx} failed (exit {done.returncode}):\n{tail}")
            os.replace(tmp, path)
        except subprocess.TimeoutExpired as e:
            raise RuntimeError(f"building {SOURCE.name} with {cxx} took over {BUILD_TIMEOUT_S:.0f} s") from e
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return path


def load() -> str | None:
    """Build if needed and load the library into this process: None when ``torch.ops.agentrl_cpu`` is ready, else
    why not (the caller keeps its PyTorch path)."""
    if os.environ.get("AGENTRL_CPU_KERNELS", "1") == "0":
        return "AGENTRL_CPU_KERNELS=0"
    try:
        path = build()
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        return str(e)
    key = str(path)
    if key not in _loaded:
        try:
            torch.ops.load_library(key)
            _loaded[key] = None
        except (OSError, RuntimeError) as e:
            _loaded[key] = f"loading {path} failed: {e}"
    return _loaded[key]
