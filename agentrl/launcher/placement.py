"""Where the two processes of a run run: on Ray, or (debug mode, ``resources.ray: false``) inside the controller.

    Ray (default)                                    debug mode
    RolloutActor: a RolloutWorker in its process     the RolloutWorker in the controller's event loop
    TrainerActor × trainer_world_size (restarted     the one trainer rank (world size 1) on a thread of the
      together from the last checkpoint)               controller, with its own event loop; never restarted

Either way the controller gets the same two handles: the rollout worker (``await rollout.start()``; a Ray actor is
called through :class:`RayActor`, which makes ``.remote`` calls of the same names) and a trainer group with
``start`` / ``wait`` / ``kill`` / ``restarts``. Debug mode imports no Ray: ``breakpoint()`` anywhere (rollout,
trainer, environment, reward) stops in the terminal that started the run.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

from agentrl.errors import InfrastructureError, TrainerError
from agentrl.launcher.config import RunConfig
from agentrl.launcher.resources import pin_to_cores

logger = logging.getLogger(__name__)


class RolloutDiedError(InfrastructureError):
    """The rollout process (its Ray actor) died mid-run: the run stops, to be continued with ``--resume``."""


async def place(cfg: RunConfig, run_dir: Path, redis_url: str, stack: AsyncExitStack) -> tuple[Any, Any]:
    """Start the trainer group and create the rollout worker (not started yet) as configured; both are stopped
    with ``stack``. Returns ``(rollout, trainers)``."""
    if not cfg.resources.ray:
        from agentrl.launcher.rollout_process import RolloutWorker

        threaded = TrainerThread(cfg, run_dir, redis_url)
        stack.callback(threaded.kill)
        threaded.start()
        return RolloutWorker(cfg, run_dir, redis_url), threaded
    ray = ray_init(cfg)
    rollout_cls, trainer_cls = _actor_classes()
    trainers = TrainerGroup(cfg, run_dir, redis_url, trainer_cls)
    stack.callback(trainers.kill)
    trainers.start()
    handle = rollout_cls.options(num_cpus=cfg.resources.rollout_num_cpus).remote(cfg, run_dir, redis_url)
    stack.callback(ray.kill, handle)
    return RayActor(handle), trainers


class RayActor:
    """A Ray actor called like the object it runs: ``await actor.run(n)`` is ``await handle.run.remote(n)``. An
    actor that died (its process killed, its node lost) raises :class:`RolloutDiedError`, which says how to go on."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

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

    if ray.is_initialized():
        return ray
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a local cluster: no token file in the user's home
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    # Ray starts its workers at nice 15 (to keep its own daemons responsive): the trainer and rollout actors, SGLang
    # and every sandbox they spawn then lose the CPU to any other process on the box (seen: a niced pytest at nice
    # 10 took the cores from a demo). Our actors are the work; run them at the driver's priority.
    os.environ.setdefault("RAY_worker_niceness", "0")
    if cfg.resources.ray_address:
        ray.init(address=cfg.resources.ray_address, log_to_driver=True)
    else:
        need = cfg.resources.rollout_num_cpus + cfg.resources.trainer_world_size * cfg.resources.trainer_num_cpus
        ray.init(include_dashboard=False, num_cpus=max(need, float(os.cpu_count() or 1)), log_to_driver=True,
                 configure_logging=False)
    return ray


def _log_to(path: Path) -> None:
    """Send this process's agentrl logs to a file of the run (Ray actors run in their own processes)."""
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.INFO)


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

    @ray.remote
    class TrainerActor:
        def __init__(self, cfg: RunConfig, run_dir: str, env: dict[str, str], cores: list[int] | None) -> None:
            os.environ.update(env)  # torch.distributed's rendezvous
            if cores:
                pin_to_cores(cores)
            self.cfg, self.run_dir = cfg, Path(run_dir)
            _log_to(self.run_dir / "logs" / f"trainer-{env.get('RANK', '0')}.log")

        def pid(self) -> int:
            return os.getpid()

        def train(self) -> int:
            from agentrl.launcher.trainer_process import train

            rank = int(os.environ["RANK"])
            (self.run_dir / "logs" / f"trainer-{rank}.pid").write_text(str(os.getpid()))
            asyncio.run(train(self.cfg, self.run_dir, os.environ["AGENTRL_REDIS_URL"], rank=rank))
            return 0

    return RolloutActor, TrainerActor


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class TrainerGroup:
    """The trainer ranks as Ray actors; restarted together (from the last checkpoint) when one dies."""

    def __init__(self, cfg: RunConfig, run_dir: Path, redis_url: str, actor_cls: Any) -> None:
        self.cfg, self.run_dir, self.redis_url, self.cls = cfg, run_dir, redis_url, actor_cls
        self.actors: list[Any] = []
        self.refs: list[Any] = []
        self.restarts = 0

    def start(self) -> None:
        r = self.cfg.resources
        world, port = r.trainer_world_size, _free_port()
        self.actors, self.refs = [], []
        for rank in range(world):
            env = {"AGENTRL_REDIS_URL": self.redis_url, "RANK": str(rank), "LOCAL_RANK": str(rank),
                   "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
            actor = self.cls.options(num_cpus=r.trainer_num_cpus, num_gpus=r.trainer_num_gpus,
                                     name=f"trainer-{self.cfg.name}-{rank}-{self.restarts}").remote(
                self.cfg, str(self.run_dir), env, r.trainer_cores)
            self.actors.append(actor)
        self.refs = [a.train.remote() for a in self.actors]

    async def wait(self) -> None:
        """Return when every rank finished; restart the group on a death, up to ``max_trainer_restarts``."""
        import ray

        while True:
            try:
                await asyncio.gather(*self.refs)
                return
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as exc:
                if self.restarts >= self.cfg.resources.max_trainer_restarts:
                    raise TrainerError(f"the trainer failed {self.restarts + 1} times; last error: {exc}; "
                                       f"see {self.run_dir / 'logs'}") from exc
                self.restarts += 1
                logger.warning("trainer died (%s); restarting from the last checkpoint (restart %d/%d)",
                               type(exc).__name__, self.restarts, self.cfg.resources.max_trainer_restarts)
                self.kill()
                self.start()

    def kill(self) -> None:
        import ray

        for a in self.actors:
            ray.kill(a, no_restart=True)
