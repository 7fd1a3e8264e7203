"""Episodes against a REAL SGLang server (tiny model on CPU): token-in/token-out exactness, weight updates that
land mid-episode, timeouts."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from agentrl.async_rollout.episode import EpisodeBudget, EpisodeRunner
from agentrl.engine.base import SamplingParams
from agentrl.engine.client import SGLangClient, Timeouts
from agentrl.env.base import Environment, Observation, StepResult
from agentrl.errors import EngineError
from agentrl.rewards import RewardResult
from agentrl.types import FinishReason, Task

pytestmark = pytest.mark.sglang


class Recording:
    """Wraps a client; records the exact ids sent and received."""

    def __init__(self, client: SGLangClient) -> None:
        self.client = client
        self.sent: list[list[int]] = []
        self.got: list[list[int]] = []
        self.logprobs: list[list[float]] = []

    async def generate(self, input_ids: Sequence[int], sampling: SamplingParams, *, sticky_key=None):
        self.sent.append(list(input_ids))
        out = await self.client.generate(input_ids, sampling)
        self.got.append(list(out.output_ids))
        self.logprobs.append(list(out.logprobs))
        return out

    async def update_weights(self, path, version): ...
    async def weight_version(self):
        return await self.client.weight_version()
    async def aclose(self): ...


class StopOnLetterEnv(Environment):
    """Turns end at the letter 'e' (frequent in random text); each gets an observation until max turns."""

    name = "letters"
    stop = ("e",)

    async def reset(self, task: Task):
        return [{"role": "user", "content": task.prompt}]

    async def step(self, text: str) -> StepResult:
        return StepResult(Observation(text="\n[tool says hi]\n"), False)

    async def score(self, response) -> RewardResult:
        return RewardResult.scored(0.5)


class NoStopEnv(StopOnLetterEnv):
    stop = ()


async def test_token_ids_are_exactly_what_sglang_saw_and_returned(sglang_url, chat_tokenizer):
    async with SGLangClient(sglang_url) as client:
        rec = Recording(client)
        runner = EpisodeRunner(rec, chat_tokenizer, SamplingParams(max_new_tokens=24, temperature=1.0),
                               EpisodeBudget(max_turns=4, max_response_tokens=400))
        traj = await runner.run(StopOnLetterEnv(), Task(id="p1", prompt="Say something."), group_id="g")
    obs = chat_tokenizer.encode_text("\n[tool says hi]\n")
    assert len(rec.sent) >= 2, "expected a multi-turn episode"
    # every request is the previous request + what SGLang returned + the observation, never re-tokenised
    for i in range(1, len(rec.sent)):
        assert rec.sent[i] == rec.sent[i - 1] + rec.got[i - 1] + obs
    assert traj.token_ids[: len(rec.sent[-1])].tolist() == rec.sent[-1]
    assert traj.token_ids[len(rec.sent[-1]):].tolist() == rec.got[-1]
    model = [(t, lp) for t, lp, m in zip(traj.token_ids, traj.behavior_logprobs, traj.loss_mask) if m]
    assert [t for t, _ in model] == [t for ids in rec.got for t in ids]
    assert [lp for _, lp in model] == pytest.approx([lp for lps in rec.logprobs for lp in lps], abs=1e-6)
    obs_positions = [i for i, m in enumerate(traj.loss_mask) if not m and i >= traj.prompt_len]
    assert len(obs_positions) == len(obs) * (len(rec.sent) - 1)
    assert all(traj.weight_versions[i] == -1 for i in obs_positions)


async def test_weight_update_mid_episode_splits_versions_per_token(sglang_url, chat_tokenizer, tiny_model_path):
    async with SGLangClient(sglang_url) as client:
        before = await client.weight_version()
        runner = EpisodeRunner(client, chat_tokenizer, SamplingParams(max_new_tokens=4000, ignore_eos=True),
                               EpisodeBudget(max_turns=1, max_response_tokens=4000, max_context_tokens=8000,
                                             max_resumes=1))
        episode = asyncio.create_task(runner.run(NoStopEnv(), Task(id="p2", prompt="Count.")))
        await asyncio.sleep(1.5)
        assert not episode.done(), "generation finished before the update; make it longer"
        await client.pause("abort")  # the runner resumes the aborted turn on the new weights
        await client.update_weights(str(tiny_model_path), before + 1)
        await client.resume()
        await asyncio.sleep(1.5)
        await client.pause("abort")  # a second abort is over the resume budget: the episode ends here
        await client.resume()
        traj = await asyncio.wait_for(episode, 300)
        assert await client.weight_version() == before + 1
    versions = traj.generated_versions
    assert traj.finish_reason is FinishReason.ABORTED
    k = versions.index(before + 1)
    assert 0 < k < len(versions) and versions == [before] * k + [before + 1] * (len(versions) - k)
    assert traj.loss_mask[traj.prompt_len:].tolist() == [1] * len(versions)
    assert len(traj.turns) == 1 and traj.turns[0].token_end - traj.turns[0].token_start == len(versions)


async def test_calls_time_out_with_an_error_naming_the_server(sglang_url):
    async with SGLangClient(sglang_url, timeouts=Timeouts(generate_s=0.05)) as client:
        with pytest.raises(EngineError, match="timed out") as err:
            await client.generate(list(range(10, 40)), SamplingParams(max_new_tokens=500, ignore_eos=True))
        assert sglang_url in str(err.value)
        await client.abort_all()


async def test_unreachable_server_is_an_engine_error_not_a_hang():
    from agentrl.engine.client import Retry
    from agentrl.engine.server import free_port

    async with SGLangClient(f"http://127.0.0.1:{free_port()}", retry=Retry(attempts=2, base_delay_s=0.01)) as c:
        with pytest.raises(EngineError, match="after 2 attempts"):
            await c.generate([1, 2, 3], SamplingParams(max_new_tokens=1))


async def test_a_group_prefills_its_prompt_once_and_every_sample_finds_it_cached(sglang_url, chat_tokenizer):
    """SharedPrefill against the real server: SGLang's prefill-only request caches the prompt, and each sample's
    first turn reports the whole prompt as cached (``meta_info.cached_tokens``), not prefilled again."""
    import uuid

    class Cached(Recording):
        def __init__(self, client: SGLangClient) -> None:
            super().__init__(client)
            self.cached: list[tuple[int, int]] = []  # (prompt tokens sent, of them cached)
            self.prefills = 0

        async def prefill(self, input_ids: Sequence[int], *, sticky_key=None) -> None:
            self.prefills += 1
            await self.client.prefill(input_ids, sticky_key=sticky_key)

        async def generate(self, input_ids: Sequence[int], sampling: SamplingParams, *, sticky_key=None):
            out = await self.client.generate(input_ids, sampling)
            self.cached.append((len(input_ids), int(out.meta.get("cached_tokens", -1))))
            return out

    async with SGLangClient(sglang_url) as client:
        engine = Cached(client)
        runner = EpisodeRunner(engine, chat_tokenizer, SamplingParams(max_new_tokens=8, temperature=1.0),
                               EpisodeBudget(max_turns=1), share_prefill=True)
        task = Task(id="p", prompt=f"A prompt nobody sent before: {uuid.uuid4().hex} " * 3)
        trajs = await asyncio.gather(*(runner.run(NoStopEnv(), task, group_id="g") for _ in range(4)))
    assert engine.prefills == 1 and len(engine.cached) == 4
    assert all(cached >= sent - 1 for sent, cached in engine.cached), engine.cached  # SGLang recomputes the last
    assert {t.prompt_len for t in trajs} == {engine.cached[0][0]}
