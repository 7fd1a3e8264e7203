"""The evaluation REST service (``agentrl serve``): tasks and results in Redis, workers that resume them.

    app = create_app(ApiSettings.from_env(redis_url=None, max_tasks=2))   # uvicorn.run(app, ...)
"""

# The names below load their modules on first use (PEP 562): ``agentrl.api.cli``, which every ``agentrl`` command
# imports to mount ``serve`` and ``eval``, reads ``agentrl.api.base`` only, and so does not pay for FastAPI and the
# evaluation stack (scipy) at each start of the CLI (~2.3 s).
from typing import TYPE_CHECKING

from agentrl._lazy import lazy_exports

if TYPE_CHECKING:
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

_HOME = {
    "create_app": "app",
    **dict.fromkeys(("TOKEN_ENV", "ApiSettings", "IdempotencyConflict", "Scope", "StoreFull", "TaskLost",
                     "TaskNotFound", "TaskStatus", "Tenant"), "base"),
    **dict.fromkeys(("ListQuery", "TaskRecord", "TaskStore"), "store"),
    "EvalWorkers": "worker",
}
__getattr__, __dir__ = lazy_exports(__name__, _HOME)

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
