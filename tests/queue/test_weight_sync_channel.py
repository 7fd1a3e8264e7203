"""The weight-sync channel (agentrl.queue.weight_sync) on real Redis servers: a request reaches the trainer's end
and its answer comes back to the asker only; error answers and silence become WeightSyncError; a request whose
asker gave up is skipped. A trainer's weight server past its last step keeps answering until the rollout side
confirms the final load (or its bound passes)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio
import torch

from agentrl.queue.weight_sync import SyncChannel
from agentrl.trainer.weight_sync import WeightSender, WeightServer
from agentrl.weight_sync import BucketMeta, TensorOffer, WeightOffer, WeightSyncError

OFFER = WeightOffer(version=2, address="127.0.0.1", port=1234, group="g", world_size=2, backend="gloo",
                    timeout_s=5.0, buckets=(BucketMeta(("w",), "float32", ((2,),)),))


async def trainer(channel: SyncChannel, replies: list[dict]) -> list:
    seen = []
    for reply in replies:
        request = await channel.next_request(block_s=5)
        assert request is not None
        seen.append(request)
        await channel.answer(request, reply)
    return seen


async def test_requests_reach_the_trainer_and_each_answer_reaches_its_asker(client: redis.asyncio.Redis,
                                                                            name: str) -> None:
    channel = SyncChannel(client, name)
    serving = asyncio.create_task(trainer(channel, [{"offer": OFFER.to_dict()}, {"path": "/w/v2", "version": 2}]))
    assert await channel.offer(2, world_size=2, timeout_s=5) == OFFER
    assert await channel.export(2, timeout_s=5) == ("/w/v2", 2)
    broadcast, export = await serving
    assert (broadcast.kind, broadcast.version, broadcast.world_size) == ("broadcast", 2, 2)
    assert export.kind == "export" and not export.expired


async def test_a_tensor_request_counts_servers_and_its_offer_comes_back(client: redis.asyncio.Redis,
                                                                          name: str) -> None:
    channel = SyncChannel(client, name)
    offer = TensorOffer(version=3, host="node/boot", payloads=("p0", "p1"))
    serving = asyncio.create_task(trainer(channel, [{"tensor": offer.to_dict()}]))
    assert await channel.tensors(3, servers=2, timeout_s=5) == offer
    [request] = await serving
    assert (request.kind, request.version, request.world_size) == ("tensor", 3, 2)


async def test_an_error_answer_and_no_answer_are_weight_sync_errors(client: redis.asyncio.Redis, name: str) -> None:
    channel = SyncChannel(client, name)
    serving = asyncio.create_task(trainer(channel, [{"error": "no weights to send yet"}]))
    with pytest.raises(WeightSyncError, match="refused the broadcast request for weights v3: no weights"):
        await channel.offer(3, world_size=2, timeout_s=5)
    await serving
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError, match="did not answer the export request .* within 0.3s"):
        await channel.export(3, timeout_s=0.3)
    assert time.monotonic() - t0 < 5


async def test_a_request_whose_asker_gave_up_is_skipped(client: redis.asyncio.Redis, name: str) -> None:
    channel = SyncChannel(client, name)
    with pytest.raises(WeightSyncError):
        await channel.offer(1, world_size=2, timeout_s=0.2)  # nobody serves: the asker gives up
    await asyncio.sleep(0.3)
    assert await channel.next_request(block_s=0.5) is None  # its deadline passed: not served late


async def test_a_confirmed_load_is_read_back_and_forgotten(client: redis.asyncio.Redis, name: str) -> None:
    channel = SyncChannel(client, name)
    assert await channel.loaded() is None
    await channel.confirm_loaded(3)
    assert await SyncChannel(client, name).loaded() == 3  # shared through Redis, not the object
    await channel.forget_loaded()
    assert await channel.loaded() is None


def _finishing_server(redis_url: str, name: str, tmp_path: Path) -> tuple[WeightServer, WeightSender]:
    sender = WeightSender(address="127.0.0.1", timeout_s=5.0)
    sender.set_weights(2, {"w": torch.arange(6, dtype=torch.float32)})

    def write(sd: Any, path: Path) -> None:
        path.mkdir(parents=True)
        torch.save(dict(sd), path / "w.pt")

    async def connect() -> SyncChannel:
        return SyncChannel.connect(redis_url, name)

    return WeightServer(sender, connect, export_dir=tmp_path, write=write).start(), sender


async def test_a_finishing_weight_server_answers_the_last_load_asked_after_the_last_step(
        redis_url: str, client: redis.asyncio.Redis, name: str, tmp_path: Path) -> None:
    """The end-of-run race: the trainer's last step is done (finish called) and the rollout side asks for the final
    version only afterwards; the server answers it, and stops once the load is confirmed, well before its bound."""
    channel = SyncChannel(client, name)
    await channel.confirm_loaded(2)  # left by an earlier attempt of the run: forgotten when the server starts
    server, _ = _finishing_server(redis_url, name, tmp_path)
    finishing = asyncio.create_task(asyncio.to_thread(server.finish, 2, 60.0))
    await asyncio.sleep(2.5)
    assert not finishing.done()  # the stale confirmation did not end it
    assert await channel.export(2, timeout_s=10) == (str(tmp_path / "v2"), 2)
    t0 = time.monotonic()
    await channel.confirm_loaded(2)
    assert await asyncio.wait_for(finishing, 15) is True
    assert time.monotonic() - t0 < 15
    with pytest.raises(WeightSyncError, match="did not answer"):  # stopped: nothing answers any more
        await channel.export(2, timeout_s=1.5)


async def test_a_finishing_weight_server_without_a_confirmation_stops_at_its_bound(
        redis_url: str, name: str, tmp_path: Path) -> None:
    server, _ = _finishing_server(redis_url, name, tmp_path)
    t0 = time.monotonic()
    assert await asyncio.to_thread(server.finish, 2, 1.5) is False
    assert 1.5 <= time.monotonic() - t0 < 1.5 + 10
