"""Wiring helpers of the controller: datasets, SFT traces, and the shared resources environments get."""

from __future__ import annotations

import dataclasses
import logging
import random
from collections.abc import Iterator
from contextlib import AsyncExitStack
from pathlib import Path

from agentrl.data import arithmetic
from agentrl.data.loader import FORMATS_TEXT, DatasetError, check_dataset, is_dataset_path, load_task_file
from agentrl.data.sft import SFTDataStats, SFTTrace, check_sft_data, load_sft_traces, truncate, write_traces
from agentrl.env.registry import EnvResources
from agentrl.errors import ConfigError, closest
from agentrl.launcher.config import RunConfig
from agentrl.tokenizer import ChatTokenizer, tokenize_trace
from agentrl.types import Task

logger = logging.getLogger(__name__)


def check_task_source(source: str, *, prompt_key: str, answer_key: str | None, what: str) -> None:
    """Fail fast (before any server starts) unless ``source`` is a problem family of
    :mod:`agentrl.data.arithmetic` or a readable dataset with the keys (first row only). ``what`` names the
    setting in the error, e.g. ``data.train``."""
    if source in arithmetic.FAMILIES:
        return
    if not is_dataset_path(source) and not Path(source).exists():
        close = closest(source, arithmetic.FAMILIES)
        hint = f"; did you mean {close!r}?" if close else ""
        raise ConfigError(f"{what}: {source!r} is neither a problem family ({', '.join(sorted(arithmetic.FAMILIES))}) "
                          f"nor a dataset ({FORMATS_TEXT}){hint}")
    try:
        check_dataset(source, prompt_key=prompt_key, answer_key=answer_key)
    except DatasetError as exc:
        raise DatasetError(f"{what}: {exc.message}", field=exc.field) from None


def check_data(cfg: RunConfig) -> None:
    """Every data source of a run checked cheaply (first rows only), before Ray, Redis or SGLang start:
    ``data.train``, ``data.heldout`` (when evaluated), ``sft.data`` (when SFT runs)."""
    d = cfg.data
    check_task_source(d.train, prompt_key=d.prompt_key, answer_key=d.answer_key, what="data.train")
    if d.num_heldout > 0:
        check_task_source(d.heldout, prompt_key=d.prompt_key, answer_key=d.answer_key, what="data.heldout")
    if cfg.sft.enabled and cfg.sft.steps > 0 and cfg.sft.data is not None:
        try:
            check_sft_data(cfg.sft.data, messages_key=cfg.sft.messages_key)
        except DatasetError as exc:
            raise DatasetError(f"sft.data: {exc.message}", field=exc.field) from None


def tasks_from(source: str, *, seed: int, prompt_key: str = "prompt", answer_key: str | None = "answer",
               what: str = "data.train") -> Iterator[Task]:
    """An endless task stream: a problem family of :mod:`agentrl.data.arithmetic`, or a dataset
    (:mod:`agentrl.data.loader`) reshuffled every epoch; task ids get ``@<epoch>``."""
    if source in arithmetic.FAMILIES:
        return arithmetic.task_stream(source, seed=seed)
    check_task_source(source, prompt_key=prompt_key, answer_key=answer_key, what=what)
    tasks = load_task_file(source, prompt_key=prompt_key, answer_key=answer_key)

    def cycle() -> Iterator[Task]:
        rng = random.Random(seed)
        epoch = 0
        while True:
            order = list(tasks)
            rng.shuffle(order)
            for t in order:
                yield dataclasses.replace(t, id=f"{t.id}@{epoch}")
            epoch += 1

    return cycle()


def heldout_tasks(cfg: RunConfig) -> list[Task]:
    """The held-out tasks: ``num_heldout`` problems of a family (seeded), or the first ``num_heldout`` rows of a
    dataset."""
    d = cfg.data
    if d.heldout in arithmetic.FAMILIES:
        return [p.task for p in arithmetic.problems(d.heldout, d.num_heldout, seed=cfg.seed + 7)]
    check_task_source(d.heldout, prompt_key=d.prompt_key, answer_key=d.answer_key, what="data.heldout")
    return load_task_file(d.heldout, prompt_key=d.prompt_key, answer_key=d.answer_key, limit=d.num_heldout)


def sft_max_tokens(cfg: RunConfig) -> int:
    """``sft.max_tokens``, by default the rollout's context (what the model sees at generation time at most)."""
    return cfg.sft.max_tokens or cfg.rollout.budget.max_context_tokens


def sft_traces_file(cfg: RunConfig, tok: ChatTokenizer, out: Path) -> SFTDataStats:
    """Write the cold-start SFT traces (token ids + loss mask per line) for the trainer's SFT phase: the user's
    ``sft.data`` (conversations or pre-tokenised rows, :mod:`agentrl.data.sft`) or, without it, generated
    ReTool-style arithmetic traces of ``sft.family``. Traces over ``sft.max_tokens`` are cut and counted."""
    max_tokens = sft_max_tokens(cfg)
    if cfg.sft.data is not None:
        traces, stats = load_sft_traces(cfg.sft.data, tok, messages_key=cfg.sft.messages_key, max_tokens=max_tokens)
    else:
        from agentrl.env.retool import SYSTEM_PROMPT

        system = cfg.env.options.get("system_prompt", SYSTEM_PROMPT)
        generated = []
        for p in arithmetic.problems(cfg.sft.family, cfg.sft.num_traces, seed=cfg.seed + 1):
            messages = [{"role": "system", "content": system}, {"role": "user", "content": p.task.prompt}]
            parts = arithmetic.retool_trace_parts(p)
            ids, mask = tokenize_trace(tok, messages, parts)
            generated.append(SFTTrace(ids, mask, sum(len(tok.encode_text(t)) for t, m in parts if not m)))
        traces, stats = truncate(generated, max_tokens, f"arithmetic:{cfg.sft.family}")
    write_traces(traces, out)
    log = logger.warning if stats.truncated else logger.info
    log("sft data %s: %d traces, %d tokens (%d scored, %d interpreter), %d truncated to %d tokens (%d tokens cut)",
        stats.source, stats.traces, stats.tokens, stats.model_tokens, stats.observation_tokens, stats.truncated,
        stats.max_tokens, stats.truncated_tokens)
    return stats


async def make_env_resources(cfg: RunConfig, stack: AsyncExitStack) -> EnvResources:
    """The sandbox and the reward workers, shared by every episode of this process; closed with ``stack``."""
    sandbox = cfg.sandbox.build()
    stack.push_async_callback(sandbox.aclose)
    verifier = cfg.rewards.math_verifier()
    await verifier.start()
    stack.push_async_callback(verifier.aclose)
    return EnvResources(sandbox=sandbox, verifier=verifier)
