"""agentrl's SGLang plugin (``agentrl/engine/sglang_plugin``): the detokenizer as a thread of the server's launcher.

The real path: the session's CPU server (``detokenizer`` auto -> thread) has no detokenizer process, and its texts
are the detokenizations of its tokens. SGLang's own layout (a process) is what the pool's restart test starts
(``tests/engine/test_pool_sglang.py``). The rest checks the plugin's choices with stand-ins for SGLang's modules."""

from __future__ import annotations

import asyncio
import importlib.util
import signal
import sys
import threading
import types
from pathlib import Path
from typing import Any

import psutil
import pytest

from agentrl.engine import SamplingParams
from agentrl.engine.client import SGLangClient
from agentrl.engine.server import SGLANG_PLUGIN_DIR


def _plugin() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("agentrl_sglang_plugin_under_test",
                                                  SGLANG_PLUGIN_DIR / "agentrl_sglang_plugin.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sglang_finds_the_plugin_on_the_servers_path_only(tmp_path):
    from importlib.metadata import distributions

    found = [ep for d in distributions(path=[str(SGLANG_PLUGIN_DIR)]) for ep in d.entry_points
             if ep.group == "sglang.srt.plugins"]
    assert [(ep.name, ep.value) for ep in found] == [("agentrl", "agentrl_sglang_plugin:register")]
    assert not [d for d in distributions() if d.metadata["Name"] == "agentrl-sglang-plugin"]  # not on ours


def test_the_cpu_server_has_no_detokenizer_process_and_its_texts_are_its_tokens_decoded(sglang_server,
                                                                                       chat_tokenizer):
    root = psutil.Process(sglang_server.pid)
    titles = [" ".join(p.cmdline()) for p in root.children(recursive=True)]
    assert any("sglang::scheduler" in t for t in titles), titles
    assert not any("detokenizer" in t for t in titles), titles

    async def generate() -> list[Any]:
        async with SGLangClient(sglang_server.url) as client:
            prompts = [chat_tokenizer.encode_text(f"Count to {n}: 1, 2,") for n in (5, 9, 12)]
            return list(await asyncio.gather(*(client.generate(p, SamplingParams(max_new_tokens=24, temperature=1.0))
                                               for p in prompts)))

    results = asyncio.run(generate())
    for r in results:
        # SamplingParams.to_sglang asks for skip_special_tokens=False (token-in/token-out): a sampled special token
        # such as <jupyter_code> stays in the text (a CI run drew one)
        assert r.output_ids and r.text == chat_tokenizer.hf.decode(r.output_ids, skip_special_tokens=False)
    # it took POST /freeze_gc once ready (SGLangServer._freeze_gc): the thread detokenizer handled that request
    # too (SGLang's tokenizer manager sends it to the scheduler and the detokenizer) and decodes on
    assert sglang_server.gc_frozen


class _Serving:
    detokenizer_worker_num = 1
    tokenizer_worker_num = 1


def _stand_ins(monkeypatch, loop: Any, serving: Any = None, metrics: bool | None = False) -> types.SimpleNamespace:
    """SGLang's detokenizer module and runtime context, replaced in sys.modules for the plugin's imports."""
    made: list[Any] = []

    class Manager:
        def __init__(self, server_args: Any, port_args: Any) -> None:
            made.append((server_args, port_args))

        def event_loop(self) -> None:
            loop()

    def run_detokenizer_process(*_: Any) -> None:  # SGLang's process entry point (identity is what counts)
        raise AssertionError("not to be run in this process")

    detok = types.ModuleType("sglang.srt.managers.detokenizer_manager")
    detok.DetokenizerManager = Manager  # type: ignore[attr-defined]
    detok.run_detokenizer_process = run_detokenizer_process  # type: ignore[attr-defined]
    ctx = types.ModuleType("sglang.srt.runtime_context")
    ctx.get_serving = lambda: serving or _Serving()  # type: ignore[attr-defined]
    if metrics is not None:  # None: an SGLang without this name
        ctx.get_observability = lambda: types.SimpleNamespace(enable_metrics=metrics)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "sglang.srt.managers.detokenizer_manager", detok)
    monkeypatch.setitem(sys.modules, "sglang.srt.runtime_context", ctx)
    return types.SimpleNamespace(made=made, run=run_detokenizer_process)


def test_a_crash_in_the_detokenizer_thread_stops_the_server_as_a_crashed_process_does(monkeypatch):
    plugin = _plugin()
    crashed = threading.Event()
    monkeypatch.setattr(plugin, "stop_server", crashed.set)

    def loop() -> None:
        raise RuntimeError("a malformed batch")

    sglang = _stand_ins(monkeypatch, loop)

    def original(*_: Any, **__: Any) -> Any:
        raise AssertionError("the default layout must not start a process")

    assert plugin.detokenizer_in_thread(original, object, server_args="server", port_args="ports",  # as SGLang calls
                                        run_detokenizer_process_func=sglang.run) == ([], [])
    assert sglang.made == [("server", "ports")]
    assert crashed.wait(10)


def test_stopping_the_server_is_sigquit_to_the_launcher(monkeypatch):
    plugin = _plugin()
    signals: list[tuple[int, int]] = []
    monkeypatch.setattr(plugin.os, "kill", lambda pid, sig: signals.append((pid, sig)))
    plugin.stop_server()
    assert signals == [(plugin.os.getpid(), signal.SIGQUIT)]


@pytest.mark.parametrize("layout", ["detokenizers", "tokenizers", "custom", "metrics", "another sglang"])
def test_layouts_other_than_sglangs_default_keep_sglangs_own_launch(monkeypatch, layout):
    plugin = _plugin()
    serving = types.SimpleNamespace(detokenizer_worker_num=2 if layout == "detokenizers" else 1,
                                    tokenizer_worker_num=4 if layout == "tokenizers" else 1)
    metrics = {"metrics": True, "another sglang": None}.get(layout, False)
    sglang = _stand_ins(monkeypatch, lambda: None, serving, metrics)
    calls: list[Any] = []

    def original(cls: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append((cls, args, kwargs))
        return ["a process"], ["detokenizer"]

    func = (lambda *_: None) if layout == "custom" else sglang.run
    got = plugin.detokenizer_in_thread(original, object, "server", port_args="ports", run_detokenizer_process_func=func)
    assert got == (["a process"], ["detokenizer"])
    assert calls == [(object, ("server",), {"port_args": "ports", "run_detokenizer_process_func": func})]
    assert sglang.made == []


def test_the_plugin_registers_only_in_the_launcher_and_only_when_asked(monkeypatch):
    plugin = _plugin()
    registered: list[tuple[str, Any, Any]] = []
    hooks = types.ModuleType("sglang.srt.plugins.hook_registry")
    hooks.HookType = types.SimpleNamespace(AROUND="around")  # type: ignore[attr-defined]
    hooks.HookRegistry = types.SimpleNamespace(  # type: ignore[attr-defined]
        register=lambda target, hook, kind: registered.append((target, hook, kind)))
    monkeypatch.setitem(sys.modules, "sglang.srt.plugins.hook_registry", hooks)
    monkeypatch.delenv(plugin.DETOKENIZER_ENV, raising=False)
    plugin.register()
    assert registered == []
    monkeypatch.setenv(plugin.DETOKENIZER_ENV, "thread")
    monkeypatch.setattr(plugin.multiprocessing, "parent_process", lambda: object())  # a spawned child
    plugin.register()
    assert registered == []
    monkeypatch.setattr(plugin.multiprocessing, "parent_process", lambda: None)
    plugin.register()
    assert registered == [(plugin.TARGET, plugin.detokenizer_in_thread, "around")]


def test_the_session_server_imported_only_its_models_module(sglang_server) -> None:
    """The server resolved its architecture from agentrl's external model package: SGLang warns of every model
    module it fails to import when it imports them all (15 here), and of none now."""
    assert "Ignore import error when loading sglang.srt.models" not in Path(sglang_server.log_path).read_text()
