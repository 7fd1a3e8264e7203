"""Helpers of the API tests: a real uvicorn server in this event loop, and spec bodies."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import uvicorn

from agentrl.api import ApiSettings, create_app


class ApiServer:
    """``agentrl serve``'s app on 127.0.0.1 (a free port, or ``port`` to come back on the same URL)."""

    def __init__(self, settings: ApiSettings, port: int = 0) -> None:
        self.settings = settings
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = create_app(settings)
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", lifespan="on"))
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> ApiServer:
        self.task = asyncio.get_running_loop().create_task(self.server.serve(sockets=[self.sock]))
        for _ in range(3000):
            if self.server.started:
                return self
            if self.task.done():
                self.task.result()
            await asyncio.sleep(0.01)
        raise RuntimeError("uvicorn did not start")

    @property
    def workers(self) -> Any:
        return self.app.state.agentrl.workers

    async def stop(self) -> None:
        """A clean shutdown (what SIGTERM/Ctrl-C does): running tasks are handed back to the queue."""
        self.server.should_exit = True
        if self.task is not None:
            await self.task
        self.sock.close()


def body(url: str = "http://127.0.0.1:9", **kw: Any) -> dict[str, Any]:
    """A small valid spec (retool on two inline items) served by the SGLang server at ``url``."""
    b: dict[str, Any] = {
        "environment": {"name": "retool", "options": {}},
        "dataset": {"items": [{"prompt": "What is 6 * 7?", "answer": "42"},
                              {"prompt": "What is 2 + 3?", "answer": "5"}]},
        "model": {"url": url},
        "sampling": {"temperature": 1.0, "max_new_tokens": 24, "seed": 1},
        "samples_per_item": 2, "pass_k": [1, 2], "max_turns": 2,
    }
    b.update(kw)
    return b
