"""The rollout process of a run, as one object the controller places (a Ray actor, or in debug mode a plain
object in the controller's own event loop).

It owns the SGLang server, the sandbox, the math-checker pool, and the producer ends of the queue and registry;
it runs the :class:`RolloutScheduler` and the held-out evaluations. Trajectories leave it only through Redis;
weights reach it through the registry (from ``weights/`` with ``weight_sync: disk``, by broadcast with
``distributed``); what the controller needs (stats, progress, held-out records) is returned by its methods, which
on Ray are calls across nodes. Its files (``logs/``, ``rollouts.jsonl``, the process ledger) are its node's own:
on a cluster they stay in that node's copy of the run directory.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

from agentrl.async_rollout import EpisodeRunner, RolloutScheduler, SkipSolved
from agentrl.async_rollout.agent_episode import AgentRunner
from agentrl.engine import EnginePool, SGLangClient, SGLangServer, pool_configs
from agentrl.engine.recording import RecordingEngine
from agentrl.engine.router import SGLangRouter
from agentrl.engine.weight_sync import Broadcast, FromDisk, Tensors
from agentrl.env import default_registry
from agentrl.env.registry import EnvResources, load_imports
from agentrl.gateway import GatewayConfig, LocalGateway
from agentrl.launcher.colocation import MemoryHandover, hands_over_memory, process_cores
from agentrl.launcher.config import RunConfig
from agentrl.launcher.cores import IdleBeacon, idle_key, pin_to_cores
from agentrl.launcher.heldout import heldout_eval
from agentrl.launcher.ledger import record_process
from agentrl.launcher.memory import MemorySampler
from agentrl.launcher.protocol import queue_capacity, registry_namespace, stream_name
from agentrl.launcher.resources import heldout_tasks, make_env_resources, tasks_from
from agentrl.models import resolve_model
from agentrl.queue import TrajectoryQueue, WeightRegistry, WeightVersion, connect_redis
from agentrl.queue.weight_sync import SyncChannel
from agentrl.tokenizer import ChatTokenizer
from agentrl.types import Trajectory

logger = logging.getLogger(__name__)


def _pid_reader(server: SGLangServer) -> Callable[[], int | None]:
    """The server's current pid, read at every memory sample (a restarted server has a new one)."""
    return lambda: server.pid


class RolloutLog:
    """Appends every queued trajectory to ``rollouts.jsonl``: in full (token arrays included) or a summary."""

    def __init__(self, path: Path, mode: str) -> None:
        self.path = path
        self.full = mode == "full"

    async def __call__(self, group: list[Trajectory]) -> None:
        with open(self.path, "a") as f:
            for t in group:
                if self.full:
                    record = t.to_dict()
                else:
                    record = {"trajectory_id": t.trajectory_id, "group_id": t.group_id, "reward": t.reward,
                              "finish_reason": t.finish_reason.value, "num_tokens": t.num_tokens,
                              "model_tokens": t.num_model_tokens, "versions": sorted(set(t.generated_versions)),
                              "turns": [{"text": u.text, "tools": [r.status for r in u.tool_results]}
                                        for u in t.turns]}
                f.write(json.dumps(record) + "\n")


class WeightHold:
    """The registry as the rollout scheduler follows it, with loads held back while an evaluation must finish on
    the weights it started with (the ``sft`` evaluation beside RL's first rollouts: the controller takes the hold
    before it starts either, the evaluation releases it when it ends). The scheduler waits here before it pauses
    the engine, so the held evaluation keeps generating; once released it gets the newest version (one published
    before may have been pruned meanwhile)."""

    def __init__(self, registry: Any) -> None:
        self.registry = registry
        self._holders = 0
        self._free = asyncio.Event()
        self._free.set()

    @property
    def held(self) -> bool:
        return self._holders > 0

    def take(self) -> None:
        self._holders += 1
        self._free.clear()

    def release(self) -> None:
        if self._holders == 0:
            raise RuntimeError("released a weight hold nobody took")
        self._holders -= 1
        if self._holders == 0:
            self._free.set()

    async def wait_for(self, version: int, *, timeout_s: float) -> WeightVersion:
        """The registry's ``wait_for``, answered once no evaluation holds the weights (an evaluation is bounded by
        its requests' deadlines, so this wait is too)."""
        wv = await self.registry.wait_for(version, timeout_s=timeout_s)
        if not self.held:
            return wv
        logger.info("weight version %d waits for the held-out evaluation on the served weights", wv.version)
        await self._free.wait()
        return await self.registry.wait_for(version, timeout_s=timeout_s)


class RolloutWorker:
    def __init__(self, cfg: RunConfig, run_dir: Path, redis_url: str, *, memory: MemorySampler | None = None) -> None:
        """``memory``: the sampler of the process this worker runs in, when it has one (debug mode: the
        controller's); without it the worker samples its own process (a Ray actor's) and reports it from
        :meth:`memory_report`."""
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.redis_url = redis_url
        self._stack = AsyncExitStack()
        self.client: EnginePool | None = None
        self.engine: Any = None
        self.resources: EnvResources | None = None
        self.scheduler: RolloutScheduler | None = None
        self.gateway: LocalGateway | None = None  # for agent environments
        self._servers: list[SGLangServer] = []  # the servers started here (none with engine.url)
        self._own_memory = memory is None
        self.memory = memory or MemorySampler()
        self._busy = 0  # held-out evaluations and weight loads running (groups are the scheduler's count)
        self._beacon: IdleBeacon | None = None  # resources.trainer_borrows_idle_cores
        self.weights: WeightHold | None = None  # the registry as the scheduler follows it

    async def start(self) -> str:
        """Start everything the rollout side needs; returns the engine URL."""
        cfg, stack = self.cfg, self._stack
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)  # this node's own, on a cluster
        load_imports(cfg.imports)  # user environments register in this process too
        if cfg.resources.rollout_cores is not None:
            pin_to_cores(cfg.resources.rollout_cores)  # SGLang and the sandboxes inherit it
        if self._own_memory:
            self.memory.watch("rollout", os.getpid())
            self.memory.start()
            stack.callback(self.memory.stop)
        base_model = resolve_model(cfg.model)
        self.tok = ChatTokenizer.from_pretrained(base_model)
        handle = await connect_redis(self.redis_url)
        stack.push_async_callback(handle.aclose)
        if cfg.engine.url:
            members: list[Any] = cfg.engine.urls
        else:
            members = await self._start_servers(base_model)
        self.client = self._pool(members)  # restarted servers are recorded by their on_spawn
        self.client.start()
        stack.push_async_callback(self.client.aclose)  # also stops the servers it restarted
        url = ",".join(self.client.urls)
        self.engine = self.client
        if cfg.engine.record_requests:
            self.engine = RecordingEngine(self.client, self.run_dir / "engine_requests.jsonl")
            stack.push_async_callback(self.engine.aclose)
        agent = default_registry.get_env(cfg.env.name).kind == "agent"
        per_sample = cfg.rollout.budget.max_branches if agent else 1
        self.queue = TrajectoryQueue(handle.client, stream_name(cfg.name),
                                     capacity=queue_capacity(cfg, per_sample=per_sample))
        stack.push_async_callback(self.queue.aclose)
        self.registry = WeightRegistry(handle.client, registry_namespace(cfg.name))
        stack.push_async_callback(self.registry.aclose)
        self.weights = WeightHold(self.registry)
        self.channel = SyncChannel(handle.client, registry_namespace(cfg.name))  # weight_sync: distributed/tensor
        self.resources = await make_env_resources(cfg, stack)
        for server in self._servers:  # each server's whole tree (launcher, scheduler, detokenizer, …), then the rest
            self.memory.watch(server.name, _pid_reader(server), tree=True)
        self.memory.watch("rollout_subprocesses", os.getpid(), tree=True)  # sandboxes, checker pool, router
        if agent:  # agent episodes talk to the engine through the gateway, served here once for all of them
            self.gateway = LocalGateway(self.engine, self.tok, self._gateway_config())
            await self.gateway.start()
            stack.push_async_callback(self.gateway.aclose)
        await self.client.set_weight_version(-1 if cfg.sft.enabled else 0)
        if cfg.resources.trainer_borrows_idle_cores is True:  # resolved by the placement: lend our idle cores
            self._beacon = IdleBeacon(handle.client, idle_key(cfg.name), self._is_busy, self._served)
            self._beacon.start()
            stack.push_async_callback(self._beacon.aclose)
        return url

    def _served(self) -> int:
        """The version the staleness gate admits groups for (-1 before RL starts): set after a loaded version is
        resumed, so a rollout side between loading a version and generating with it does not look up to date."""
        return self.scheduler.gate.version if self.scheduler is not None else -1

    def _is_busy(self) -> bool:
        """Busy unless nothing runs and the gate admits nothing more (the rollout side waits for the trainer's next
        version, or has produced everything)."""
        s = self.scheduler
        if self._busy > 0 or s is None:
            return self._busy > 0
        g = s.gate
        return g.running > 0 or (g.capacity() > 0 and g.started < (s.total_groups or 0))

    @asynccontextmanager
    async def _working(self) -> AsyncIterator[None]:
        """Work outside the scheduler's groups (an evaluation, a weight load): the rollout side is busy meanwhile."""
        self._busy += 1
        self._poke()
        try:
            yield
        finally:
            self._busy -= 1
            self._poke()

    def _poke(self) -> None:
        if self._beacon is not None:
            self._beacon.poke()

    def _pool(self, members: list[Any]) -> EnginePool:
        """``members`` (servers started here, or URLs) behind one pool, with ``engine:``'s pool settings and client
        deadlines."""
        e = self.cfg.engine
        router = None
        if e.router:  # sglang-router in front: generation through its policy, control to each server directly
            urls = [m if isinstance(m, str) else m.url for m in members]
            proc = SGLangRouter(urls, policy=e.router_policy, python=e.server.python,
                                log_path=self.run_dir / "logs" / "sglang-router.log").start()
            self._stack.callback(proc.stop)
            record_process(self.run_dir, proc.name, proc.pid or 0)
            router = proc.url
        return EnginePool(members, config=e.pool, client_factory=partial(SGLangClient, timeouts=e.timeouts),
                          router=router)

    async def _start_servers(self, model: Path) -> list[SGLangServer]:
        """``engine.num_servers`` SGLang servers, started side by side (on GPU each on its own devices)."""
        e = self.cfg.engine
        base = e.server.model_copy(update={"model_path": str(model)})
        configs = pool_configs(base, e.num_servers)
        servers = []
        for i, config in enumerate(configs):
            name = "sglang" if len(configs) == 1 else f"sglang-{i}"
            server = SGLangServer(config, name=name, log_path=self.run_dir / "logs" / f"{name}.log",
                                  on_spawn=self._record_spawn, port_chosen=not base.port or len(configs) > 1)
            self._stack.callback(server.stop)
            await asyncio.to_thread(server.prepare)  # a first CPU kernel build (~10 s) off the event loop
            server.start_background()
            servers.append(server)
        await asyncio.gather(*(s.wait_ready_async() for s in servers))
        self._servers = servers
        logger.info("sglang ready on %s", ", ".join(s.url for s in servers))
        return servers

    def _gateway_config(self) -> GatewayConfig:
        """``gateway:``, with the run's model as the served name and the agent environment's tool parser (each
        session's resumes are the episode budget's: :meth:`SessionLimits.for_episode`)."""
        env = self._make_env()
        return self.cfg.gateway.config.model_copy(update={"model_name": self.cfg.model,
                                                          "tool_parser": env.tool_parser})

    def _runner(self) -> EpisodeRunner | AgentRunner:
        r = self.cfg.rollout
        if self.gateway is not None:
            return AgentRunner(self.gateway, self.tok, r.sampling, r.budget)
        return EpisodeRunner(self.engine, self.tok, r.sampling, r.budget, share_prefill=self._shares_prefill())

    def _shares_prefill(self) -> bool:
        """Whether a group's first prompt is prefilled once for its samples (:class:`SharedPrefill`): groups of
        several samples whose requests reach the server that holds the prefill. The pool's own routing is sticky to
        the group's key, and so is, in effect, a ``cache_aware`` router (it sends a prompt where its prefix is
        cached); ``round_robin``, ``random`` and ``power_of_two`` spread a group's samples over the servers, where
        the prefill would be one more request on one of them (when there is more than one)."""
        e = self.cfg.engine
        if self.cfg.rollout.scheduler.n_samples < 2:
            return False
        servers = len(e.urls) if e.url else e.num_servers
        if e.router and e.router_policy != "cache_aware" and servers > 1:
            logger.info("groups' prompts are not prefilled once: the sglang-router's policy %s does not send a "
                        "group's samples to the server holding the prefill (cache_aware does)", e.router_policy)
            return False
        return True

    def _record_spawn(self, server: SGLangServer) -> None:
        if server.pid is not None:  # on_spawn comes after the spawn: always set
            record_process(self.run_dir, server.name, server.pid)

    def _make_env(self) -> Any:
        assert self.resources is not None, "start() first"
        return default_registry.make_env(self.cfg.env.name, self.resources, **self.cfg.env.options)

    async def load_version(self, version: int, timeout_s: float = 3600.0) -> int:
        """Wait for ``version`` in the registry and load it into the engine (no-op if it is the base model)."""
        return await self.load_weights(await self.registry.wait_for(version, timeout_s=timeout_s))

    async def wait_for_version(self, version: int, timeout_s: float = 3600.0) -> int:
        """Wait until ``version`` is published (without loading it); returns the version published."""
        return (await self.registry.wait_for(version, timeout_s=timeout_s)).version

    async def load_weights(self, wv: WeightVersion) -> int:
        """Bring the servers to the published version ``wv`` by its transport; returns the version they serve."""
        async with self._working():
            return await self._load_weights(wv)

    async def _load_weights(self, wv: WeightVersion) -> int:
        assert self.client is not None
        if wv.transport == "base" or (wv.transport == "disk"
                                      and Path(wv.path).resolve() == resolve_model(self.cfg.model).resolve()):
            await self.client.set_weight_version(wv.version)
            return wv.version
        if wv.transport in ("distributed", "tensor"):
            ws, channel, version = self.cfg.weight_sync, self.channel, wv.version
            # the trainer's weight server answers at once unless it is sending another broadcast (≤ timeout_s)
            ask_s = 2 * ws.timeout_s + 30.0

            async def export() -> tuple[str, int]:
                return await channel.export(version, timeout_s=ask_s)

            fallback = export if ws.fallback == "disk" else None
            if wv.transport == "tensor":
                loaded = await self.client.load_weights(Tensors(
                    version, lambda n: channel.tensors(version, servers=n, timeout_s=ask_s), export=fallback,
                    attempts=ws.attempts, timeout_s=ws.timeout_s))
            else:
                loaded = await self.client.load_weights(Broadcast(
                    version, lambda n: channel.offer(version, world_size=n, timeout_s=ask_s), export=fallback,
                    attempts=ws.attempts))
            try:  # the trainer, past its last step, keeps answering until it reads this
                await channel.confirm_loaded(loaded)
            except Exception as exc:  # the load itself succeeded: the trainer stops after its bound instead
                logger.warning("could not confirm loading weights v%d to the trainer: %s", loaded, exc)
            return loaded
        await self.client.update_weights(wv.path, wv.version)
        return wv.version

    async def hold_weights(self) -> None:
        """Load no new version until an evaluation started with ``release_weights`` has ended (:class:`WeightHold`):
        taken by the controller before it starts that evaluation and the rollouts, so neither order can slip."""
        assert self.weights is not None, "start() first"
        self.weights.take()

    async def evaluate_heldout(self, label: str, *, release_weights: bool = False
                               ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """Greedy held-out evaluation on the engine's current weights: the figures and one record per task, which
        the controller writes to ``eval_<label>.jsonl`` (this node may share no directory with it). Its
        ``version`` is the one served at its end. ``release_weights``: release the hold :meth:`hold_weights` took
        (also if it fails), so that all of it ran on the weights served at its start."""
        assert self.resources is not None and self.weights is not None, "start() first"
        try:
            tasks = heldout_tasks(self.cfg)
            logger.info("held-out eval %s starts: %d tasks%s", label, len(tasks),
                        " (weight loads wait for it)" if release_weights else "")
            async with self._working():
                figures, records = await heldout_eval(self.cfg, tasks, engine=self.engine, tokenizer=self.tok,
                                                      resources=self.resources)
                version = await self.client.weight_version() if self.client else None
        finally:
            if release_weights:
                self.weights.release()
        result = {"label": label, "version": version, **figures}
        logger.info("held-out eval %s: %s", label, result)
        return result, records

    async def run(self, total_groups: int, final_version: int) -> dict[str, Any]:
        assert self.client is not None and self.weights is not None, "start() first"
        r = self.cfg.rollout
        d = self.cfg.data
        tasks = tasks_from(d.train, seed=self.cfg.seed, prompt_key=d.prompt_key, answer_key=d.answer_key)
        if r.skip_solved_window:
            tasks = SkipSolved(tasks, window=r.skip_solved_window, threshold=r.skip_solved_rate,
                               keep=r.skip_solved_keep, seed=self.cfg.seed)
        sink: Any = self.queue
        load: Any = self.load_weights
        if hands_over_memory(self.cfg):  # GPU colocated: SGLang frees the GPU for each trainer step
            handover = MemoryHandover(self.client, self.queue, self.load_weights,
                                      groups_per_step=r.scheduler.groups_per_step)
            sink, load = handover, handover.load_weights
        self.scheduler = RolloutScheduler(
            runner=self._runner(), engine=self.client, make_env=self._make_env, env_name=self.cfg.env.name,
            tasks=tasks, sink=sink, weights=self.weights, config=r.scheduler,
            initial_version=await self.client.weight_version(),
            on_group=RolloutLog(self.run_dir / "rollouts.jsonl", self.cfg.log_rollouts)
            if self.cfg.log_rollouts != "none" else None,
            load_weights=load,
        )
        self.scheduler.gate.listeners.append(self._poke)
        stats = await self.scheduler.run(total_groups=total_groups, final_version=final_version)
        return {"trajectories_produced": stats.trajectories_queued, "groups_queued": stats.groups_queued,
                "groups_failed": stats.groups_failed, "groups_filtered": stats.groups_filtered,
                "groups_uniform_queued": stats.groups_uniform_queued,
                "resample_rounds": stats.resample_rounds, "groups_rescued": stats.groups_rescued,
                "groups_resample_denied": stats.groups_resample_denied,
                "groups_dropped_stale": stats.groups_dropped_stale,
                "groups_restarted_stale": stats.groups_restarted_stale,
                "episodes_restarted": stats.episodes_restarted, "staleness_max_queued": stats.staleness_max,
                "engine_restarts": sum(m.restarts for m in self.client.stats()) if self.client else 0,
                "model_tokens": stats.model_tokens, "generated_tokens": stats.generated_tokens,
                "tasks_skipped_solved": tasks.skipped if isinstance(tasks, SkipSolved) else 0,
                "solved_by_version": stats.solved_by_version, "solved_by_key": stats.solved_by_key,
                "groups_untracked_key": stats.groups_untracked_key,
                "versions_loaded": stats.versions_loaded,
                "reload_s_mean": sum(stats.reload_s) / len(stats.reload_s) if stats.reload_s else None}

    async def progress(self) -> dict[str, Any]:
        """A snapshot for live progress: rollout counters, queue depth."""
        s = self.scheduler.stats if self.scheduler is not None else None
        q = await self.queue.stats()
        return {"groups_queued": s.groups_queued if s else 0, "model_tokens": s.model_tokens if s else 0,
                "generated_tokens": s.generated_tokens if s else 0,
                "solved_by_version": dict(s.solved_by_version) if s else {},
                "version": self.scheduler.version if self.scheduler else None,
                "queue_length": q.length, "queue_pending": q.pending}

    async def applied_placement(self) -> dict[str, Any]:
        """The cores this process and each SGLang server it started run on, and the servers' ``OMP_NUM_THREADS``:
        what ``resources.placement`` gave the rollout side, as applied."""
        return {"rollout": process_cores(os.getpid()),
                "engine": [process_cores(s.pid) for s in self._servers if s.pid is not None]}

    async def memory_report(self) -> dict[str, Any] | None:
        """This process's memory figures (:meth:`MemorySampler.report`); None when the process's sampler is
        someone else's (debug mode: the controller reports it)."""
        return self.memory.report() if self._own_memory else None

    async def trainer_finished(self, version: int) -> None:
        """The trainer has ended on ``version``: with a distributed or tensor weight sync a server restarted from
        now on cannot ask it for weights, so it loads the folder the trainer wrote last (``weights/v<version>``)
        if this node can read it. If it cannot (no shared run directory), the log says so: a server restarted now
        stays out of rotation."""
        if self.cfg.weight_sync.mode == "disk" or self.client is None:
            return
        path = self.run_dir / "weights" / f"v{version}"
        if not (path / "config.json").exists():
            logger.warning("the trainer has ended and %s is not readable here: a SGLang server restarted from now "
                           "on cannot get weights v%d", path, version)
            return
        await self.client.retarget(FromDisk(str(path), version))
        logger.info("the trainer has ended: a SGLang server restarted from now on loads v%d from %s", version, path)

    async def queue_length(self) -> int:
        return (await self.queue.stats()).length

    async def weight_version(self) -> int:
        assert self.client is not None
        return await self.client.weight_version()

    async def aclose(self) -> None:
        await self._stack.aclose()

