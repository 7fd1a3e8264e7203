"""The evaluation REST service (``agentrl serve``): tasks and results in Redis, workers that resume them.

    app = create_app(ApiSettings.from_env(redis_url=None, max_tasks=2))   # uvicorn.run(app, ...)
"""

# The names below load their modules on first use (PEP 562): ``agentrl.api.cli``, which every ``agentrl`` command
# imports to mount ``serve`` and ``eval``, reads ``agentrl.api.base`` only, and so does not pay for FastAPI and the
# evaluation stack (scipy) at each start of the CLI (~2.8 s).
import importlib
from typing import TYPE_CHECKING, Any

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
    "create_app": "agentrl.api.app",
    **dict.fromkeys(("TOKEN_ENV", "ApiSettings", "IdempotencyConflict", "Scope", "StoreFull", "TaskLost",
                     "TaskNotFound", "TaskStatus", "Tenant"), "agentrl.api.base"),
    **dict.fromkeys(("ListQuery", "TaskRecord", "TaskStore"), "agentrl.api.store"),
    "EvalWorkers": "agentrl.api.worker",
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


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
