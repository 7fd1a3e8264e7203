"""``weight_sync: distributed`` against a REAL SGLang server (tiny model, CPU, gloo): the trainer's sender
(agentrl.trainer.weight_sync) broadcasts perturbed weights in several buckets, the rollout side's Broadcast source
drives the server's RL update routes, and the server then serves exactly the weights (and greedy outputs) that
loading the same weights from disk gives. Failures end within the configured timeout with a clear error, and the
next update succeeds. ``weight_sync: tensor`` likewise: the server loads the sender's shared memory and serves what
disk serves; the memory is freed once nobody holds it. The shared server gets its own weights and version back
after each test."""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import torch
from safetensors.torch import load_file, save_file

from agentrl.engine.base import SamplingParams
from agentrl.engine.client import SGLangClient
from agentrl.engine.weight_sync import Broadcast, Tensors
from agentrl.errors import EngineError
from agentrl.trainer.weight_sync import WeightSender
from agentrl.weight_sync import TensorOffer, WeightOffer, WeightSyncError

pytestmark = pytest.mark.sglang

TIMEOUT_S = 8.0
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [[1, 42, 7, 300, 12], [1, 9000, 31, 5]]
NAMES = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight",
         "model.norm.weight"]


def perturbed(tiny: Path, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g, dtype=v.dtype) if v.is_floating_point() else v
            for k, v in load_file(str(tiny / "model.safetensors")).items()}


def hf_folder(tiny: Path, sd: dict[str, torch.Tensor], out: Path) -> Path:
    out.mkdir()
    for f in tiny.iterdir():
        if f.name != "model.safetensors":
            shutil.copy2(f, out / f.name)
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


async def served(url: str, name: str) -> torch.Tensor:
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{url}/get_weights_by_name", json={"name": name, "truncate_size": 10**9}) as r:
            return torch.tensor(await r.json())


async def greedy(client: SGLangClient) -> list[list[int]]:
    return [(await client.generate(p, GREEDY)).output_ids for p in PROMPTS]


class Trainer:
    """The trainer's side as the weight server runs it: an offer, then the send in a thread."""

    def __init__(self, sender: WeightSender, *, extra_ranks: int = 0) -> None:
        self.sender, self.extra_ranks = sender, extra_ranks
        self.sends: list[asyncio.Future[float]] = []

    async def offer(self, world_size: int) -> WeightOffer:
        pending = self.sender.offer(world_size + self.extra_ranks)
        self.sends.append(asyncio.ensure_future(asyncio.to_thread(self.sender.send, pending)))
        return pending.offer

    async def results(self) -> list[float | BaseException]:
        return await asyncio.gather(*self.sends, return_exceptions=True)


@pytest.fixture
async def client(sglang_url: str, tiny_model_path: Path) -> AsyncIterator[SGLangClient]:
    async with SGLangClient(sglang_url) as c:
        before = await c.weight_version()
        try:
            yield c
        finally:
            await c.update_weights(str(tiny_model_path), before)


async def test_a_broadcast_serves_exactly_what_loading_the_same_weights_from_disk_serves(
        client: SGLangClient, tiny_model_path: Path, tmp_path: Path) -> None:
    sd = perturbed(tiny_model_path, seed=1)
    version = await client.weight_version() + 1
    sender = WeightSender(address="127.0.0.1", bucket_bytes=1 << 17, timeout_s=TIMEOUT_S)
    sender.set_weights(version, sd)
    assert len(sender.offer(2).offer.buckets) > 2  # several buckets (the embedding alone is 12 MB: one of its own)
    trainer = Trainer(sender)
    source = Broadcast(version, trainer.offer, attempts=1)
    assert await source.load([client]) == [None]
    [sent] = await trainer.results()
    assert isinstance(sent, float), sent
    assert await client.weight_version() == version and source.version == version
    after_broadcast = {n: await served(client.url, n) for n in NAMES}
    for n in NAMES:
        assert torch.equal(after_broadcast[n], sd[n]), n
    outputs = await greedy(client)

    await client.update_weights(str(hf_folder(tiny_model_path, sd, tmp_path / "perturbed")), version + 1)
    assert await greedy(client) == outputs
    for n in NAMES:
        assert torch.equal(await served(client.url, n), after_broadcast[n]), n

    await client.update_weights(str(tiny_model_path), version + 2)
    assert await greedy(client) != outputs  # the perturbation changed what the model says


async def test_a_peer_that_never_joins_ends_within_the_timeout_and_the_next_update_succeeds(
        client: SGLangClient, tiny_model_path: Path) -> None:
    sd = perturbed(tiny_model_path, seed=2)
    version = await client.weight_version() + 1
    sender = WeightSender(address="127.0.0.1", bucket_bytes=4 << 20, timeout_s=TIMEOUT_S)
    sender.set_weights(version, sd)
    absent = Trainer(sender, extra_ranks=1)  # the group waits for one more server that never comes
    t0 = time.monotonic()
    [outcome] = await Broadcast(version, absent.offer, attempts=1, margin_s=10.0).load([client])
    elapsed = time.monotonic() - t0
    assert isinstance(outcome, EngineError) and "init_weights_update_group" in str(outcome), outcome
    [sent] = await absent.results()
    assert isinstance(sent, WeightSyncError) and "failed after" in str(sent), sent
    assert elapsed < TIMEOUT_S + 10.0 + 5.0, f"the failed update took {elapsed:.1f}s"
    assert await client.health()

    trainer = Trainer(sender)
    assert await Broadcast(version, trainer.offer, attempts=1).load([client]) == [None]
    assert torch.equal(await served(client.url, NAMES[1]), sd[NAMES[1]])
    assert await client.weight_version() == version


async def test_a_bucket_the_server_refuses_fails_the_update_and_the_next_one_succeeds(
        client: SGLangClient, tiny_model_path: Path) -> None:
    sd = perturbed(tiny_model_path, seed=3)
    version = await client.weight_version() + 1
    bad = dict(sd)
    bad["model.norm.weight"] = torch.ones(65)  # one more element than the model's hidden size
    sender = WeightSender(address="127.0.0.1", bucket_bytes=1 << 20, timeout_s=TIMEOUT_S)
    sender.set_weights(version, bad)
    trainer = Trainer(sender)
    t0 = time.monotonic()
    [outcome] = await Broadcast(version, trainer.offer, attempts=1).load([client])
    assert isinstance(outcome, EngineError) and "update_weights_from_distributed" in str(outcome), outcome
    await trainer.results()  # the sender ends too (an error if buckets were left unsent), within its timeout
    assert time.monotonic() - t0 < 2 * TIMEOUT_S + 30.0
    assert await client.weight_version() == version - 1  # the refused version is not served

    sender.set_weights(version, sd)
    good = Trainer(sender)
    assert await Broadcast(version, good.offer, attempts=1).load([client]) == [None]
    assert torch.equal(await served(client.url, "model.norm.weight"), sd["model.norm.weight"])
    assert await client.weight_version() == version


async def test_after_failed_broadcasts_the_update_falls_back_to_the_folder_the_trainer_exports(
        client: SGLangClient, tiny_model_path: Path, tmp_path: Path) -> None:
    sd = perturbed(tiny_model_path, seed=4)
    version = await client.weight_version() + 1
    sender = WeightSender(address="127.0.0.1", timeout_s=2.0)
    sender.set_weights(version, sd)
    absent = Trainer(sender, extra_ranks=1)
    exported: list[Path] = []

    async def export() -> tuple[str, int]:
        exported.append(hf_folder(tiny_model_path, sd, tmp_path / f"v{version}"))
        return str(exported[-1]), version

    source = Broadcast(version, absent.offer, export=export, attempts=2, margin_s=5.0)
    assert await source.load([client]) == [None]
    assert source.fell_back and len(absent.sends) == 2 and exported
    assert torch.equal(await served(client.url, NAMES[2]), sd[NAMES[2]])
    assert await client.weight_version() == version


def shm_files(sender: WeightSender) -> list[Path]:
    return [Path("/dev/shm") / f.untyped_storage()._share_filename_cpu_()[1].decode().lstrip("/")
            for f in sender._current().flat]


async def tensor_offer(sender: WeightSender, servers: int) -> TensorOffer:
    return sender.tensor_offer(servers)


async def test_weights_from_shared_memory_serve_exactly_what_the_same_weights_from_disk_serve(
        client: SGLangClient, tiny_model_path: Path, tmp_path: Path) -> None:
    sd = perturbed(tiny_model_path, seed=5)
    version = await client.weight_version() + 1
    sender = WeightSender(address="127.0.0.1", bucket_bytes=4 << 20, timeout_s=TIMEOUT_S, shared_memory=True)
    sender.set_weights(version, sd)
    files = shm_files(sender)
    assert len(files) > 1 and all(f.is_file() for f in files)
    source = Tensors(version, lambda n: tensor_offer(sender, n), attempts=1, timeout_s=TIMEOUT_S)
    assert await source.load([client]) == [None]
    assert await client.weight_version() == version and source.version == version
    from_memory = {n: await served(client.url, n) for n in NAMES}
    for n in NAMES:
        assert torch.equal(from_memory[n], sd[n]), n
    outputs = await greedy(client)

    await client.update_weights(str(hf_folder(tiny_model_path, sd, tmp_path / "perturbed")), version + 1)
    assert await greedy(client) == outputs
    for n in NAMES:
        assert torch.equal(await served(client.url, n), from_memory[n]), n

    sender.set_weights(version + 2, perturbed(tiny_model_path, seed=6))  # the first snapshot is dropped
    deadline = time.monotonic() + 10.0
    while any(f.exists() for f in files) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    assert not any(f.exists() for f in files), "the server's load left the shared memory referenced"


async def test_a_trainer_that_refuses_a_tensor_offer_ends_the_session_and_the_next_update_succeeds(
        client: SGLangClient, tiny_model_path: Path) -> None:
    # (a payload the server cannot load is not tried here: SGLang 0.5.23 catches no error on this route, and its
    # scheduler dies; the pool then restarts the server, tests/engine/test_weight_sync_logic.py)
    sd = perturbed(tiny_model_path, seed=7)
    version = await client.weight_version() + 1
    before = await served(client.url, NAMES[1])
    sender = WeightSender(address="127.0.0.1", timeout_s=TIMEOUT_S, shared_memory=True)
    t0 = time.monotonic()
    [outcome] = await Tensors(version, lambda n: tensor_offer(sender, n), attempts=1).load([client])
    assert isinstance(outcome, EngineError) and "no weights to send yet" in str(outcome), outcome
    assert time.monotonic() - t0 < TIMEOUT_S
    assert await client.weight_version() == version - 1
    assert torch.equal(await served(client.url, NAMES[1]), before)

    sender.set_weights(version, sd)  # the session was ended: a new one opens
    assert await Tensors(version, lambda n: tensor_offer(sender, n), attempts=1).load([client]) == [None]
    assert torch.equal(await served(client.url, NAMES[1]), sd[NAMES[1]])
    assert await client.weight_version() == version


async def test_a_tensor_offer_from_another_host_falls_back_to_the_exported_folder(
        client: SGLangClient, tiny_model_path: Path, tmp_path: Path) -> None:
    sd = perturbed(tiny_model_path, seed=8)
    version = await client.weight_version() + 1
    asked: list[int] = []

    async def elsewhere(servers: int) -> TensorOffer:
        asked.append(servers)
        return TensorOffer(version=version, host="other-node/boot", payloads=("never-read",) * servers)

    async def export() -> tuple[str, int]:
        return str(hf_folder(tiny_model_path, sd, tmp_path / f"v{version}")), version

    source = Tensors(version, elsewhere, export=export, attempts=2)
    assert await source.load([client]) == [None]
    assert source.fell_back and asked == [1, 1]
    assert torch.equal(await served(client.url, NAMES[2]), sd[NAMES[2]])
    assert await client.weight_version() == version
