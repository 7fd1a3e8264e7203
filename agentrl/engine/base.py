"""The inference-engine contracts: :class:`InferenceEngine`, what the rollout side relies on (token ids in, token
ids + logprobs out), and :class:`ChatEngine`, a text-level chat-completions engine (messages in, assistant text
out: no token ids, logprobs or weight versions) that evaluations may use for a model agentrl does not serve."""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Protocol, runtime_checkable

from pydantic import Field

from agentrl.errors import EngineError

#: SGLang's ``/pause_generation`` modes: ``abort`` returns in-flight requests at once (finish ``abort``, partial
#: tokens; the caller resumes them); ``retract`` moves them back to the server's waiting queue (KV recomputed
#: after ``/continue_generation``, the request continues on the new weights); ``in_place`` freezes them with their
#: KV cache (computed by the old weights).
PauseMode = Literal["abort", "retract", "in_place"]
PAUSE_MODES: tuple[str, ...] = ("abort", "retract", "in_place")


class EngineUnavailable(EngineError):
    """The server could not be reached or dropped the connection (it may have died): a router takes it out."""


class EngineTimeout(EngineError):
    """A call did not finish within its deadline (the server is overloaded, paused or hung)."""


class EngineFinish(str, enum.Enum):
    STOP = "stop"  # EOS / stop token / stop string
    LENGTH = "length"  # max_new_tokens reached
    ABORT = "abort"  # the server aborted the request


@dataclass(frozen=True, slots=True)
class GenerateResult:
    """One ``/generate`` answer: exactly the tokens the engine produced, their logprobs and weight versions."""

    output_ids: list[int]
    logprobs: list[float]
    weight_versions: list[int]  # one per output token
    finish: EngineFinish
    matched_stop: str | int | None = None
    text: str = ""
    latency_s: float = 0.0
    meta: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """SGLang's sampling parameters of one request (the bounds are checked where they come from outside: a run's
    ``rollout:`` section). ``seed`` fixes the sampling of every request: samples of one prompt come out alike."""

    max_new_tokens: Annotated[int, Field(ge=1)] = 256
    temperature: Annotated[float, Field(ge=0)] = 1.0  # 0: greedy
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Field(ge=-1)] = -1  # -1: all tokens
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    #: constrained decoding (SGLang's grammar backend): the output must match this regex / EBNF grammar
    regex: str | None = None
    ebnf: str | None = None

    def to_sglang(self) -> dict[str, Any]:
        params: dict[str, Any] = {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "ignore_eos": self.ignore_eos,
            # the stop string stays in the text; the tokens always stay in output_ids (token-in/token-out)
            "no_stop_trim": True,
            "skip_special_tokens": False,
        }
        if self.stop:
            params["stop"] = list(self.stop)
        if self.stop_token_ids:
            params["stop_token_ids"] = list(self.stop_token_ids)
        if self.seed is not None:
            params["sampling_seed"] = self.seed
        if self.regex is not None:
            params["regex"] = self.regex
        if self.ebnf is not None:
            params["ebnf"] = self.ebnf
        return params


@runtime_checkable
class InferenceEngine(Protocol):
    """What an episode needs from an inference server."""

    async def generate(
        self, input_ids: Sequence[int], sampling: SamplingParams, *, sticky_key: str | None = None
    ) -> GenerateResult: ...

    async def update_weights(self, path: str, version: int) -> None: ...

    async def weight_version(self) -> int: ...

    async def aclose(self) -> None: ...


@runtime_checkable
class PrefillEngine(Protocol):
    """An engine that can compute and cache a prompt's KV without generating (SGLang's prefill-only request)."""

    async def prefill(self, input_ids: Sequence[int], *, sticky_key: str | None = None) -> None: ...


@runtime_checkable
class ControllableEngine(InferenceEngine, Protocol):
    """An engine the rollout scheduler can interrupt for a weight update (one server or a pool of them)."""

    async def pause(self, mode: PauseMode = "abort") -> None: ...

    async def resume(self) -> None: ...

    async def set_weight_version(self, version: int) -> None: ...


@dataclass(frozen=True, slots=True)
class ChatToolCall:
    """A tool call a chat-completions server returned as structured ``tool_calls`` (``arguments``: JSON text)."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class ChatResult:
    """One chat-completions answer. ``text`` ends with ``matched_stop`` when a stop string ended the turn (as a
    ``/generate`` text would); ``prompt_tokens`` / ``completion_tokens`` are the server's ``usage`` (None when it
    reports none)."""

    text: str
    finish: EngineFinish
    matched_stop: str | None = None
    tool_calls: tuple[ChatToolCall, ...] = ()
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    latency_s: float = 0.0


@dataclass(frozen=True, slots=True)
class ChatEndpoint:
    """Where a chat engine's server is, for a client of its own (an agent evaluated against that model)."""

    base_url: str  # the OpenAI base URL (``…/v1``)
    api_key: str | None
    model: str


@runtime_checkable
class ChatEngine(Protocol):
    """A text-level engine: one chat-completions call per model turn (see :mod:`agentrl.engine.openai_chat`)."""

    async def chat(self, messages: Sequence[Mapping[str, Any]], sampling: SamplingParams, *,
                   tools: Sequence[Mapping[str, Any]] = ()) -> ChatResult: ...

    async def aclose(self) -> None: ...
