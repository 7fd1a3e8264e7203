"""The evaluation service's contract: task states, its settings, its errors.

A task moves ``queued → running → succeeded | failed | cancelled``; a running task whose worker went away (the
API restarted or died) goes back to ``queued`` and is resumed from the records it already stored. Every task
belongs to a tenant (a named token with scopes); a tenant sees only its own tasks, an ``admin`` sees all.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from agentrl.engine.server import SGLangServerConfig
from agentrl.errors import AgentRLError
from agentrl.rewards.config import RewardsConfig
from agentrl.sandbox.config import SandboxConfig

TOKEN_ENV = "AGENTRL_API_TOKEN"
WEBHOOK_SECRET_ENV = "AGENTRL_WEBHOOK_SECRET"


class TaskStatus(str, enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in (TaskStatus.SUCCEEDED, TaskStatus.FAILED, TaskStatus.CANCELLED)


class Scope(str, enum.Enum):
    """What a tenant's token may do: ``submit`` tasks, ``read`` them (state, results, listing), ``cancel`` or
    purge them; ``admin``: all of it on every tenant's tasks, and ``GET /v1/status``."""

    SUBMIT = "submit"
    READ = "read"
    CANCEL = "cancel"
    ADMIN = "admin"


#: the tenant of the single shared ``token`` (and of every request when the server has no token at all)
DEFAULT_TENANT = "default"


class Tenant(BaseModel):
    """One bearer token of the service: its tasks are its own (another tenant's task ids answer 404)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$", description="owner of its tasks")
    token: str = Field(min_length=1, max_length=256, description="its bearer token")
    scopes: frozenset[Scope] = Field(default=frozenset({Scope.SUBMIT, Scope.READ, Scope.CANCEL}),
                                     description="submit, read, cancel, admin")


class TaskNotFound(AgentRLError, LookupError):
    """No evaluation task has this id."""


class TaskLost(AgentRLError):
    """This worker no longer owns the task (cancelled, or its lease expired and another worker took it)."""


class StoreFull(AgentRLError):
    """The task store is at its bound (``max_store_bytes``): it takes no new task until tasks are purged."""


class IdempotencyConflict(AgentRLError):
    """An ``Idempotency-Key`` was used before with another request body (``task_id``: the first one's task)."""

    def __init__(self, message: str, task_id: str) -> None:
        super().__init__(message)
        self.task_id = task_id


class ApiSettings(BaseModel):
    """Settings of ``agentrl serve`` (one process: HTTP API + workers)."""

    model_config = ConfigDict(extra="forbid")

    token: str | None = Field(default=None, description=f"bearer token required on /v1 routes (default ${TOKEN_ENV}); "
                                                       f"its holder is the admin tenant {DEFAULT_TENANT!r}")
    tenants: list[Tenant] = Field(default_factory=list,
                                  description="named tokens with scopes; with neither these nor `token` the API is open")
    redis_url: str | None = Field(default=None, description="external Redis; default $AGENTRL_REDIS_URL, else embedded")
    data_dir: Path = Field(default=Path("runs/_api"), description="embedded Redis data and server logs")
    namespace: str = Field(default="{agentrl-evals}", min_length=1,
                           description="Redis key prefix (the braces keep every key in one cluster slot)")
    max_body_bytes: int = Field(default=8 << 20, ge=1024)
    max_tasks: int = Field(default=2, ge=0, description="tasks this process runs at once (0: only accept and queue)")
    max_episodes: int = Field(default=16, ge=1, description="episodes running at once over all tasks")
    max_servers: int = Field(default=1, ge=1, description="SGLang servers the service starts at most")
    max_inflight: int = Field(default=64, ge=1, description="generate calls in flight per server")
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig, description="the sandbox every evaluation shares")
    rewards: RewardsConfig = Field(default_factory=RewardsConfig, description="the math checker pool evaluations share")
    lease_s: float = Field(default=30.0, gt=0, description="a task whose worker stops heartbeating is re-queued after this")
    max_attempts: int = Field(default=3, ge=1, description="a task interrupted this many times fails")
    poll_s: float = Field(default=0.5, gt=0, description="how often idle workers look for queued tasks")
    events_maxlen: int = Field(default=10_000, ge=100, le=10_000_000,
                               description="events kept per task for GET /v1/evals/{id}/events (older ones trimmed)")
    events_wait_s: float = Field(default=5.0, gt=0, le=25.0,
                                 description="an event stream's longest wait on Redis before it looks at the task")
    webhook_secret: str | None = Field(default=None, min_length=16, description=(
        f"key of the webhooks' HMAC-SHA256 signature (default ${WEBHOOK_SECRET_ENV}); unset: specs with a "
        "webhook_url are refused"))
    webhook_timeout_s: float = Field(default=10.0, gt=0, le=300, description="deadline of one webhook POST")
    webhook_attempts: int = Field(default=3, ge=1, le=10,
                                  description="tries of a webhook (on connection errors, 429 and 5xx)")
    runs_dir: Path = Field(default=Path("runs"), description="where training runs (and their weight versions) live")
    dataset_dirs: list[Path] = Field(default_factory=lambda: [Path(".")],
                                     description="server-side dataset files must lie under one of these")
    model_dirs: list[Path] = Field(default_factory=lambda: [Path(".")],
                                   description="`model.path` (and a tokenizer folder) must lie under one of these")
    model_hosts: list[str] = Field(default_factory=lambda: ["127.0.0.1", "::1", "localhost"],
                                   description="hosts `model.url`, `model.openai_url` and `webhook_url` may name: names, IP "
                                               "addresses or networks (10.0.0.0/8); anything else is a 422")
    idempotency_ttl_s: float = Field(default=86_400.0, gt=0, description="how long an Idempotency-Key is remembered")
    finished_ttl_s: float | None = Field(default=None, gt=0,
                                         description="purge finished tasks this long after they finished (null: keep)")
    max_task_result_bytes: int = Field(default=256 << 20, ge=1024,
                                       description="stored (compressed) records of one task; past it the task fails")
    max_store_bytes: int = Field(default=1 << 30, ge=1024,
                                 description="datasets + records of all tasks; at it new tasks get 507")
    sglang: SGLangServerConfig = Field(default_factory=SGLangServerConfig,
                                       description="how the service starts SGLang servers (model_path: per request)")

    @model_validator(mode="after")
    def _unique_tenants(self) -> ApiSettings:
        names = [t.name for t in self.all_tenants()]
        tokens = [t.token for t in self.all_tenants()]
        if len(set(names)) != len(names) or len(set(tokens)) != len(tokens):
            raise ValueError(f"tenant names and tokens must be unique (names: {names}; the shared `token` is the "
                             f"tenant {DEFAULT_TENANT!r})")
        return self

    def all_tenants(self) -> list[Tenant]:
        """``tenants``, plus the shared ``token`` as the admin tenant ``default``."""
        shared = [] if self.token is None else [Tenant(name=DEFAULT_TENANT, token=self.token, scopes=frozenset(Scope))]
        return shared + list(self.tenants)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> ApiSettings:
        """Settings with the token from ``$AGENTRL_API_TOKEN`` and the webhook secret from
        ``$AGENTRL_WEBHOOK_SECRET`` unless given."""
        env = os.environ if env is None else env
        if overrides.get("token") is None and env.get(TOKEN_ENV):
            overrides["token"] = env[TOKEN_ENV]
        if overrides.get("webhook_secret") is None and env.get(WEBHOOK_SECRET_ENV):
            overrides["webhook_secret"] = env[WEBHOOK_SECRET_ENV]
        return cls(**overrides)
