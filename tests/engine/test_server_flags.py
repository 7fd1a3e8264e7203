"""How SGLang servers are launched: CPU flags here, GPU flags passed through (GPU paths are not runnable on our
CPU-only machines; the command lines are what we can check), one port and GPU slice per server of a pool."""

from __future__ import annotations

import os

import pytest
from pydantic import ValidationError

from agentrl.engine import SGLangServer, SGLangServerConfig, pool_configs
from agentrl.engine.server import CPU_CRASH_DIAGNOSTICS, ONEDNN_CACHE_CAPACITY, SGL_KERNEL_CPU_DIR, SGLANG_PLUGIN_DIR
from agentrl.errors import EngineError


def flag(cmd: list[str], name: str) -> str | None:
    return cmd[cmd.index(name) + 1] if name in cmd else None


def test_cpu_server_gets_the_flags_that_work_here():
    server = SGLangServer(SGLangServerConfig(model_path="/m"))
    cmd, env = server.command(), server.environment()
    assert flag(cmd, "--device") == "cpu" and flag(cmd, "--attention-backend") == "torch_native"
    assert "--sleep-on-idle" in cmd and flag(cmd, "--port") == str(server.port) != "0"
    assert env["SGLANG_USE_CPU_ENGINE"] == "1" and "sgl_kernel_cpu" in env["PYTHONPATH"]


def test_gpu_flags_pass_through_and_cpu_ones_stay_out():
    config = SGLangServerConfig(model_path="/m", device="cuda", dtype="bfloat16", tp_size=2, base_gpu_id=4,
                                mem_fraction_static=0.8, max_total_tokens=None,
                                extra_args=["--enable-torch-compile", "--chunked-prefill-size", "4096"],
                                env={"NCCL_DEBUG": "WARN"})
    server = SGLangServer(config)
    cmd, env = server.command(), server.environment()
    assert "--device" not in cmd and "--sleep-on-idle" not in cmd and "--max-total-tokens" not in cmd
    assert flag(cmd, "--tp-size") == "2" and flag(cmd, "--base-gpu-id") == "4"
    assert flag(cmd, "--mem-fraction-static") == "0.8" and flag(cmd, "--dtype") == "bfloat16"
    assert cmd[-3:] == ["--enable-torch-compile", "--chunked-prefill-size", "4096"]
    assert "sgl_kernel_cpu" not in env.get("PYTHONPATH", "")
    assert env["NCCL_DEBUG"] == "WARN"


def test_pool_configs_give_each_server_its_own_port_and_gpus():
    gpu = pool_configs(SGLangServerConfig(model_path="/m", device="cuda", tp_size=2), 3)
    assert [c.base_gpu_id for c in gpu] == [0, 2, 4]
    for _ in range(50):  # chosen together, so never the same port twice (one at a time, CI once drew a repeat)
        servers = [SGLangServer(c) for c in pool_configs(SGLangServerConfig(model_path="/m"), 3)]
        assert len({s.port for s in servers}) == 3 and all(s.config.port == s.port != 0 for s in servers)
    assert [c.port for c in pool_configs(SGLangServerConfig(model_path="/m", port=30000), 1)] == [30000]
    assert all(c.base_gpu_id is None for c in pool_configs(SGLangServerConfig(model_path="/m"), 2))
    with pytest.raises(EngineError, match="at least one server"):
        pool_configs(SGLangServerConfig(model_path="/m"), 0)


def test_cpu_server_dtype_auto_follows_the_cpu(monkeypatch: pytest.MonkeyPatch):
    from agentrl import hardware

    monkeypatch.setattr(hardware, "cpu_info", lambda *_: ("AMD EPYC", frozenset({"avx2", "fma"})))
    assert flag(SGLangServer(SGLangServerConfig(model_path="/m")).command(), "--dtype") == "float32"
    monkeypatch.setattr(hardware, "cpu_precision", lambda *_: hardware.Precision("bf16", "cpu", "fake AMX"))
    assert flag(SGLangServer(SGLangServerConfig(model_path="/m")).command(), "--dtype") == "bfloat16"
    gpu = SGLangServer(SGLangServerConfig(model_path="/m", device="cuda")).command()
    assert flag(gpu, "--dtype") == "auto"


def test_the_detokenizer_runs_in_the_launcher_on_cpu_and_in_its_own_process_on_gpu():
    cpu = SGLangServer(SGLangServerConfig(model_path="/m")).environment()
    assert cpu["AGENTRL_SGLANG_DETOKENIZER"] == "thread"
    assert cpu["PYTHONPATH"].split(os.pathsep)[:2] == [str(SGL_KERNEL_CPU_DIR), str(SGLANG_PLUGIN_DIR)]
    kept = SGLangServer(SGLangServerConfig(model_path="/m", detokenizer="process")).environment()
    assert "AGENTRL_SGLANG_DETOKENIZER" not in kept and str(SGLANG_PLUGIN_DIR) not in kept["PYTHONPATH"]
    gpu = SGLangServer(SGLangServerConfig(model_path="/m", device="cuda")).environment()
    assert "AGENTRL_SGLANG_DETOKENIZER" not in gpu and str(SGLANG_PLUGIN_DIR) not in gpu.get("PYTHONPATH", "")
    # on GPU by choice: the plugin's directory alone, never the CPU stand-in for sgl_kernel
    gpu_thread = SGLangServer(SGLangServerConfig(model_path="/m", device="cuda", detokenizer="thread")).environment()
    assert gpu_thread["PYTHONPATH"].split(os.pathsep)[0] == str(SGLANG_PLUGIN_DIR)
    assert str(SGL_KERNEL_CPU_DIR) not in gpu_thread["PYTHONPATH"]
    # the variable set in engine.env (which the plugin reads) is what the server reports and gets its paths for
    by_env = SGLangServer(SGLangServerConfig(model_path="/m", env={"AGENTRL_SGLANG_DETOKENIZER": "process"}))
    assert by_env.detokenizer == "process" and str(SGLANG_PLUGIN_DIR) not in by_env.environment()["PYTHONPATH"]
    with pytest.raises(ValueError, match="detokenizer"):
        SGLangServerConfig(model_path="/m", detokenizer="inline")


def test_a_plugin_allow_list_gets_agentrls_plugin_added():
    """SGLang loads only the plugins ``SGLANG_PLUGINS`` names when it is set: agentrl's is added, never twice."""
    env = SGLangServer(SGLangServerConfig(model_path="/m", env={"SGLANG_PLUGINS": "theirs"})).environment()
    assert env["SGLANG_PLUGINS"] == "theirs,agentrl"
    env = SGLangServer(SGLangServerConfig(model_path="/m", env={"SGLANG_PLUGINS": "agentrl, theirs"})).environment()
    assert env["SGLANG_PLUGINS"] == "agentrl, theirs"


def test_a_cpu_server_stops_without_sglangs_crash_diagnostics_unless_asked(monkeypatch: pytest.MonkeyPatch):
    """SGLang sleeps 5 s before its py-spy/CUDA dump on every SIGTERM; off on CPU, SGLang's default on GPU, and
    what the user sets (their environment, ``engine.env``) wins."""
    for name in CPU_CRASH_DIAGNOSTICS:
        monkeypatch.delenv(name, raising=False)
    cpu = SGLangServer(SGLangServerConfig(model_path="/m")).environment()
    assert all(cpu[name] == "0" for name in CPU_CRASH_DIAGNOSTICS)
    gpu = SGLangServer(SGLangServerConfig(model_path="/m", device="cuda")).environment()
    assert not any(name in gpu for name in CPU_CRASH_DIAGNOSTICS)
    asked = SGLangServerConfig(model_path="/m", env={"SGLANG_PYSPY_DUMP_BEFORE_CRASH": "1"})
    assert SGLangServer(asked).environment()["SGLANG_PYSPY_DUMP_BEFORE_CRASH"] == "1"
    monkeypatch.setenv("SGLANG_CUDA_COREDUMP_BEFORE_CRASH", "1")
    assert SGLangServer(SGLangServerConfig(model_path="/m")).environment()["SGLANG_CUDA_COREDUMP_BEFORE_CRASH"] == "1"


def test_a_cpu_server_keeps_few_onednn_kernels_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """oneDNN's kernel cache is capped on CPU (each decode batch size compiles its own kernel); the user's
    environment or ``engine.env`` wins, a number given there (as a command-line override makes it) is text."""
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    cpu = SGLangServer(SGLangServerConfig(model_path="/m")).environment()
    assert cpu["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(ONEDNN_CACHE_CAPACITY)
    gpu = SGLangServer(SGLangServerConfig(model_path="/m", device="cuda")).environment()
    assert "ONEDNN_PRIMITIVE_CACHE_CAPACITY" not in gpu
    asked = SGLangServerConfig(model_path="/m", env={"ONEDNN_PRIMITIVE_CACHE_CAPACITY": 1024})
    assert SGLangServer(asked).environment()["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "1024"
    legacy = SGLangServer(SGLangServerConfig(model_path="/m", env={"DNNL_PRIMITIVE_CACHE_CAPACITY": "16"}))
    assert "ONEDNN_PRIMITIVE_CACHE_CAPACITY" not in legacy.environment()  # oneDNN's new name would beat the old
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "8")
    assert SGLangServer(SGLangServerConfig(model_path="/m")).environment()["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "8"
    with pytest.raises(ValidationError, match="valid string"):
        SGLangServerConfig(model_path="/m", env={"X": True})  # a flag's text is the user's to spell


def test_a_cpu_server_imports_only_its_models_sglang_module(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """SGLang imports every model module at each start unless an external model package is named: agentrl's names
    the module that defines the model's architecture (found by reading, not importing); a user's package wins; an
    architecture SGLang has no module for, or no config, leaves SGLang's own behaviour."""
    import json

    from agentrl.engine.server import sglang_model_module

    def model(archs: object) -> str:
        d = tmp_path / str(len(list(tmp_path.iterdir())))
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"architectures": archs}))
        return str(d)

    assert sglang_model_module(model(["LlamaForCausalLM"])) == "sglang.srt.models.llama"
    assert sglang_model_module(model(["Qwen2ForCausalLM"])) == "sglang.srt.models.qwen2"
    assert sglang_model_module(model(["NoSuchForCausalLM"])) is None
    assert sglang_model_module(model([])) is None and sglang_model_module(tmp_path / "absent") is None
    monkeypatch.delenv("SGLANG_EXTERNAL_MODEL_PACKAGE", raising=False)
    env = SGLangServer(SGLangServerConfig(model_path=model(["LlamaForCausalLM"]))).environment()
    assert env["SGLANG_EXTERNAL_MODEL_PACKAGE"] == "agentrl_sglang_models"
    assert env["AGENTRL_SGLANG_MODEL_MODULE"] == "sglang.srt.models.llama"
    assert (SGL_KERNEL_CPU_DIR / "agentrl_sglang_models" / "served.py").is_file()  # on the servers' PYTHONPATH
    unknown = SGLangServer(SGLangServerConfig(model_path=model(["NoSuchForCausalLM"]))).environment()
    assert "SGLANG_EXTERNAL_MODEL_PACKAGE" not in unknown
    (tmp_path / "list").mkdir()
    (tmp_path / "list" / "config.json").write_text("[1, 2]")  # JSON, but not an object
    assert sglang_model_module(tmp_path / "list") is None
    llama = model(["LlamaForCausalLM"])
    # a module the user disables (SGLang skips the module names listed), another SGLang (engine.python: its
    # modules may not be the ones read here): SGLang's own way
    for config in (SGLangServerConfig(model_path=llama, env={"SGLANG_DISABLED_MODEL_ARCHS": "qwen2, llama"}),
                   SGLangServerConfig(model_path=llama, python="/opt/sglang/bin/python")):
        assert "SGLANG_EXTERNAL_MODEL_PACKAGE" not in SGLangServer(config).environment()
    monkeypatch.setenv("SGLANG_EXTERNAL_MODEL_PACKAGE", "users_models")
    assert SGLangServer(SGLangServerConfig(model_path=llama)).environment()[
        "SGLANG_EXTERNAL_MODEL_PACKAGE"] == "users_models"
    monkeypatch.delenv("SGLANG_EXTERNAL_MODEL_PACKAGE")
    env = SGLangServer(SGLangServerConfig(model_path=llama, env={"SGLANG_EXTERNAL_MODEL_PACKAGE": "theirs"}))
    assert env.environment()["SGLANG_EXTERNAL_MODEL_PACKAGE"] == "theirs"
    assert "AGENTRL_SGLANG_MODEL_MODULE" not in env.environment()
