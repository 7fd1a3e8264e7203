"""A session's limits: built from a training episode's budget and sampling in one place; its resumes replace the
gateway's. The gateway's settings module agrees with the tool parsers on the default parser's name."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import pytest

from agentrl.async_rollout.config import EpisodeBudget
from agentrl.engine.base import EngineFinish, GenerateResult, SamplingParams
from agentrl.env.tool_parsers import BUILTIN
from agentrl.errors import EngineError
from agentrl.gateway import ChatCall, Gateway, GatewayConfig, SessionLimits, SessionStore
from agentrl.tokenizer import ChatTokenizer


def test_an_episodes_limits_take_every_field_from_its_budget_or_sampling() -> None:
    budget = EpisodeBudget(max_turns=3, max_response_tokens=99, max_context_tokens=777, max_resumes=2)
    sampling = SamplingParams(max_new_tokens=55, temperature=0.7, top_p=0.9)
    limits = SessionLimits.for_episode(budget, sampling)
    for f in dataclasses.fields(SessionLimits):
        source = budget if hasattr(budget, f.name) else sampling
        assert getattr(limits, f.name) == getattr(source, f.name), f.name


class Aborting:
    """An engine whose every generation is aborted (as by a weight update) before it samples anything."""

    def __init__(self) -> None:
        self.calls = 0

    async def generate(self, input_ids: Sequence[int], sampling: SamplingParams, *,
                       sticky_key: str | None = None) -> GenerateResult:
        self.calls += 1
        return GenerateResult([], [], [], EngineFinish.ABORT)


@pytest.mark.parametrize(("limits", "generations"), [(SessionLimits(), 5), (SessionLimits(max_resumes=1), 2)])
async def test_a_sessions_resumes_replace_the_gateways(smollm2_tokenizer: ChatTokenizer, limits: SessionLimits,
                                                         generations: int) -> None:
    engine = Aborting()
    gateway = Gateway(engine, smollm2_tokenizer, GatewayConfig(max_resumes=4))
    session = SessionStore().create(limits=limits)
    with pytest.raises(EngineError, match=f"aborted the generation {generations} times"):
        await gateway.complete(session, ChatCall(messages=[{"role": "user", "content": "hi"}]))
    assert engine.calls == generations


def test_the_default_tool_parser_is_the_builtin_one() -> None:
    assert GatewayConfig().tool_parser == BUILTIN
