"""Where the two processes of a run run: on Ray, or (debug mode, ``resources.ray: false``) inside the controller.

    Ray (default)                                    debug mode
    RolloutActor: a RolloutWorker in its process     the RolloutWorker in the controller's event loop
    TrainerActor × trainer_world_size (restarted     the one trainer rank (world size 1) on a thread of the
      together from the last checkpoint)               controller, with its own event loop; never restarted

Either way the controller gets the same two handles: the rollout worker (``await rollout.start()``; a Ray actor is
called through :class:`RayActor`, which makes ``.remote`` calls of the same names) and a trainer group with
``start`` / ``wait`` / ``kill`` / ``restarts``. Debug mode imports no Ray: ``breakpoint()`` anywhere (rollout,
trainer, environment, reward) stops in the terminal that started the run.

On a cluster (``resources.ray_address``) nothing assumes one node: ``resources.rollout_resources`` /
``trainer_resources`` put each side on the nodes that offer those custom resources; the trainer ranks meet at rank
0's node (its IP and a port free there, asked of the rank-0 actor); each actor logs to its node's ``logs/`` and to
its stderr, which Ray streams to the controller; the SGLang process groups are killed by a task on the rollout
actor's node, whose ledger names them (:mod:`agentrl.launcher.ledger`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import socket
import sys
import threading
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

from agentrl import heap
from agentrl.errors import InfrastructureError, TrainerError
from agentrl.launcher.config import RunConfig
from agentrl.launcher.cores import pin_to_cores
from agentrl.launcher.ledger import kill_recorded
from agentrl.launcher.memory import MemorySampler

logger = logging.getLogger(__name__)


class RolloutDiedError(InfrastructureError):
    """The rollout process (its Ray actor) died mid-run: the run stops, to be continued with ``--resume``."""


async def place(cfg: RunConfig, run_dir: Path, redis_url: str, stack: AsyncExitStack,
                memory: MemorySampler | None = None) -> tuple[Any, Any]:
    """Start the trainer group and create the rollout worker (not started yet) as configured; both are stopped
    with ``stack``. Returns ``(rollout, trainers)``. ``memory``, the controller's sampler, also samples what runs
    in this process (debug mode: the rollout side's servers and children) or, on Ray, Ray's daemons under it (the
    actors sample themselves: :mod:`agentrl.launcher.memory`)."""
    if not cfg.resources.ray:
        from agentrl.launcher.rollout_process import RolloutWorker

        stack.callback(kill_recorded, run_dir)  # the rollout side runs in this process: its ledger is here
        threaded = TrainerThread(cfg, run_dir, redis_url)
        stack.callback(threaded.kill)
        threaded.start()
        return RolloutWorker(cfg, run_dir, redis_url, memory=memory), threaded
    ray = ray_init(cfg)
    r = cfg.resources
    if redis_url.startswith("unix://") and _other_machines(ray):
        logger.warning("the run's Redis listens on a unix socket of this machine (%s): actors placed on the other "
                       "machines of the cluster cannot reach it; set redis.url to a server every node reaches",
                       redis_url)
    rollout_cls, trainer_cls = _actor_classes()
    trainers = TrainerGroup(cfg, run_dir, redis_url, trainer_cls)
    stack.callback(trainers.kill)
    _warn_if_unplaceable(ray, r.rollout_resources, "the rollout actor (resources.rollout_resources)")
    _warn_if_unplaceable(ray, r.trainer_resources, "a trainer rank (resources.trainer_resources)")
    handle = rollout_cls.options(num_cpus=r.rollout_num_cpus, resources=r.rollout_resources or None).remote(
        cfg, run_dir, redis_url)
    rollout = RayActor(handle)
    stack.callback(_kill_recorded_on, rollout.node, run_dir)  # after ray.kill: servers its death left behind
    stack.callback(ray.kill, handle)
    await trainers.start()
    if memory is not None:  # Ray's daemons and idle workers, started under this process; not the actors' trees
        rollout_pid = await handle.pid.remote()
        memory.skip(lambda: {rollout_pid, *trainers.pids})
        memory.watch("ray", os.getpid(), tree=True)
    return rollout, trainers


async def nodes(rollout: Any, trainers: Any) -> dict[str, Any] | None:
    """The Ray node ids the run's actors were placed on: ``rollout`` (the actor, its SGLang servers and
    sandboxes) and ``trainer`` (one per rank). None in debug mode (one process)."""
    if not isinstance(rollout, RayActor) or not isinstance(trainers, TrainerGroup):
        return None
    return {"rollout": await rollout.node, "trainer": list(trainers.node_ids)}


def _other_machines(ray: Any) -> bool:
    here = ray.util.get_node_ip_address()
    return any(n["Alive"] and n["NodeManagerAddress"] != here for n in ray.nodes())


def _warn_if_unplaceable(ray: Any, wanted: dict[str, float], what: str) -> None:
    """An actor that asks for a custom resource no node offers waits until a node that does joins: say so."""
    offered = ray.cluster_resources()
    missing = {k: v for k, v in wanted.items() if offered.get(k, 0.0) < v}
    if missing:
        logger.warning("%s asks for %s, which no node of the cluster offers now (it offers %s): it waits until "
                       "such a node joins", what, missing,
                       {k: v for k, v in offered.items() if not k.startswith("node:")})


def _kill_recorded_on(node_ref: Any, run_dir: Path) -> None:
    """Kill the process groups in the ledger of the rollout actor's node (``node_ref``: its node id, asked when
    it was created), by a task on that node: only there are the ledger and the pids it names."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    try:
        node = ray.get(node_ref, timeout=10)
    except Exception as exc:  # the actor never started (it started nothing) or the cluster is gone
        logger.debug("rollout actor's node unknown (%r): no process groups to kill", exc)
        return
    task = ray.remote(num_cpus=0, max_retries=0)(kill_recorded).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
    try:
        found = ray.get(task.remote(run_dir), timeout=120)
    except Exception as exc:
        logger.warning("could not kill the process groups the rollout side started on node %s (%r): see that "
                       "node's %s", node, exc, run_dir / "logs" / "processes.jsonl")
        return
    if found:
        logger.info("killed %d process group(s) the rollout side left on node %s", found, node)


class RayActor:
    """A Ray actor called like the object it runs: ``await actor.run(n)`` is ``await handle.run.remote(n)``. An
    actor that died (its process killed, its node lost) raises :class:`RolloutDiedError`, which says how to go on.
    ``node`` is the reference of its node id, asked at once (it stays readable after the actor dies)."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self.node = handle.node_id.remote()

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.handle, name)

        async def call(*args: Any, **kwargs: Any) -> Any:
            import ray

            try:
                return await method.remote(*args, **kwargs)
            except ray.exceptions.RayActorError as exc:
                raise RolloutDiedError(
                    f"the rollout process died during {name}() ({type(exc).__name__}); the run stops here. Nothing "
                    "is lost: trajectories already queued stay in Redis and the trainer's checkpoints are on disk; "
                    "continue the run with the same command and --resume") from exc

        return call


class TrainerThread:
    """Debug mode: the one trainer rank on a thread of this process, in its own event loop (torch releases the GIL
    while it computes, so the rollout side keeps going). Its error is raised as is, never retried."""

    restarts = 0
    memory_reports: tuple[dict[str, Any], ...] = ()  # none: the controller's sampler counts this process

    def __init__(self, cfg: RunConfig, run_dir: Path, redis_url: str) -> None:
        self.cfg, self.run_dir, self.redis_url = cfg, run_dir, redis_url
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        # imported here, on the controller's thread: transformers' lazy imports are not safe to race with the rollout
        # side's (seen: "cannot import name 'AutoModelForCausalLM'" when the thread imported them)
        from agentrl.launcher.trainer_process import train

        self._train_fn = train
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        controller = done.get_loop()

        def report(exc: BaseException | None) -> None:
            if done.done():
                return
            if exc is None:
                done.set_result(None)
            elif isinstance(exc, asyncio.CancelledError):  # kill()
                done.cancel()
            else:
                done.set_exception(exc)

        def main() -> None:
            try:
                asyncio.run(self._train())
            except BaseException as exc:  # handed to the controller, which raises it
                controller.call_soon_threadsafe(report, exc)
            else:
                controller.call_soon_threadsafe(report, None)

        self._done = done
        self._thread = threading.Thread(target=main, name="trainer-0", daemon=True)
        self._thread.start()

    async def _train(self) -> None:
        self._loop, self._task = asyncio.get_running_loop(), asyncio.current_task()
        await self._train_fn(self.cfg, self.run_dir, self.redis_url, rank=0)

    async def wait(self) -> None:
        await asyncio.shield(self._done)  # several waiters may come and go (each controller call watches it)

    def kill(self) -> None:
        """Cancel the trainer at its next await (a step in progress finishes first) and wait for its thread."""
        if self._thread is None or not self._thread.is_alive():
            return
        if self._loop is not None and self._task is not None:
            self._loop.call_soon_threadsafe(self._task.cancel)
        self._thread.join(timeout=120)
        if self._thread.is_alive():
            logger.warning("the trainer thread did not stop within 120 s; it ends with this process")


def ray_init(cfg: RunConfig) -> Any:
    """Ray, started as a local cluster (or joining ``resources.ray_address``) unless it runs already."""
    import ray

    from agentrl.launcher.signals import stop_on_sigterm

    if ray.is_initialized():
        return ray
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a local cluster: no token file in the user's home
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    # Ray starts its workers at nice 15 (to keep its own daemons responsive): the trainer and rollout actors, SGLang
    # and every sandbox they spawn then lose the CPU to any other process on the box (seen: a niced pytest at nice
    # 10 took the cores from a demo). Our actors are the work; run them at the driver's priority.
    os.environ.setdefault("RAY_worker_niceness", "0")
    r = cfg.resources
    if r.ray_address:
        ray.init(address=r.ray_address, log_to_driver=True)
    else:  # a local cluster offers what the run asks for, custom resources included
        need = r.rollout_num_cpus + r.trainer_world_size * r.trainer_num_cpus
        ray.init(include_dashboard=False, num_cpus=math.ceil(max(need, os.cpu_count() or 1)), log_to_driver=True,
                 configure_logging=False, resources=r.local_cluster_resources() or None)
    stop_on_sigterm()  # ray.init replaced our SIGTERM handler with one that aborts the controller
    return ray


def _log_to(path: Path) -> None:
    """Send this process's logs to a file of the run on this node (Ray actors run in their own processes) and to
    stderr, which Ray streams to the controller from whatever node this is (``log_to_driver``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    formatter = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    root = logging.getLogger()
    for handler in (logging.FileHandler(path), logging.StreamHandler(sys.stderr)):
        handler.setFormatter(formatter)
        root.addHandler(handler)
    root.setLevel(logging.INFO)


def _node_id() -> str:
    import ray

    return str(ray.get_runtime_context().get_node_id())


def _actor_classes() -> tuple[Any, Any]:
    import ray

    from agentrl.launcher.rollout_process import RolloutWorker

    @ray.remote
    class RolloutActor(RolloutWorker):
        def __init__(self, cfg: RunConfig, run_dir: Path, redis_url: str) -> None:
            _log_to(Path(run_dir) / "logs" / "rollout.log")
            (Path(run_dir) / "logs" / "rollout.pid").write_text(str(os.getpid()))
            super().__init__(cfg, run_dir, redis_url)

        def pid(self) -> int:
            return os.getpid()

        def node_id(self) -> str:
            return _node_id()

    @ray.remote
    class TrainerActor:
        def __init__(self, cfg: RunConfig, run_dir: str, rank: int, cores: list[int] | None) -> None:
            if cores:
                pin_to_cores(cores)
            self.cfg, self.run_dir, self.rank = cfg, Path(run_dir), rank
            _log_to(self.run_dir / "logs" / f"trainer-{rank}.log")

        def pid(self) -> int:
            return os.getpid()

        def node_id(self) -> str:
            return _node_id()

        def on_jemalloc(self) -> bool:
            """Whether this rank's process allocates with jemalloc (``trainer.malloc``)."""
            return heap.jemalloc_loaded()

        def rendezvous(self) -> tuple[str, int]:
            """Where the ranks meet when this is rank 0: this node's IP and a TCP port free on it now."""
            import ray

            with socket.socket() as s:
                s.bind(("", 0))
                return str(ray.util.get_node_ip_address()), int(s.getsockname()[1])

        def train(self, env: dict[str, str]) -> dict[str, Any]:
            """This rank's whole job; returns its memory report (:mod:`agentrl.launcher.memory`)."""
            import ray

            from agentrl.launcher.trainer_process import train

            memory = MemorySampler()
            memory.watch(f"trainer-{self.rank}", os.getpid(), tree=True)
            memory.start()

            os.environ.update(env)  # torch.distributed's rendezvous
            if ray.get_gpu_ids():  # Ray shows this actor only its own GPUs: the first is its device
                os.environ["LOCAL_RANK"] = "0"
            (self.run_dir / "logs" / f"trainer-{self.rank}.pid").write_text(str(os.getpid()))
            try:
                asyncio.run(train(self.cfg, self.run_dir, os.environ["AGENTRL_REDIS_URL"], rank=self.rank))
            finally:
                memory.stop()
            return memory.report()

    return RolloutActor, TrainerActor


class TrainerGroup:
    """The trainer ranks as Ray actors; restarted together (from the last checkpoint) when one dies.

    The ranks meet at rank 0's node: its IP and a port free there, asked of the rank-0 actor once it is placed
    (the controller's node may be another). ``LOCAL_RANK`` is a rank's index among the ranks on its node."""

    def __init__(self, cfg: RunConfig, run_dir: Path, redis_url: str, actor_cls: Any) -> None:
        self.cfg, self.run_dir, self.redis_url, self.cls = cfg, run_dir, redis_url, actor_cls
        self.actors: list[Any] = []
        self.refs: list[Any] = []
        self.node_ids: list[str] = []
        self.pids: list[int] = []
        self.memory_reports: list[dict[str, Any]] = []  # each rank's, once wait() returned
        self.restarts = 0

    async def start(self) -> None:
        r = self.cfg.resources
        world = r.trainer_world_size
        self.refs = []
        # an allocator is chosen at a process's start: the ranks' processes are Ray's workers, started for this env
        t = self.cfg.trainer
        malloc, why = heap.choose(t.malloc, t.mmap_threshold_kb, separate_process=True,
                                  cpu=self.cfg.trainer_device == "cpu", dtype=t.dtype,
                                  lora=t.lora is not None)
        if malloc == "glibc" and t.malloc == "auto":
            logger.info("trainer.malloc auto: glibc (%s)", why)
        preload = heap.preload_env(malloc)
        # the ranks get the choice, not auto: a rank asked for jemalloc and started without it says so in its log
        cfg = self.cfg.model_copy(update={"trainer": t.model_copy(update={"malloc": malloc})})
        self.actors = [self.cls.options(num_cpus=r.trainer_num_cpus, num_gpus=r.trainer_num_gpus,
                                        resources=r.trainer_resources or None,
                                        runtime_env={"env_vars": preload} if preload else None,
                                        name=f"trainer-{self.cfg.name}-{rank}-{self.restarts}").remote(
            cfg, str(self.run_dir), rank, r.trainer_cores) for rank in range(world)]
        self.node_ids = list(await asyncio.gather(*(a.node_id.remote() for a in self.actors)))
        self.pids = list(await asyncio.gather(*(a.pid.remote() for a in self.actors)))
        if preload:  # the library's path is the controller's: a node installed elsewhere starts the rank on glibc
            on = await asyncio.gather(*(a.on_jemalloc.remote() for a in self.actors))
            off = [rank for rank, yes in enumerate(on) if not yes]
            if off:
                logger.warning("trainer.malloc %s: rank(s) %s started without jemalloc (%s was not found or not "
                               "loadable on their node): glibc's heap serves them; see logs/trainer-<rank>.log",
                               self.cfg.trainer.malloc, ", ".join(map(str, off)), preload["LD_PRELOAD"])
            else:
                logger.info("trainer ranks allocate with jemalloc (%s; trainer.malloc %s%s)", preload["LD_PRELOAD"],
                            self.cfg.trainer.malloc, f": {why}" if why not in ("auto", "trainer.malloc") else "")
        address, port = await self.actors[0].rendezvous.remote()
        for rank, actor in enumerate(self.actors):
            env = {"AGENTRL_REDIS_URL": self.redis_url, "RANK": str(rank), "WORLD_SIZE": str(world),
                   "LOCAL_RANK": str(self.node_ids[:rank].count(self.node_ids[rank])),
                   "MASTER_ADDR": address, "MASTER_PORT": str(port)}
            self.refs.append(actor.train.remote(env))
        logger.info("trainer ranks on node(s) %s meet at %s:%d", ", ".join(dict.fromkeys(self.node_ids)), address,
                    port)

    async def wait(self) -> None:
        """Return when every rank finished; restart the group on a death, up to ``max_trainer_restarts``."""
        import ray

        while True:
            try:
                self.memory_reports = list(await asyncio.gather(*self.refs))
                return
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as exc:
                if self.restarts >= self.cfg.resources.max_trainer_restarts:
                    raise TrainerError(f"the trainer failed {self.restarts + 1} times; last error: {exc}; "
                                       f"see {self.run_dir / 'logs'}") from exc
                self.restarts += 1
                logger.warning("trainer died (%s); restarting from the last checkpoint (restart %d/%d)",
                               type(exc).__name__, self.restarts, self.cfg.resources.max_trainer_restarts)
                self.kill()
                await self.start()

    def kill(self) -> None:
        import ray

        for a in self.actors:
            ray.kill(a, no_restart=True)
