"""agentrl's SGLang plugin, for the servers agentrl starts: its directory goes on their ``PYTHONPATH`` only, where
SGLang's plugin loader (``sglang.srt.plugins.load_plugins``, entry point group ``sglang.srt.plugins``) finds it by the
``agentrl_sglang_plugin-0.dist-info`` beside this file. It does nothing unless the environment asks for it:

``AGENTRL_SGLANG_DETOKENIZER=thread``: the server's detokenizer runs as a thread of its launcher process (the one that
also holds the HTTP server and the tokenizer manager) instead of a process of its own. A process of SGLang's imports
(torch, transformers, sglang) holds ~650 MiB of anonymous memory before it does any work; the detokenizer's own state
is a tokenizer and a table of decode offsets. The thread sends and receives on the same ZMQ sockets the process would,
and a crash in it sends SIGQUIT to the launcher, as a crashed detokenizer process does (SGLang's launcher then stops
the server). Its work (incremental detokenization) then shares the launcher's GIL with the tokenizer manager:
nothing on a CPU server whose processes share one core, a cap on a GPU server streaming thousands of requests (keep
the process there). Only the single-detokenizer, single-tokenizer layout (SGLang's default) without metrics is moved;
any other is left as it is.

Written against SGLang 0.5.23's ``Engine._launch_detokenizer_subprocesses``; if that is not found the plugin logs why
and SGLang starts its process as before.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import traceback
from typing import Any

logger = logging.getLogger("agentrl.sglang_plugin")

DETOKENIZER_ENV = "AGENTRL_SGLANG_DETOKENIZER"
TARGET = "sglang.srt.entrypoints.engine.Engine._launch_detokenizer_subprocesses"


def register() -> None:
    """SGLang calls this early in every process of a server (the launcher and each child it spawns)."""
    if os.environ.get(DETOKENIZER_ENV, "process") != "thread" or multiprocessing.parent_process() is not None:
        return  # only the launcher starts the detokenizer
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, detokenizer_in_thread, HookType.AROUND)


def detokenizer_in_thread(original: Any, cls: Any, *args: Any, **kwargs: Any) -> tuple[list[Any], list[str]]:
    """Around ``Engine._launch_detokenizer_subprocesses(server_args, port_args, run_detokenizer_process_func)``: start
    the detokenizer as a daemon thread of this process and return no process to watch. SGLang's own launch for any
    layout but the default, with metrics on (the detokenizer's CPU counter would be registered twice in one
    process), or for an SGLang whose names differ from 0.5.23's."""
    try:
        from sglang.srt.managers.detokenizer_manager import DetokenizerManager, run_detokenizer_process
        from sglang.srt.runtime_context import get_observability, get_serving

        bound = dict(zip(("server_args", "port_args", "run_detokenizer_process_func"), args), **kwargs)
        server_args, port_args = bound["server_args"], bound["port_args"]
        serving, metrics = get_serving(), get_observability().enable_metrics
        default = (serving.detokenizer_worker_num <= 1 and serving.tokenizer_worker_num == 1 and not metrics
                   and bound["run_detokenizer_process_func"] is run_detokenizer_process)
    except (ImportError, AttributeError, KeyError) as e:
        logger.warning("agentrl: SGLang's detokenizer keeps its process (this SGLang differs from 0.5.23: %s)", e)
        default = False
    if not default:
        return original(cls, *args, **kwargs)  # type: ignore[no-any-return]
    manager = DetokenizerManager(server_args, port_args)  # binds its sockets here: an error stops the launch

    def serve() -> None:
        try:
            manager.event_loop()
        except BaseException:  # noqa: BLE001  # as SGLang's detokenizer process: log, then stop the server
            logger.error("DetokenizerManager hit an exception: %s", traceback.format_exc())
            stop_server()

    threading.Thread(target=serve, name="sglang-detokenizer", daemon=True).start()
    print("agentrl: SGLang's detokenizer runs as a thread of the launcher process "
          f"({DETOKENIZER_ENV}=thread)", flush=True)
    return [], []


def stop_server() -> None:
    """What a crashed detokenizer process does: SIGQUIT to the launcher, whose handler stops the whole server."""
    os.kill(os.getpid(), signal.SIGQUIT)
