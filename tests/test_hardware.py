"""``dtype: auto``: bf16 only where the device multiplies it fast, decided per machine (agentrl.hardware)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agentrl import hardware
from agentrl.hardware import cpu_info, cpu_precision, engine_dtype, matmul_gflops, resolve_dtype
from agentrl.launcher.config import load_config
from agentrl.launcher.driver import resolve_precision

AVX2 = "fpu sse sse2 avx avx2 fma"
AMX = AVX2 + " avx512f avx512_bf16 amx_bf16 amx_tile"


def cpuinfo(tmp_path: Path, model: str, flags: str) -> Path:
    p = tmp_path / "cpuinfo"
    block = f"processor\t: {{n}}\nmodel name\t: {model}\nflags\t\t: {flags}\n\n"
    p.write_text(block.format(n=0) + block.format(n=1))
    return p


@pytest.fixture
def measured(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, object]:
    """Fake matmul rates (GFLOP/s per dtype) and a private cache; ``calls`` counts measurements."""
    state: dict[str, object] = {"rates": {"fp32": 60.0, "bf16": 360.0}, "calls": 0}

    def fake(**_: object) -> tuple[float, float]:
        state["calls"] = int(state["calls"]) + 1  # type: ignore[call-overload]
        rates: dict[str, float] = state["rates"]  # type: ignore[assignment]
        return rates["fp32"], rates["bf16"]

    monkeypatch.setattr(hardware, "measure_rates", fake)
    monkeypatch.setenv("AGENTRL_CACHE_DIR", str(tmp_path / "cache"))
    for var in hardware.ISA_ENV:
        monkeypatch.delenv(var, raising=False)
    return state


def test_cpuinfo_is_parsed(tmp_path: Path) -> None:
    model, flags = cpu_info(cpuinfo(tmp_path, "AMD EPYC 7B13", AVX2))
    assert model == "AMD EPYC 7B13" and "avx2" in flags and "amx_bf16" not in flags
    assert cpu_info(tmp_path / "missing") == ("unknown", frozenset())


def test_avx2_cpu_gets_fp32_without_measuring(tmp_path: Path, measured: dict[str, object]) -> None:
    p = cpu_precision(cpuinfo(tmp_path, "AMD EPYC", AVX2))
    assert p.dtype == "fp32" and "no native bf16" in p.reason and "AMD EPYC" in p.reason
    assert measured["calls"] == 0


def test_amx_cpu_gets_bf16_when_measured_fast_and_the_result_is_cached(tmp_path: Path,
                                                                       measured: dict[str, object]) -> None:
    info = cpuinfo(tmp_path, "Intel Xeon", AMX)
    p = cpu_precision(info)
    assert p.dtype == "bf16" and "360.0" in p.reason and "amx_bf16" in p.reason
    assert measured["calls"] == 1
    assert cpu_precision(info).dtype == "bf16" and measured["calls"] == 1  # from the cache
    assert (tmp_path / "cache" / "precision.json").exists()


def test_isa_cap_is_caught_by_measuring(tmp_path: Path, measured: dict[str, object],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """ONEDNN_MAX_CPU_ISA=AVX2 on an AMX machine: the flags still say amx, the measurement says slow."""
    info = cpuinfo(tmp_path, "Intel Xeon", AMX)
    assert cpu_precision(info).dtype == "bf16"
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    measured["rates"] = {"fp32": 60.0, "bf16": 1.1}
    p = cpu_precision(info)  # another cache key: measured again
    assert p.dtype == "fp32" and "not faster" in p.reason and measured["calls"] == 2


def test_explicit_dtypes_are_kept_and_bad_ones_refused() -> None:
    assert resolve_dtype("bf16", "cpu").dtype == "bf16"
    assert resolve_dtype("fp32", "cuda").reason == "set in the config"
    with pytest.raises(ValueError, match="expected auto, fp32 or bf16"):
        resolve_dtype("fp16", "cpu")


def test_engine_names(tmp_path: Path, measured: dict[str, object], monkeypatch: pytest.MonkeyPatch) -> None:
    assert engine_dtype("bf16", "cpu") == "bfloat16" and engine_dtype("fp32", "cuda") == "float32"
    assert engine_dtype("float16", "cuda") == "float16"
    assert engine_dtype("auto", "cuda") == "auto"  # SGLang serves the model's own dtype on a GPU
    monkeypatch.setattr(hardware, "cpu_info", lambda *_: ("AMD EPYC", frozenset(AVX2.split())))
    assert engine_dtype("auto", "cpu") == "float32"
    monkeypatch.setattr(hardware, "cpu_info", lambda *_: ("Xeon", frozenset(AMX.split())))
    assert engine_dtype("auto", "cpu") == "bfloat16"


@pytest.mark.parametrize(("flags", "trainer", "engine"), [(AVX2, "fp32", "float32"), (AMX, "bf16", "bfloat16")])
def test_run_config_records_the_resolved_choice(flags: str, trainer: str, engine: str, measured: dict[str, object],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hardware, "cpu_info", lambda *_: ("cpu", frozenset(flags.split())))
    cfg = resolve_precision(load_config(None, ["model=tiny"]))
    assert cfg.trainer.dtype == trainer and cfg.engine.server.dtype == engine
    kept = resolve_precision(load_config(None, ["trainer.dtype=fp32", "engine.dtype=bfloat16"]))
    assert kept.trainer.dtype == "fp32" and kept.engine.server.dtype == "bfloat16"
    external = resolve_precision(load_config(None, ["engine.url=http://127.0.0.1:1"]))
    assert external.engine.server.dtype == "auto"  # a running server: its dtype is not ours to choose


def test_the_real_measurement_runs_here() -> None:
    assert matmul_gflops("fp32", rows=16, inner=64, cols=64, min_time_s=0.01) > 0
    fp32, bf16 = hardware.measure_rates()  # in a child process
    assert fp32 > 0 and bf16 > 0
    p = cpu_precision()  # this machine, whatever it is
    assert p.dtype in ("fp32", "bf16") and p.reason


def test_torch_version_is_read_without_importing_torch(tmp_path: Path) -> None:
    """The controller resolves ``dtype: auto`` with no torch in its process: the cache key holds the version, read
    from torch's version.py, and a miss measures in a child process."""
    import torch

    child = """
import json, sys
from agentrl.hardware import torch_version, cpu_precision
v = torch_version(); p = cpu_precision()
print(json.dumps({"version": v, "dtype": p.dtype, "torch": "torch" in sys.modules}))
"""
    env = {**os.environ, "AGENTRL_CACHE_DIR": str(tmp_path)}
    runs = [json.loads(subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300,
                                      check=True, env=env).stdout.strip().splitlines()[-1]) for _ in range(2)]
    assert runs[0]["version"] == runs[1]["version"] == torch.__version__
    assert runs[0]["dtype"] == runs[1]["dtype"]
    assert runs[0]["torch"] is False and runs[1]["torch"] is False  # measured in a child, then from the cache
    if any(f in cpu_info()[1] for f in hardware.BF16_FLAGS):  # a CPU with bf16 flags measured once: cached
        assert json.loads((tmp_path / hardware.CACHE_FILE).read_text())


def test_a_failing_child_measures_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "executable", "/nonexistent/python")
    monkeypatch.setattr(hardware, "matmul_gflops", lambda dtype, **_: {"fp32": 2.0, "bf16": 3.0}[dtype])
    assert hardware.measure_rates() == (2.0, 3.0)
