"""Settings of the engine's runtime side: the pool of servers (:class:`PoolConfig`) and each client's deadlines
(:class:`Timeouts`). A run's ``engine:`` section holds them next to the servers' own (``SGLangServerConfig``); this
module imports nothing, so the trainer process reads a run's configuration without the HTTP client or the pool.

The ``Annotated`` bounds are checked where the settings come from outside (pydantic, in a run's configuration).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from pydantic import Field


@dataclass(frozen=True, slots=True)
class PoolConfig:
    """How :class:`agentrl.engine.EnginePool` watches, restarts and routes to its servers."""

    health_interval_s: Annotated[float, Field(gt=0)] = 5.0
    health_timeout_s: Annotated[float, Field(gt=0)] = 10.0
    failures_to_down: Annotated[int, Field(ge=1)] = 3  # consecutive failed /health checks (a dead process: at once)
    # slow is not dead: a server that stops answering /health but is alive is taken out only once it has made no
    # progress (no CPU time used by its processes, no request finished, no health answer) for hung_after_s, or
    # has not answered for max_unhealthy_s whatever it does (on a starved machine SGLang answers 503 for minutes
    # while it still decodes)
    hung_after_s: Annotated[float, Field(ge=0)] = 120.0
    max_unhealthy_s: Annotated[float, Field(gt=0)] = 900.0
    restart: bool = True  # restart servers agentrl started
    max_restarts: Annotated[int, Field(ge=0)] = 5  # per server, over the pool's life
    restart_backoff_s: Annotated[float, Field(ge=0)] = 2.0  # after a failed restart: backoff · 2^(k-1), at most 60 s
    wait_for_server_s: Annotated[float, Field(gt=0)] = 300.0  # generate waits this long for a server to be up
    sticky_capacity: Annotated[int, Field(ge=1)] = 65536  # routing entries kept (least recently used dropped)


@dataclass(frozen=True, slots=True)
class Timeouts:
    """Deadline of each kind of call of :class:`agentrl.engine.SGLangClient`, retries included."""

    generate_s: Annotated[float, Field(gt=0)] = 600.0  # one generation (a long CPU generation can take minutes)
    control_s: Annotated[float, Field(gt=0)] = 30.0  # health, version, pause/continue, abort
    update_weights_s: Annotated[float, Field(gt=0)] = 600.0  # loading new weights from disk
