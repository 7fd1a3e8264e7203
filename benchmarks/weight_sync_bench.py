"""Weight publish + SGLang reload: the three weight_sync transports vs the raw floor, on one real SGLang server (CPU).

raw:          the FSDP2 full state dict gathered to rank 0, safetensors ``save_file`` into a folder (+ config), then
              SGLang ``/update_weights_from_disk``.
disk:         ``weight_sync: disk`` as a run does it: ``Trainer.export_hf(durable=False)`` (atomic HF folder with
              tokenizer, no fsync) + ``WeightRegistry.publish`` (Redis) + the rollout side's reload (pause →
              ``/update_weights_from_disk`` → continue).
distributed:  ``weight_sync: distributed`` as a run does it: the same gather, cast to the engine's dtype and held by
              the trainer's weight server (a thread answering Redis requests) + publish; the rollout side asks for an
              offer, the server joins a gloo group with the trainer and receives the buckets
              (pause → begin → init group → buckets → end → continue). No file is written.
tensor:       ``weight_sync: tensor`` as a run does it: the same gather and cast, into shared memory (/dev/shm) held
              by a second weight server; the rollout side asks for its names and the server loads from that memory
              (pause → begin → update_weights_from_tensor → end → continue). No file, no socket carries weights.

Each round runs every path once, in an order rotated from round to round, after an untimed warm-up round; the
per-round ratios are reported with their median and range, for the whole (publish + reload) and for the reload
alone (pause to resume: the window in which the servers generate nothing; the publish runs while they do). Last
line: ``distributed_vs_disk=… tensor_vs_disk=… reload_distributed_vs_disk=… reload_tensor_vs_disk=…
publish_reload_vs_raw=… disk_s=… distributed_s=… tensor_s=… raw_s=… model=… dtype=… cpu=… cores=… load=… commit=…
torch=… sglang=…`` (``load``: the 1-minute load average at the start and the end; targets: distributed ≤ 1 and
tensor ≤ 1 — at least as fast as disk —, publish_reload_vs_raw ≤ 1.5).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from agentrl.engine import SGLangClient, SGLangServer, SGLangServerConfig
from agentrl.engine.weight_sync import Broadcast, Tensors
from agentrl.hardware import engine_dtype
from agentrl.models import resolve_model
from agentrl.queue import EmbeddedRedis, WeightRegistry, make_client
from agentrl.queue.weight_sync import SyncChannel
from agentrl.trainer import Trainer, TrainerConfig
from agentrl.trainer.weight_sync import WeightSender, WeightServer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def raw_save(state: dict, source: Path, target: Path) -> None:
    from safetensors.torch import save_file

    target.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(target / "model.safetensors"))
    shutil.copy2(source / "config.json", target / "config.json")


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration, subprocess.SubprocessError):
        return platform.processor() or "unknown"


def versions() -> str:
    import sglang

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                                cwd=Path(__file__).parent).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        commit = "unknown"
    return f"commit={commit} torch={torch.__version__} sglang={sglang.__version__}"


def ratios(times: dict[str, list[float]], num: str, den: str) -> list[float]:
    return [a / b for a, b in zip(times[num], times[den])]


async def bench(model: str, rounds: int, bucket_mb: float) -> None:
    load0 = os.getloadavg()[0]
    src = resolve_model(model)
    work = Path(tempfile.mkdtemp(prefix="wsync-"))
    dtype = engine_dtype("auto", "cpu")
    server = SGLangServer(SGLangServerConfig(model_path=str(src), dtype=dtype), log_path=work / "sglang.log").start()
    redis = EmbeddedRedis(work / "redis").start()
    trainer = Trainer(TrainerConfig(model=str(src), dtype="fp32"))
    rc = make_client(redis.url)
    registry = WeightRegistry(rc, "bench")
    channel, shm_channel = SyncChannel(rc, "bench"), SyncChannel(rc, "bench-shm")
    sender = WeightSender(address="127.0.0.1", bucket_bytes=int(bucket_mb * 2**20), timeout_s=120)
    shm_sender = WeightSender(address="127.0.0.1", bucket_bytes=int(bucket_mb * 2**20), timeout_s=120,
                              shared_memory=True)

    def serve(s: WeightSender, namespace: str) -> WeightServer:
        async def connect() -> SyncChannel:
            return SyncChannel.connect(redis.url, namespace)

        return WeightServer(s, connect, export_dir=work / "exported",
                            write=lambda sd, p: trainer.write_hf(dict(sd), p)).start()

    weight_servers = [serve(sender, "bench"), serve(shm_sender, "bench-shm")]
    client = SGLangClient(server.url)
    cast = DTYPES.get(dtype)
    times: dict[str, list[float]] = {"raw": [], "disk": [], "distributed": [], "tensor": []}
    version = 0

    async def raw(i: int) -> None:
        raw_save(trainer.full_state_dict(), src, work / f"raw{i}")
        await client.update_weights(str(work / f"raw{i}"), version)

    async def disk(i: int) -> None:
        path = trainer.export_hf(work / f"v{version}", durable=False)
        await registry.publish(version, str(path), step=version, metrics={})
        wv = await registry.wait_for(version, timeout_s=60)
        paused.append(time.perf_counter())
        await client.pause("abort")
        try:
            await client.update_weights(wv.path, wv.version)
        finally:
            await client.resume()

    async def in_memory(snd: WeightSender, transport: str, prefix: str,
                        source: Callable[[int], Broadcast]) -> None:
        """Publish through ``snd``, then pause the server, load ``source(version)`` into it and resume."""
        sd = trainer.full_state_dict()
        snd.set_weights(version, sd, cast)
        await registry.publish(version, str(work / f"{prefix}{version}"), step=version, metrics={},
                               transport=transport)
        wv = await registry.wait_for(version, timeout_s=60)
        paused.append(time.perf_counter())
        await client.pause("abort")
        try:
            [failure] = await source(wv.version).load([client])
            if failure is not None:
                raise failure
        finally:
            await client.resume()
        assert await client.weight_version() == version

    async def distributed(i: int) -> None:
        await in_memory(sender, "distributed", "d", lambda v: Broadcast(
            v, lambda n: channel.offer(v, world_size=n, timeout_s=60)))

    async def tensor(i: int) -> None:
        await in_memory(shm_sender, "tensor", "t", lambda v: Tensors(
            v, lambda n: shm_channel.tensors(v, servers=n, timeout_s=60)))

    paths = {"raw": raw, "disk": disk, "distributed": distributed, "tensor": tensor}
    paused: list[float] = []  # when each path's reload began (the rest of its time is the trainer's publish)
    reload: dict[str, list[float]] = {k: [] for k in paths if k != "raw"}
    names = list(paths)
    try:
        for i in range(-1, rounds):  # round -1: warm-up, not timed
            for name in names[i % len(names):] + names[:i % len(names)]:  # rotated: no path always goes first
                version += 1
                t0 = time.perf_counter()
                await paths[name](i)
                if i >= 0:
                    times[name].append(time.perf_counter() - t0)
                    if name in reload:
                        reload[name].append(time.perf_counter() - paused[-1])
                for old in work.glob(f"{'raw' if name == 'raw' else 'v'}*"):
                    shutil.rmtree(old, ignore_errors=True)
            if i >= 0:
                print(f"round {i}: " + "  ".join(f"{k} {v[-1]:.3f}s" for k, v in times.items()), flush=True)
    finally:
        for ws in weight_servers:
            ws.stop()
        await client.aclose()
        await registry.aclose()
        await rc.aclose()
        trainer.close()
        redis.stop()
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    load1 = os.getloadavg()[0]
    per = {"distributed/disk": ratios(times, "distributed", "disk"), "tensor/disk": ratios(times, "tensor", "disk"),
           "disk/raw": ratios(times, "disk", "raw")}
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{'path':12s} {'median s':>9s} {'min s':>7s} {'max s':>7s}")
    for k, v in times.items():
        print(f"{k:12s} {med[k]:9.3f} {min(v):7.3f} {max(v):7.3f}")
    for k, v in reload.items():
        print(f"{k + ' reload':12s} {statistics.median(v):9.3f} {min(v):7.3f} {max(v):7.3f}  (pause to resume)")
    per["tensor/disk reload"] = [a / b for a, b in zip(reload["tensor"], reload["disk"])]
    per["distributed/disk reload"] = [a / b for a, b in zip(reload["distributed"], reload["disk"])]
    print("per round: " + "; ".join(f"{k} median {statistics.median(v):.2f} range {min(v):.2f}-{max(v):.2f}"
                                    for k, v in per.items()))
    print(f"distributed_vs_disk={statistics.median(per['distributed/disk']):.2f} "
          f"tensor_vs_disk={statistics.median(per['tensor/disk']):.2f} "
          f"reload_distributed_vs_disk={statistics.median(per['distributed/disk reload']):.2f} "
          f"reload_tensor_vs_disk={statistics.median(per['tensor/disk reload']):.2f} "
          f"publish_reload_vs_raw={statistics.median(per['disk/raw']):.2f} disk_s={med['disk']:.3f} "
          f"distributed_s={med['distributed']:.3f} tensor_s={med['tensor']:.3f} raw_s={med['raw']:.3f} model={model} "
          f"dtype={dtype} bucket_mb={bucket_mb:g} rounds={rounds} cpu={cpu_name().replace(' ', '_')} "
          f"cores={os.cpu_count()} load={load0:.1f}/{load1:.1f} {versions()}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--bucket-mb", type=float, default=512.0)
    args = ap.parse_args()
    asyncio.run(bench(args.model, args.rounds, args.bucket_mb))


if __name__ == "__main__":
    main()
