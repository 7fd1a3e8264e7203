"""Inference engines: SGLang servers, their HTTP client, a pool of servers with sticky routing, and a client of
any OpenAI-compatible chat-completions server (text level, for evaluations).

The public names are loaded on first use, so the contract (``agentrl.engine.base``) and the settings
(``SGLangServerConfig``; ``PoolConfig`` and ``Timeouts`` in ``agentrl.engine.config``) can be read without the HTTP
client or the pool.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agentrl._lazy import lazy_exports

if TYPE_CHECKING:
    from agentrl.engine.base import (
        PAUSE_MODES,
        ChatEngine,
        ChatResult,
        ChatToolCall,
        ControllableEngine,
        EngineFinish,
        EngineTimeout,
        EngineUnavailable,
        GenerateResult,
        InferenceEngine,
        PauseMode,
        PrefillEngine,
        SamplingParams,
    )
    from agentrl.engine.client import Retry, SGLangClient
    from agentrl.engine.config import PoolConfig, Timeouts
    from agentrl.engine.openai_chat import OpenAIChatClient
    from agentrl.engine.pool import EnginePool, MemberState, MemberStats
    from agentrl.engine.server import SGLangServer, SGLangServerConfig, pool_configs

_HOME = {
    **dict.fromkeys(["PAUSE_MODES", "ChatEngine", "ChatResult", "ChatToolCall", "ControllableEngine", "EngineFinish", "EngineTimeout", "EngineUnavailable",
                     "GenerateResult", "InferenceEngine", "PauseMode", "PrefillEngine", "SamplingParams"], "base"),
    **dict.fromkeys(["Retry", "SGLangClient"], "client"),
    **dict.fromkeys(["PoolConfig", "Timeouts"], "config"),
    **dict.fromkeys(["OpenAIChatClient"], "openai_chat"),
    **dict.fromkeys(["EnginePool", "MemberState", "MemberStats"], "pool"),
    **dict.fromkeys(["SGLangServer", "SGLangServerConfig", "pool_configs"], "server"),
}

__all__ = [
    "PAUSE_MODES", "ChatEngine", "ChatResult", "ChatToolCall", "ControllableEngine", "EngineFinish", "EnginePool",
    "EngineTimeout", "EngineUnavailable", "GenerateResult", "InferenceEngine", "MemberState", "MemberStats",
    "OpenAIChatClient", "PauseMode", "PoolConfig", "PrefillEngine", "Retry", "SGLangClient",
    "SGLangServer", "SGLangServerConfig", "SamplingParams", "Timeouts", "pool_configs",
]

__getattr__, __dir__ = lazy_exports(__name__, _HOME)
