"""The trainer's end of ``weight_sync: distributed`` (agentrl.trainer.weight_sync) over real gloo groups: peers in
other processes receive exactly the snapshot that was offered, in SGLang's flattened-bucket layout; a peer that
never joins fails the send within its timeout; the weight server answers broadcast and export requests. With
``shared_memory`` (``weight_sync: tensor``) another process maps exactly the snapshot from its payload, and the
memory is freed once the sender and every receiver have let go."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from agentrl.trainer.shm import shared_bytes
from agentrl.trainer.weight_sync import WeightSender, WeightServer, address_toward, flatten
from agentrl.weight_sync import BucketMeta, TensorOffer, WeightSyncError, host_id

PEER = Path(__file__).with_name("weight_peer.py")


def weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"emb": torch.randn(50, 8, generator=g), "norm": torch.randn(8, generator=g).to(torch.bfloat16),
            "w1": torch.randn(8, 16, generator=g), "w2": torch.randn(16, 8, generator=g), "steps": torch.tensor([3])}


def test_a_bucket_is_its_tensors_bytes_end_to_end_cast_on_the_way_and_a_changed_tensor_is_refused() -> None:
    sd = weights(0)
    bucket = BucketMeta(("w1", "emb"), "float32", ((8, 16), (50, 8)))
    flat, views = flatten(sd, bucket)
    assert flat.dtype == torch.uint8 and flat.numel() == bucket.nbytes
    assert torch.equal(flat[: 8 * 16 * 4].view(torch.float32).reshape(8, 16), sd["w1"])
    assert torch.equal(flat[8 * 16 * 4:].view(torch.float32).reshape(50, 8), sd["emb"])
    assert views["emb"].data_ptr() == flat[8 * 16 * 4:].data_ptr()  # the export's tensors are the buffer itself
    half, _ = flatten(sd, BucketMeta(("w1",), "bfloat16", ((8, 16),)))
    assert torch.equal(half.view(torch.bfloat16).reshape(8, 16), sd["w1"].to(torch.bfloat16))
    with pytest.raises(WeightSyncError, match="changed under its offer"):
        flatten({**sd, "w1": torch.zeros(8, 17)}, bucket)


def test_set_weights_casts_floating_tensors_to_the_engine_dtype_and_keeps_the_others() -> None:
    sender = WeightSender(address="127.0.0.1")
    sd = weights(4)
    sender.set_weights(1, sd, torch.bfloat16)
    version, held = sender.snapshot()
    assert version == 1 and held["emb"].dtype == torch.bfloat16 and held["steps"].dtype == torch.int64
    assert torch.equal(held["emb"], sd["emb"].to(torch.bfloat16)) and torch.equal(held["steps"], sd["steps"])


def test_two_peers_in_other_processes_receive_exactly_the_offered_snapshot(tmp_path: Path) -> None:
    sender = WeightSender(address="127.0.0.1", bucket_bytes=1024, timeout_s=60)
    sd = weights(1)
    sender.set_weights(5, sd)
    pending = sender.offer(3)
    sender.set_weights(6, weights(2))  # a newer version while the offer is out: the offer keeps its snapshot
    assert pending.offer.version == 5 and len(pending.offer.buckets) >= 4
    assert {b.dtype for b in pending.offer.buckets} == {"float32", "bfloat16", "int64"}
    offer = json.dumps(pending.offer.to_dict())
    peers = [subprocess.Popen([sys.executable, str(PEER), offer, str(rank), str(tmp_path / f"peer{rank}.pt")])
             for rank in (1, 2)]
    try:
        seconds = sender.send(pending)
    finally:
        codes = [p.wait(60) for p in peers]
    assert codes == [0, 0] and seconds > 0
    for rank in (1, 2):
        got = torch.load(tmp_path / f"peer{rank}.pt")
        assert got.keys() == sd.keys()
        for k, v in sd.items():
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    assert sender.offer(2).offer.version == 6


def test_a_peer_that_never_joins_fails_the_send_within_its_timeout() -> None:
    sender = WeightSender(address="127.0.0.1", timeout_s=2.0)
    with pytest.raises(WeightSyncError, match="no weights to send yet"):
        sender.offer(2)
    sender.set_weights(1, weights(0))
    with pytest.raises(WeightSyncError, match="at least one server"):
        sender.offer(1)
    pending = sender.offer(2)
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError, match=r"weights v1 to 1 server\(s\).*failed after"):
        sender.send(pending)
    assert time.monotonic() - t0 < 2.0 + 10.0


def test_the_address_servers_reach_us_at_is_loopback_for_a_local_peer() -> None:
    assert address_toward("127.0.0.1") == "127.0.0.1"


class FakeChannel:
    def __init__(self, requests: list[Any]) -> None:
        self.requests = requests
        self.answers: list[tuple[Any, dict[str, Any]]] = []

    async def next_request(self, block_s: float) -> Any:
        if self.requests:
            return self.requests.pop(0)
        await asyncio.sleep(min(block_s, 0.05))
        return None

    async def answer(self, request: Any, reply: dict[str, Any]) -> None:
        self.answers.append((request, reply))

    async def loaded(self) -> int | None:
        return None

    async def forget_loaded(self) -> None: ...

    async def aclose(self) -> None: ...


class Request:
    def __init__(self, kind: str, version: int, world_size: int = 0) -> None:
        self.kind, self.version, self.world_size, self.id = kind, version, world_size, f"{kind}-{version}"


def serve(requests: list[Any], sender: WeightSender, tmp_path: Path, n: int) -> FakeChannel:
    channel = FakeChannel(requests)
    written: list[Path] = []

    def write(sd: Any, path: Path) -> None:
        path.mkdir(parents=True)
        torch.save(dict(sd), path / "weights.pt")
        written.append(path)

    async def connect() -> FakeChannel:
        return channel

    server = WeightServer(sender, connect, export_dir=tmp_path / "weights", write=write).start()
    deadline = time.monotonic() + 30
    while len(channel.answers) < n and time.monotonic() < deadline:
        time.sleep(0.02)
    server.stop()
    return channel


def test_the_weight_server_answers_exports_and_refuses_what_it_cannot_serve(tmp_path: Path) -> None:
    sender = WeightSender(address="127.0.0.1", timeout_s=1.0)
    early = serve([Request("broadcast", 1, world_size=2)], sender, tmp_path / "a", 1)
    assert "no weights to send yet" in early.answers[0][1]["error"]

    sd = weights(3)
    sender.set_weights(4, sd)
    channel = serve([Request("export", 4), Request("broadcast", 7, world_size=2)], sender, tmp_path / "b", 2)
    (_, exported), (_, newer) = channel.answers
    assert exported == {"path": str(tmp_path / "b" / "weights" / "v4"), "version": 4}
    saved = torch.load(Path(exported["path"]) / "weights.pt")
    assert all(torch.equal(saved[k], v) for k, v in sd.items())
    assert "has v4, not v7" in newer["error"]


# another process (no SGLang: plain pickle, as SGLang's SafeUnpickler does it) maps each payload and prints sums
RECEIVER = """
import base64, json, pickle, sys
import torch
out = []
for payload in sys.argv[1:]:
    named = pickle.loads(base64.b64decode(payload))
    out.append({name: [str(t.dtype), t.double().sum().item()] for name, t in named})
    del named  # the reference count lives in the file: a process that exits holding a mapping leaves it counted
print(json.dumps(out))
"""


def shm_files(sender: WeightSender) -> list[Path]:
    return [Path("/dev/shm") / f.untyped_storage()._share_filename_cpu_()[1].decode().lstrip("/")
            for f in sender._current().flat]


def test_a_tensor_offer_names_shared_memory_another_process_maps_and_frees_it_when_all_let_go() -> None:
    sd = weights(5)
    sender = WeightSender(address="127.0.0.1", bucket_bytes=1200, shared_memory=True)
    sender.set_weights(2, sd, torch.bfloat16)
    files = shm_files(sender)
    assert len(files) > 1 and all(f.is_file() for f in files)
    offer = sender.tensor_offer(2)
    assert (offer.version, offer.host, len(offer.payloads)) == (2, host_id(), 2)
    assert all(len(p) < 20_000 for p in offer.payloads)  # handles, not the 4 KB of weights... nor a pickle of them
    done = subprocess.run([sys.executable, "-c", RECEIVER, *offer.payloads], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    _, snapshot = sender.snapshot()
    want = {k: [str(v.dtype), v.double().sum().item()] for k, v in snapshot.items()}
    assert json.loads(done.stdout) == [want, want]
    assert want["norm"][0] == "torch.bfloat16" and want["steps"][0] == "torch.int64"

    del snapshot
    sender.set_weights(3, sd)  # the offered snapshot is dropped; each payload's reference was given back
    assert not any(f.exists() for f in files)


def test_shared_memory_without_the_room_is_refused_before_any_byte_is_written(tmp_path: Path) -> None:
    with pytest.raises(WeightSyncError, match=r"MiB free, a weight snapshot needs .*--shm-size"):
        shared_bytes(1 << 60)
    with pytest.raises(WeightSyncError, match="shared memory is not available here"):
        shared_bytes(1, shm_dir=str(tmp_path / "absent"))


def test_a_tensor_offer_needs_shared_memory_and_a_server() -> None:
    private = WeightSender(address="127.0.0.1")
    private.set_weights(1, weights(1))
    with pytest.raises(WeightSyncError, match="private memory"):
        private.tensor_offer(1)
    shared = WeightSender(address="127.0.0.1", shared_memory=True)
    with pytest.raises(WeightSyncError, match="no weights to send yet"):
        shared.tensor_offer(1)
    shared.set_weights(1, weights(1))
    with pytest.raises(WeightSyncError, match="at least one server"):
        shared.tensor_offer(0)


def test_the_weight_server_answers_tensor_requests_and_refuses_a_version_it_does_not_have(tmp_path: Path) -> None:
    sender = WeightSender(address="127.0.0.1", timeout_s=1.0, shared_memory=True)
    sender.set_weights(4, weights(3))
    channel = serve([Request("tensor", 4, world_size=3), Request("tensor", 6, world_size=1)], sender, tmp_path, 2)
    (_, offered), (_, newer) = channel.answers
    offer = TensorOffer.from_dict(offered["tensor"])
    assert offer.version == 4 and len(offer.payloads) == 3 and offer.host == host_id()
    assert "has v4, not v6" in newer["error"]


HOLDER = """
import base64, os, pickle, sys, time
import torch
named = pickle.loads(base64.b64decode(sys.argv[1]))  # mapped, as a server keeps it
print(os.getpid(), flush=True)
time.sleep(120)
"""

SENDER = """
import subprocess, sys
from agentrl.trainer.shm import serialize, shared_bytes
t = shared_bytes(1 << 20)
holder = subprocess.Popen([sys.executable, "-c", sys.argv[1], serialize([("w", t[:16])])], stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, start_new_session=True, text=True)
print(holder.stdout.readline().strip(), flush=True)  # the holder's pid, once it has mapped the memory
"""


def test_the_trainers_output_ends_with_it_even_while_a_server_still_maps_its_memory() -> None:
    """torch's shm manager outlives the trainer while a server maps its memory; it must not hold the trainer's
    stdout/stderr (a parent reading them to the end would wait for the server)."""
    done = subprocess.run([sys.executable, "-c", SENDER, HOLDER], capture_output=True, text=True, timeout=100)
    holder = int(done.stdout.split()[0])
    try:
        assert done.returncode == 0, done.stderr
        os.kill(holder, 0)  # still alive (and mapping) when our output ended
    finally:
        os.kill(holder, signal.SIGKILL)
