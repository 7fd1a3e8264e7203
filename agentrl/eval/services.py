"""What the evaluations of one process share, wired in one place: the sandbox, the math-checker pool, the
model servers and the global episode limit.

    async with EvalServices.create(sandbox=SandboxConfig(backend="local"), max_episodes=16) as services:
        result = await services.evaluate(spec)          # or with tasks=, completed=, on_record=, cancel=

:func:`evaluate` does the same for one evaluation (what ``agentrl eval CONFIG.yaml`` runs locally).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any, Self

from agentrl.engine.server import SGLangServerConfig
from agentrl.env.registry import EnvResources, Registry, default_registry
from agentrl.eval.base import EvalResult, RecordCallback, SampleRecord, SpecError
from agentrl.eval.catalog import DatasetCatalog
from agentrl.eval.datasets import DatasetFactory, builtin_datasets, resolve_tasks
from agentrl.eval.engines import Launcher, ModelServers, check_model, resolve_model_spec
from agentrl.eval.runner import check_environment, run_eval
from agentrl.eval.spec import MAX_SAMPLES, EvalSpec
from agentrl.rewards.config import RewardsConfig
from agentrl.sandbox.config import SandboxConfig
from agentrl.types import Task


class EvalServices:
    """Shared, long-lived resources of evaluations (see the module docstring). Close with ``aclose``."""

    def __init__(self, *, resources: EnvResources, engines: ModelServers, max_episodes: int = 16,
                 runs_dir: Path = Path("runs"), dataset_dirs: Sequence[Path] | None = None,
                 registry: Registry = default_registry, datasets: dict[str, DatasetFactory] | None = None,
                 stack: AsyncExitStack | None = None) -> None:
        self.resources = resources
        self.engines = engines
        self.limiter = asyncio.Semaphore(max_episodes)
        self.runs_dir = runs_dir
        self.dataset_dirs = dataset_dirs
        self.registry = registry
        self.datasets = builtin_datasets() if datasets is None else datasets
        #: named datasets: files under ``dataset_dirs``, ``agentrl.datasets`` plugins, ``datasets``
        self.catalog = DatasetCatalog(dataset_dirs or (), builtins=self.datasets)
        self._stack = stack or AsyncExitStack()

    @classmethod
    async def create(cls, *, sandbox: SandboxConfig | None = None, rewards: RewardsConfig | None = None,
                     max_servers: int = 1, max_inflight: int = 64, max_episodes: int = 16,
                     server_config: SGLangServerConfig | None = None,
                     log_dir: Path | None = None, launcher: Launcher | None = None, runs_dir: Path = Path("runs"),
                     dataset_dirs: Sequence[Path] | None = None,
                     registry: Registry = default_registry) -> EvalServices:
        """Build the services; the sandbox and the checker processes start lazily, on first use."""
        stack = AsyncExitStack()
        try:
            box = (sandbox or SandboxConfig()).build()
            stack.push_async_callback(box.aclose)
            verifier = (rewards or RewardsConfig()).math_verifier()
            stack.push_async_callback(verifier.aclose)
            engines = ModelServers(max_servers=max_servers, max_inflight=max_inflight, server_config=server_config,
                                 log_dir=log_dir, launcher=launcher)
            stack.push_async_callback(engines.aclose)
        except BaseException:
            await stack.aclose()
            raise
        return cls(resources=EnvResources(sandbox=box, verifier=verifier), engines=engines,
                   max_episodes=max_episodes, runs_dir=runs_dir, dataset_dirs=dataset_dirs, registry=registry,
                   stack=stack)

    async def prepare(self, spec: EvalSpec) -> list[Task]:
        """Check a spec against this process (environment, model, dataset) and load its tasks.
        Raises :class:`agentrl.eval.SpecError` (or its subclass for an unknown environment)."""
        return (await self.resolve(spec))[1]

    async def resolve(self, spec: EvalSpec) -> tuple[EvalSpec, list[Task]]:
        """:meth:`prepare`, and the spec with its dataset's ``version`` and ``sha256`` filled in (what a task
        records: see :mod:`agentrl.eval.catalog`)."""
        await check_environment(spec, self.resources, self.registry)
        check_model(spec.model, runs_dir=self.runs_dir)
        # off the event loop: files are read and hashed (inline items are hashed too: cheap, but not free)
        tasks, dataset = await asyncio.to_thread(resolve_tasks, spec.dataset, allowed_dirs=self.dataset_dirs,
                                                 catalog=self.catalog)
        if len(tasks) * spec.samples_per_item > MAX_SAMPLES:
            raise SpecError(("dataset",), f"{len(tasks)} items x {spec.samples_per_item} samples is over the limit "
                            f"of {MAX_SAMPLES} episodes: use 'limit' or split the evaluation")
        return spec.model_copy(update={"dataset": dataset}), tasks

    async def evaluate(self, spec: EvalSpec, *, tasks: Sequence[Task] | None = None,
                       completed: Iterable[SampleRecord] = (), on_record: RecordCallback | None = None,
                       cancel: asyncio.Event | None = None, keep_records: bool = True,
                       id_prefix: str = "eval-") -> EvalResult:
        """Run one evaluation on a leased engine (see :func:`agentrl.eval.run_eval` for the arguments)."""
        if tasks is None:
            tasks = await self.prepare(spec)
        model = await asyncio.to_thread(resolve_model_spec, spec.model, runs_dir=self.runs_dir)
        async with self.engines.lease(model) as lease:
            return await run_eval(spec, engine=lease.engine, tokenizer=lease.tokenizer, resources=self.resources,
                                  tasks=tasks, completed=completed, on_record=on_record, cancel=cancel,
                                  limiter=self.limiter, registry=self.registry, keep_records=keep_records,
                                  id_prefix=id_prefix)

    async def aclose(self) -> None:
        await self._stack.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


async def evaluate(spec: EvalSpec, *, on_record: RecordCallback | None = None, **options: Any) -> EvalResult:
    """Run one evaluation with its own services (``options`` go to :meth:`EvalServices.create`)."""
    async with await EvalServices.create(**options) as services:
        return await services.evaluate(spec, on_record=on_record)
