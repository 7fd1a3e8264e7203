"""Wiring helpers of the controller: datasets, SFT traces, and the shared resources environments get."""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterator
from contextlib import AsyncExitStack
from pathlib import Path

from agentrl.data import arithmetic
from agentrl.env.registry import EnvResources
from agentrl.errors import ConfigError
from agentrl.launcher.config import RunConfig
from agentrl.rewards import MathVerifier
from agentrl.sandbox import make_sandbox
from agentrl.tokenizer import ChatTokenizer, tokenize_trace
from agentrl.types import Task


def pin_to_cores(cores: list[int]) -> None:
    """Pin every thread of this process (and so every child it starts later) to ``cores``.

    ``os.sched_setaffinity(0, …)`` pins only the calling thread: a Ray actor runs its methods on other threads
    than the one that would call it, and those floated onto the other side's cores (the rollout worker ran
    on the trainer's core in the async benchmark)."""
    wanted = set(cores)
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), wanted)
        except (ProcessLookupError, FileNotFoundError):
            pass  # the thread ended meanwhile


def load_imports(imports: list[str]) -> None:
    """Import user modules (``pkg.module``) or files (``path/to/file.py``) so their decorators register
    environments and tools in this process. Each file is imported once per process."""
    import importlib
    import importlib.util
    import sys

    for ref in imports:
        if ref.endswith(".py"):
            path = Path(ref)
            if not path.exists():
                raise ConfigError(f"imports: {ref} does not exist")
            name = f"agentrl_user_{path.stem}_{abs(hash(str(path.resolve())))}"
            if name in sys.modules:
                continue
            spec = importlib.util.spec_from_file_location(name, path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
        else:
            try:
                importlib.import_module(ref)
            except ImportError as exc:
                raise ConfigError(f"imports: cannot import {ref!r}: {exc}") from exc


def load_jsonl_tasks(path: Path) -> list[Task]:
    """A dataset file: one JSON object per line with ``prompt`` and ``answer`` (``id`` optional)."""
    tasks = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            tasks.append(Task(id=str(d.get("id", f"{path.stem}-{n}")), prompt=str(d["prompt"]),
                              answer=None if d.get("answer") is None else str(d["answer"]),
                              metadata={k: v for k, v in d.items() if k not in ("id", "prompt", "answer")}))
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"{path}:{n}: expected a JSON object with 'prompt' and 'answer': {exc}") from exc
    if not tasks:
        raise ConfigError(f"{path} holds no tasks")
    return tasks


def tasks_from(source: str, *, seed: int) -> Iterator[Task]:
    """An endless task stream: a problem family of :mod:`agentrl.data.arithmetic` or a shuffled .jsonl file."""
    if source in arithmetic.FAMILIES:
        return arithmetic.task_stream(source, seed=seed)
    path = Path(source)
    if path.suffix == ".jsonl" and path.exists():
        tasks = load_jsonl_tasks(path)

        def cycle() -> Iterator[Task]:
            rng = random.Random(seed)
            epoch = 0
            while True:
                order = list(tasks)
                rng.shuffle(order)
                for t in order:
                    yield Task(id=f"{t.id}@{epoch}", prompt=t.prompt, answer=t.answer, metadata=t.metadata)
                epoch += 1

        return cycle()
    raise ConfigError(f"unknown dataset {source!r}: expected one of {sorted(arithmetic.FAMILIES)} or a .jsonl file")


def sft_traces_file(cfg: RunConfig, tok: ChatTokenizer, out: Path) -> Path:
    """Write ReTool-style cold-start traces (token ids + loss mask per line) for the trainer's SFT phase."""
    from agentrl.env.retool import SYSTEM_PROMPT

    system = cfg.env.options.get("system_prompt", SYSTEM_PROMPT)
    with open(out, "w") as f:
        for p in arithmetic.problems(cfg.sft.family, cfg.sft.num_traces, seed=cfg.seed + 1):
            messages = [{"role": "system", "content": system}, {"role": "user", "content": p.task.prompt}]
            ids, mask = tokenize_trace(tok, messages, arithmetic.retool_trace_parts(p))
            f.write(json.dumps({"token_ids": ids, "loss_mask": mask}) + "\n")
    return out


async def make_env_resources(cfg: RunConfig, stack: AsyncExitStack) -> EnvResources:
    """The sandbox and the reward workers, shared by every episode of this process; closed with ``stack``."""
    s = cfg.sandbox
    opts = dict(s.options)
    if s.backend == "remote":
        if not s.url:
            raise ConfigError("sandbox.backend 'remote' needs sandbox.url")
        opts["url"] = s.url
    sandbox = make_sandbox(s.backend, max_concurrency=s.max_concurrency, **opts)
    stack.push_async_callback(sandbox.aclose)
    verifier = MathVerifier(workers=1)
    await verifier.start()
    stack.push_async_callback(verifier.aclose)
    return EnvResources(sandbox=sandbox, verifier=verifier)
