"""Which precision is fast on this machine: ``dtype: auto`` is resolved here, per machine, at run time.

bf16 pays only where the device multiplies bf16 natively. On a CPU with AMX (Xeon Sapphire Rapids and newer) a
bf16 matmul ran ~6x faster than fp32; on an AVX2-only EPYC torch emulates it at ~1/55 of the fp32 rate (1.1 vs
60.9 GFLOP/s), which turned a 30 s SFT step into 532 s. So a recipe never names a dtype for one CPU; it says
``auto`` and this module decides:

- ``cuda``: bf16 where ``torch.cuda.is_bf16_supported()`` (Ampere and newer), else fp32.
- ``cpu``: fp32 unless ``/proc/cpuinfo`` lists ``amx_bf16`` or ``avx512_bf16``; with one of them the two dtypes are
  measured (a one-thread ``[128, 576] @ [576, 1536]`` matmul, the shape of a 135M model's MLP, in a child process)
  and bf16 is chosen only if it is at least :data:`MIN_SPEEDUP` times faster. The measurement catches what the
  flags do not show: ISA caps (``ONEDNN_MAX_CPU_ISA=AVX2`` on an AMX machine) and CPUs whose ``avx512_bf16`` is
  slower than their fp32 (a Xeon VM without AMX: bf16 74 vs fp32 140 GFLOP/s). It is cached per CPU model, flags,
  torch version and those variables in ``<agentrl cache>/precision.json``.

Trainer dtypes are ``fp32`` / ``bf16``; SGLang's ``--dtype`` names are ``float32`` / ``bfloat16``
(:func:`engine_dtype`).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

logger = logging.getLogger(__name__)

TrainDtype = Literal["fp32", "bf16"]
MIN_SPEEDUP = 1.5  # bf16 must beat fp32 by this factor to be chosen on a CPU
BF16_FLAGS = ("amx_bf16", "avx512_bf16")
ISA_ENV = ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "DNNL_MAX_CPU_ISA")
_ENGINE_NAMES = {"fp32": "float32", "bf16": "bfloat16"}


@dataclass(frozen=True, slots=True)
class Precision:
    """The dtype chosen for a device and why (printed at the start of a run)."""

    dtype: TrainDtype
    device: str
    reason: str


def cpu_info(path: Path = Path("/proc/cpuinfo")) -> tuple[str, frozenset[str]]:
    """(model name, flags) of the first CPU; ("unknown", {}) where /proc/cpuinfo cannot be read."""
    model, flags = "unknown", frozenset[str]()
    try:
        text = path.read_text()
    except OSError:
        return model, flags
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model == "unknown":
            model = value.strip()
        elif key == "flags" and not flags:
            flags = frozenset(value.split())
        if model != "unknown" and flags:
            break
    return model, flags


def matmul_gflops(dtype_name: TrainDtype, *, rows: int = 128, inner: int = 576, cols: int = 1536,
                  min_time_s: float = 0.05) -> float:
    """One-thread matmul rate in GFLOP/s for ``dtype_name`` (a warm-up call, then repeated until min_time_s)."""
    import torch

    dtype = torch.float32 if dtype_name == "fp32" else torch.bfloat16
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a = torch.randn(rows, inner).to(dtype)
        b = torch.randn(inner, cols).to(dtype)
        a @ b  # warm-up: kernel selection, caches
        n, t0 = 0, time.perf_counter()
        while True:
            a @ b
            n += 1
            elapsed = time.perf_counter() - t0
            if elapsed >= min_time_s and n >= 3:
                break
    finally:
        torch.set_num_threads(threads)
    return 2.0 * rows * inner * cols * n / elapsed / 1e9


CACHE_FILE = "precision.json"  # under agentrl.models.cache_dir()
MEASURE_TIMEOUT_S = 300.0  # the child that measures (imports torch, then ~0.2 s of matmuls)


def measure_rates(timeout_s: float = MEASURE_TIMEOUT_S) -> tuple[float, float]:
    """(fp32, bf16) one-thread GFLOP/s of :func:`matmul_gflops`, measured in a child Python with this process's
    environment (the ISA caps): the controller that resolves ``dtype: auto`` loads no torch for it (torch stayed in
    its memory for the whole run, ~0.5 GB). Measured here instead if the child fails (logged)."""
    code = ("import json; from agentrl.hardware import matmul_gflops; "
            "print(json.dumps([matmul_gflops('fp32'), matmul_gflops('bf16')]))")
    from agentrl.models import run_python

    try:
        done = run_python(code, timeout_s=timeout_s)
        if done.returncode != 0:
            raise RuntimeError(f"exit {done.returncode}: {done.stderr.strip()[-300:]}")
        fp32, bf16 = json.loads(done.stdout.strip().splitlines()[-1])
        return float(fp32), float(bf16)
    except (OSError, subprocess.SubprocessError, RuntimeError, ValueError, IndexError, TypeError) as exc:
        logger.warning("measuring the matmul rates in a child process failed (%s): measuring in this one", exc)
        return matmul_gflops("fp32"), matmul_gflops("bf16")


def torch_version() -> str:
    """``torch.__version__`` (with its local tag, e.g. ``+cu130``) read from torch's ``version.py`` without importing
    torch: the controller resolves ``dtype: auto`` from the cached measurement and needs no torch otherwise (~0.5 GB
    of RSS). Imports torch only if that file cannot be read."""
    spec = importlib.util.find_spec("torch")
    if spec is not None and spec.origin:
        try:
            text = (Path(spec.origin).parent / "version.py").read_text()
        except OSError:
            text = ""
        found = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", text, re.M)
        if found:
            return found.group(1)
    import torch

    return str(torch.__version__)


def _cpu_key(model: str, flags: frozenset[str]) -> str:
    env = ",".join(f"{k}={os.environ[k]}" for k in ISA_ENV if k in os.environ)
    return f"{model}|{' '.join(sorted(f for f in flags if f.startswith(('amx', 'avx'))))}|torch {torch_version()}|{env}"


def _measured_cpu_speedup(model: str, flags: frozenset[str]) -> tuple[float, float]:
    """(fp32, bf16) GFLOP/s on this CPU, measured once and cached."""
    from agentrl.models import read_json_cache, write_json_cache

    key = _cpu_key(model, flags)
    hit = read_json_cache(CACHE_FILE).get(key)
    if isinstance(hit, list) and len(hit) == 2:
        return float(hit[0]), float(hit[1])
    fp32, bf16 = measure_rates()
    write_json_cache(CACHE_FILE, key, [round(fp32, 2), round(bf16, 2)])  # a read-only home: measured again next time
    return fp32, bf16


def cpu_precision(cpuinfo: Path = Path("/proc/cpuinfo")) -> Precision:
    """The fast training dtype of this CPU (see the module docstring for the rule)."""
    model, flags = cpu_info(cpuinfo)
    have = [f for f in BF16_FLAGS if f in flags]
    if not have:
        return Precision("fp32", "cpu", f"{model}: no native bf16 (no {' or '.join(BF16_FLAGS)} flag)")
    fp32, bf16 = _measured_cpu_speedup(model, flags)
    ratio = bf16 / fp32 if fp32 > 0 else 0.0
    rates = f"bf16 {bf16:.1f} vs fp32 {fp32:.1f} GFLOP/s on one thread"
    if ratio >= MIN_SPEEDUP:
        return Precision("bf16", "cpu", f"{model} ({'+'.join(have)}): {rates}")
    return Precision("fp32", "cpu", f"{model} ({'+'.join(have)}) but bf16 is not faster here: {rates}")


def cuda_precision() -> Precision:
    import torch

    if torch.cuda.is_bf16_supported():
        return Precision("bf16", "cuda", f"{torch.cuda.get_device_name()}: bf16 supported")
    return Precision("fp32", "cuda", f"{torch.cuda.get_device_name()}: no bf16 support")


def resolve_dtype(requested: str, device: str) -> Precision:
    """``requested`` (``auto`` | ``fp32`` | ``bf16``) on ``device`` (``cpu`` | ``cuda`` | ``auto``) → a dtype.

    ``device="auto"`` means CUDA if torch sees a GPU here, else the CPU. An explicit dtype is kept as given.
    """
    if requested not in ("auto", "fp32", "bf16"):
        raise ValueError(f"dtype {requested!r}: expected auto, fp32 or bf16")
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if requested != "auto":
        return Precision(requested, device, "set in the config")  # type: ignore[arg-type]
    return cuda_precision() if device == "cuda" else cpu_precision()


def engine_dtype(requested: str, device: str) -> str:
    """SGLang's ``--dtype`` for ``requested``: ``auto`` on CPU resolves like the trainer (float32 or bfloat16);
    on CUDA it stays ``auto`` (SGLang then serves the model's own dtype); trainer names are translated; any other
    SGLang name (``float16``, ``half``…) passes through."""
    if requested == "auto":
        if device == "cpu":
            return _ENGINE_NAMES[cpu_precision().dtype]
        return "auto"
    return _ENGINE_NAMES.get(requested, requested)
