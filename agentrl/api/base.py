"""The evaluation service's contract: task states, its settings, its errors.

A task moves ``queued → running → succeeded | failed | cancelled``; a running task whose worker went away (the
API restarted or died) goes back to ``queued`` and is resumed from the records it already stored.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

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


class TaskNotFound(AgentRLError, LookupError):
    """No evaluation task has this id."""


class TaskLost(AgentRLError):
    """This worker no longer owns the task (cancelled, or its lease expired and another worker took it)."""


class ApiSettings(BaseModel):
    """Settings of ``agentrl serve`` (one process: HTTP API + workers)."""

    model_config = ConfigDict(extra="forbid")

    token: str | None = Field(default=None, description=f"bearer token required on /v1 routes (default ${TOKEN_ENV})")
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
    sglang: SGLangServerConfig = Field(default_factory=SGLangServerConfig,
                                       description="how the service starts SGLang servers (model_path: per request)")

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
