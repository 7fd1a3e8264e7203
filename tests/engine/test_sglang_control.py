"""SGLang's RL control API against a REAL server (tiny model): the three pause modes, continue, abort, weight
updates while paused, and calls made while the server is paused ending by their deadline."""

from __future__ import annotations

import asyncio

import pytest

from agentrl.engine.base import EngineFinish, SamplingParams
from agentrl.engine.client import SGLangClient, Timeouts
from agentrl.errors import EngineError

pytestmark = pytest.mark.sglang

LONG = SamplingParams(max_new_tokens=4000, ignore_eos=True)  # far longer than any test waits


async def _running(client: SGLangClient) -> asyncio.Task:
    """A generation that is surely in flight on the server when this returns."""
    task = asyncio.create_task(client.generate(list(range(100, 130)), LONG))
    await asyncio.sleep(1.5)
    assert not task.done(), "the generation ended before the test could interrupt it"
    return task


async def test_pause_abort_returns_partial_tokens_then_resume_serves(sglang_url):
    async with SGLangClient(sglang_url) as client:
        task = await _running(client)
        await client.pause("abort")
        try:
            out = await asyncio.wait_for(task, 60)
        finally:
            await client.resume()
        assert out.finish is EngineFinish.ABORT and 0 < len(out.output_ids) < LONG.max_new_tokens
        after = await client.generate([5, 6, 7], SamplingParams(max_new_tokens=3, ignore_eos=True))
        assert len(after.output_ids) == 3 and after.finish is EngineFinish.LENGTH


async def test_flush_cache_is_refused_while_a_request_runs_and_with_wait_s_flushes_once_idle(sglang_url):
    async with SGLangClient(sglang_url) as client:
        task = await _running(client)
        try:
            with pytest.raises(EngineError, match="did not flush its cache: requests were running or waiting"):
                await client.flush_cache()
            waiting = asyncio.create_task(client.flush_cache(wait_s=60))
            await asyncio.sleep(1.0)
            assert not waiting.done(), "flushed under a running request"
            await client.abort_all()
            await asyncio.wait_for(waiting, 60)  # SGLang's deferred flush ran once the server was idle
        finally:
            await client.abort_all()
            out = await asyncio.wait_for(task, 60)
        assert out.finish is EngineFinish.ABORT
        with pytest.raises(ValueError, match="wait_s must be >= 0"):
            await client.flush_cache(wait_s=-1)


@pytest.mark.parametrize("mode", ["retract", "in_place"])
async def test_paused_request_continues_on_the_new_weights(sglang_url, tiny_model_path, mode):
    async with SGLangClient(sglang_url) as client:
        before = await client.weight_version()
        task = await _running(client)
        await client.pause(mode)
        try:
            await asyncio.sleep(0.5)
            assert not task.done(), f"pause({mode!r}) must hold the request, not end it"
            await client.update_weights(str(tiny_model_path), before + 1)
        finally:
            await client.resume()
        await asyncio.sleep(1.5)
        await client.abort_all()  # ends the long request; its tokens so far come back with their versions
        out = await asyncio.wait_for(task, 60)
        assert await client.weight_version() == before + 1
    versions = out.weight_versions
    k = versions.index(before + 1)
    assert 0 < k < len(versions), "tokens from both versions expected"
    assert versions == [before] * k + [before + 1] * (len(versions) - k)


async def test_generate_while_paused_ends_by_its_deadline(sglang_url):
    async with SGLangClient(sglang_url, timeouts=Timeouts(generate_s=1.0)) as client:
        await client.pause("retract")
        try:
            with pytest.raises(EngineError, match="timed out"):
                await asyncio.wait_for(client.generate([1, 2, 3], SamplingParams(max_new_tokens=2)), 60)
        finally:
            await client.resume()
        assert await client.health()
