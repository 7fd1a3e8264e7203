"""No client call can outlive its deadline: against a server that stalls, stays busy (503, retried), streams a
body that never ends, or drops the connection — every call ends with an EngineError naming the server and call."""

from __future__ import annotations

import asyncio

import pytest

from agentrl.engine.base import EngineUnavailable, SamplingParams
from agentrl.engine.client import Retry, SGLangClient, Timeouts
from agentrl.errors import EngineError

DEADLINE = Timeouts(generate_s=0.3, control_s=0.3, update_weights_s=0.3)

CALLS = {
    "generate": lambda c: c.generate([1, 2, 3], SamplingParams(max_new_tokens=4)),
    "update_weights": lambda c: c.update_weights("/nowhere", 1),
    "set_weight_version": lambda c: c.set_weight_version(1),
    "weight_version": lambda c: c.weight_version(),
    "pause": lambda c: c.pause("retract"),
    "resume": lambda c: c.resume(),
    "abort": lambda c: c.abort("rid"),
    "abort_all": lambda c: c.abort_all(),
    "flush_cache": lambda c: c.flush_cache(),
}


@pytest.mark.parametrize("mode", ["stall", "503", "slow_body"])
@pytest.mark.parametrize("call", sorted(CALLS))
async def test_every_call_ends_by_its_deadline(misbehaving, mode, call):
    misbehaving.mode = mode
    # a retry policy whose backoff alone would exceed the deadline many times over
    async with SGLangClient(misbehaving.url, timeouts=DEADLINE, retry=Retry(attempts=50, base_delay_s=0.2)) as c:
        # the outer wait_for is only a safety net: the client must raise its own EngineError first
        with pytest.raises(EngineError, match="timed out") as err:
            await asyncio.wait_for(CALLS[call](c), 30)
    assert misbehaving.url in str(err.value)


async def test_health_is_false_not_a_hang(misbehaving):
    async with SGLangClient(misbehaving.url, timeouts=DEADLINE) as c:
        assert await asyncio.wait_for(c.health(), 30) is False


async def test_dropped_connection_is_engine_unavailable(misbehaving):
    misbehaving.mode = "drop"
    async with SGLangClient(misbehaving.url, timeouts=Timeouts(generate_s=20)) as c:
        with pytest.raises(EngineUnavailable, match="dropped the connection"):
            await asyncio.wait_for(c.generate([1], SamplingParams(max_new_tokens=1)), 30)


async def test_a_reused_connection_the_server_closed_is_sent_again_on_a_new_one(misbehaving):
    # POSTs (as /generate): aiohttp sends a GET again by itself, never a POST
    misbehaving.mode = "drop_reused"
    async with SGLangClient(misbehaving.url, timeouts=Timeouts(control_s=20)) as c:
        for v in range(3):
            await c.set_weight_version(v)
    assert len(misbehaving.hits) == 5 and len(misbehaving.connections) == 3  # 2 dropped reuses, 3 new connections
    async with SGLangClient(misbehaving.url, timeouts=Timeouts(control_s=20),
                            stale_connection_retries=0) as c:
        await c.set_weight_version(1)
        with pytest.raises(EngineUnavailable, match="dropped the connection"):  # what the retry is for
            await c.set_weight_version(2)


async def test_a_generate_sent_again_carries_a_fresh_rid_and_the_first_is_aborted(misbehaving):
    # the server read the first send and may be running it: the same rid again would be refused by SGLang (400
    # "Duplicate request ID detected", seen when a loaded machine dropped connections under an eval)
    misbehaving.mode = "drop_first"
    misbehaving.answer = {"output_ids": [7], "text": "x",
                          "meta_info": {"output_token_logprobs": [[-0.5, 7, None]], "finish_reason": {"type": "stop"}}}
    async with SGLangClient(misbehaving.url, timeouts=Timeouts(generate_s=20, control_s=20)) as c:
        out = await c.generate([1, 2], SamplingParams(max_new_tokens=1))
        await misbehaving.arrival("/abort_request")  # sent in the background
    assert out.output_ids == [7] and out.logprobs == [-0.5]
    first, second = (b for h, b in zip(misbehaving.hits, misbehaving.bodies) if h == "/generate")
    assert first["rid"] != second["rid"] and first["input_ids"] == second["input_ids"] == [1, 2]
    assert {"rid": first["rid"]} in misbehaving.bodies  # the first send is aborted on the server


async def test_idle_connections_are_closed_before_the_server_would(misbehaving):
    misbehaving.mode = "drop_reused"
    async with SGLangClient(misbehaving.url, timeouts=Timeouts(control_s=20), keepalive_s=0.2,
                            stale_connection_retries=0) as c:
        await c.set_weight_version(1)
        await asyncio.sleep(0.6)  # idle longer than our keep-alive: the next call opens a new connection
        await c.set_weight_version(2)
    assert len(misbehaving.hits) == 2 == len(misbehaving.connections)


async def test_timed_out_generate_is_aborted_on_the_server(misbehaving):
    async with SGLangClient(misbehaving.url, timeouts=DEADLINE, retry=Retry(attempts=1)) as c:
        with pytest.raises(EngineError):
            await c.generate([1], SamplingParams(max_new_tokens=1))
        misbehaving.mode = "503"  # let the abort be answered quickly
        await misbehaving.arrival("/abort_request")  # sent in the background
    assert misbehaving.hits[:2] == ["/generate", "/abort_request"]


async def test_a_cancelled_generate_is_aborted_on_the_server_with_its_rid(misbehaving):
    # what the gateway relies on when an agent's client disconnects: cancelling the call aborts that request
    async with SGLangClient(misbehaving.url, retry=Retry(attempts=1)) as c:
        call = asyncio.ensure_future(c.generate([1, 2], SamplingParams(max_new_tokens=4)))
        await misbehaving.arrival("/generate")
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        misbehaving.mode = "503"  # let the abort be answered quickly
        await misbehaving.arrival("/abort_request")  # sent in the background
    assert misbehaving.hits[:2] == ["/generate", "/abort_request"]
    generated, aborted = misbehaving.bodies[:2]
    assert aborted == {"rid": generated["rid"]} and len(generated["rid"]) == 32


async def test_bad_pause_mode_is_refused_before_any_request(misbehaving):
    async with SGLangClient(misbehaving.url) as c:
        with pytest.raises(EngineError, match="pause mode must be one of"):
            await c.pause("sideways")  # type: ignore[arg-type]
    assert misbehaving.hits == []


async def test_busy_answers_are_retried_by_the_injected_policy_then_named(misbehaving):
    misbehaving.mode = "503"
    async with SGLangClient(misbehaving.url, retry=Retry(attempts=3, base_delay_s=0.01)) as c:
        with pytest.raises(EngineError, match="failed after 3 attempts.*503") as err:
            await c.weight_version()
    assert not isinstance(err.value, EngineUnavailable)
    assert err.value.status == 503
    assert misbehaving.hits == ["/model_info"] * 3


async def test_a_refused_connection_is_retried_then_engine_unavailable():
    from agentrl.engine.server import free_port

    async with SGLangClient(f"http://127.0.0.1:{free_port()}", retry=Retry(attempts=2, base_delay_s=0.01)) as c:
        with pytest.raises(EngineUnavailable, match="cannot connect after 2 attempts"):
            await c.weight_version()
