"""``engine.router: true`` against the real sglang-router and SGLang server: generation through the router comes back
exactly as from the server (token ids, logprobs, per-token weight versions: its meta_info is passed through), a
weight update fanned out by the pool is what the router then serves, and a router that dies is routed around."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentrl.engine import EnginePool, PoolConfig, SamplingParams, SGLangClient
from agentrl.engine.router import SGLangRouter

pytestmark = pytest.mark.sglang

GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)


async def test_generation_through_the_router_is_the_servers_own_and_survives_the_router(
        sglang_url: str, tiny_model_path: Path, tmp_path: Path) -> None:
    router = SGLangRouter([sglang_url], log_path=tmp_path / "router.log").start()
    pool = EnginePool([sglang_url], config=PoolConfig(health_interval_s=0.5), router=router.url)
    try:
        async with pool, SGLangClient(sglang_url) as direct:
            before = await direct.weight_version()
            # each from an empty prefix cache: a cached prefix prefills fewer tokens, and on some CPUs (an AMX
            # Xeon) the other matmul shapes round the logprobs differently (~1e-6)
            await direct.flush_cache(wait_s=60)  # the router's health probe may be running
            ours = await pool.generate([1, 5, 9, 13], GREEDY)
            await direct.flush_cache(wait_s=60)  # the router's health probe may be running
            theirs = await direct.generate([1, 5, 9, 13], GREEDY)
            assert ours.output_ids == theirs.output_ids and ours.logprobs == theirs.logprobs
            assert pool.stats()[0].requests == 0, "the router routed it, not the pool"
            await pool.update_weights(str(tiny_model_path), before + 1)
            assert (await pool.generate([2, 4, 6], GREEDY)).weight_versions == [before + 1] * GREEDY.max_new_tokens
            router.stop()
            after = await pool.generate([1, 5, 9, 13], GREEDY)  # the router is gone: the pool routes itself
            assert after.output_ids == theirs.output_ids and pool.stats()[0].requests == 1
            await direct.set_weight_version(before)
    finally:
        router.stop()
