"""The evaluation REST service (``agentrl serve``): tasks and results in Redis, workers that resume them.

    app = create_app(ApiSettings.from_env(redis_url=None, max_tasks=2))   # uvicorn.run(app, ...)
"""

from agentrl.api.app import create_app
from agentrl.api.base import (
    TOKEN_ENV,
    ApiSettings,
    IdempotencyConflict,
    Scope,
    StoreFull,
    TaskLost,
    TaskNotFound,
    TaskStatus,
    Tenant,
)
from agentrl.api.store import ListQuery, TaskRecord, TaskStore
from agentrl.api.worker import EvalWorkers

__all__ = [
           "TOKEN_ENV",
           "ApiSettings",
           "EvalWorkers",
           "IdempotencyConflict",
           "ListQuery",
           "Scope",
           "StoreFull",
           "TaskLost",
           "TaskNotFound",
           "TaskRecord",
           "TaskStatus",
           "TaskStore",
           "Tenant",
           "create_app",
]
