"""Weight publish + SGLang reload: agentrl's path vs the raw floor.

raw:     safetensors ``save_file`` of the full state dict (+ config) into a folder, then SGLang
         ``/update_weights_from_disk``.
agentrl: ``Trainer.export_hf(durable=False)`` as the trainer worker publishes (FSDP2 full state dict gathered to
         rank 0, atomic HF folder with tokenizer, no fsync: the checkpoint is the durable copy) +
         ``WeightRegistry.publish`` (Redis) + the rollout side's reload (pause → ``/update_weights_from_disk`` →
         continue), as the scheduler does it.
Both against the same SGLang server (CPU), the same model, alternating rounds; figures are medians.
Last line: ``publish_reload_vs_raw=… agentrl_s=… raw_s=…`` (target ≤ 1.5).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from agentrl.engine import SGLangClient, SGLangServer, SGLangServerConfig
from agentrl.models import resolve_model
from agentrl.queue import EmbeddedRedis, WeightRegistry, make_client
from agentrl.trainer import Trainer, TrainerConfig


def raw_save(state: dict, source: Path, target: Path) -> None:
    from safetensors.torch import save_file

    target.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(target / "model.safetensors"))
    shutil.copy2(source / "config.json", target / "config.json")


async def bench(model: str, rounds: int) -> None:
    src = resolve_model(model)
    work = Path(tempfile.mkdtemp(prefix="wsync-"))
    server = SGLangServer(SGLangServerConfig(model_path=str(src)), log_path=work / "sglang.log").start()
    redis = EmbeddedRedis(work / "redis").start()
    trainer = Trainer(TrainerConfig(model=str(src)))
    rc = make_client(redis.url)
    registry = WeightRegistry(rc, "bench")
    client = SGLangClient(server.url)
    from agentrl.trainer.storage import full_state_dict

    raw_t, ours_t = [], []
    try:
        version = 0
        for i in range(rounds):
            version += 1
            t0 = time.perf_counter()
            state = full_state_dict(trainer._policy)  # the same gather the export does
            raw_save(state, src, work / f"raw{i}")
            await client.update_weights(str(work / f"raw{i}"), version)
            raw_t.append(time.perf_counter() - t0)

            version += 1
            t0 = time.perf_counter()
            path = trainer.export_hf(work / f"v{version}", durable=False)
            await registry.publish(version, str(path), step=version, metrics={})
            wv = await registry.wait_for(version, timeout_s=60)
            await client.pause("abort")
            try:
                await client.update_weights(wv.path, wv.version)
            finally:
                await client.resume()
            ours_t.append(time.perf_counter() - t0)
            print(f"round {i}: raw {raw_t[-1]:.3f}s  agentrl {ours_t[-1]:.3f}s", flush=True)
    finally:
        await client.aclose()
        await registry.aclose()
        await rc.aclose()
        trainer.close()
        redis.stop()
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    raw_s, ours_s = statistics.median(raw_t), statistics.median(ours_t)
    print(f"{'path':10s} {'median s':>9s} {'min s':>7s}")
    print(f"{'raw':10s} {raw_s:9.3f} {min(raw_t):7.3f}")
    print(f"{'agentrl':10s} {ours_s:9.3f} {min(ours_t):7.3f}")
    print(f"publish_reload_vs_raw={ours_s / raw_s:.2f} agentrl_s={ours_s:.3f} raw_s={raw_s:.3f} model={model}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    asyncio.run(bench(args.model, args.rounds))


if __name__ == "__main__":
    main()
