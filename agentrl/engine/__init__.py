"""Inference engines: SGLang servers and their HTTP client."""

from agentrl.engine.base import EngineFinish, GenerateResult, InferenceEngine, SamplingParams
from agentrl.engine.client import SGLangClient
from agentrl.engine.server import SGLangServer, SGLangServerConfig

__all__ = ["EngineFinish", "GenerateResult", "InferenceEngine", "SamplingParams", "SGLangClient", "SGLangServer",
           "SGLangServerConfig"]
