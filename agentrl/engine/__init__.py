"""Inference engines: SGLang servers, their HTTP client, and a pool of servers with sticky routing."""

from agentrl.engine.base import (
    PAUSE_MODES,
    ControllableEngine,
    EngineFinish,
    EngineTimeout,
    EngineUnavailable,
    GenerateResult,
    InferenceEngine,
    PauseMode,
    SamplingParams,
)
from agentrl.engine.client import Retry, SGLangClient, Timeouts
from agentrl.engine.pool import EnginePool, MemberState, MemberStats, PoolConfig
from agentrl.engine.server import SGLangServer, SGLangServerConfig, pool_configs

__all__ = [
    "PAUSE_MODES", "ControllableEngine", "EngineFinish", "EnginePool", "EngineTimeout", "EngineUnavailable", "GenerateResult",
    "InferenceEngine", "MemberState", "MemberStats", "PauseMode", "PoolConfig", "Retry", "SGLangClient",
    "SGLangServer", "SGLangServerConfig", "SamplingParams", "Timeouts", "pool_configs",
]
