"""A fake OpenAI-compatible chat-completions server for tests of the logic around one (the real one is SGLang's
own OpenAI route, in test_sglang_eval.py): FastAPI on 127.0.0.1:<free port> in the test's event loop, answering
from a script.

The script gets the request body and the turn (assistant messages in the request) and returns what the "model"
generates: a string, a :class:`Reply`, or an :class:`Error`. The server applies the request's ``stop`` the way the
OpenAI API does (the text is cut before the stop string, which is removed) and, in ``sglang`` style, reports it
as ``matched_stop`` (``plain`` style: it says nothing, like OpenAI's own API).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse


@dataclass(frozen=True)
class Reply:
    text: str = ""
    finish: str = "stop"  # when no stop string cuts it
    tool_calls: tuple[dict[str, Any], ...] = ()
    delay_s: float = 0.0
    usage: bool = True


@dataclass(frozen=True)
class Error:
    status: int
    body: str = '{"error": {"message": "scripted failure"}}'


Script = Callable[[dict[str, Any], int], "str | Reply | Error"]


@dataclass
class FakeOpenAI:
    script: Script
    style: Literal["sglang", "plain"] = "sglang"
    models: tuple[str, ...] = ("fake-model",)
    requests: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    url: str = ""

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {"object": "list", "data": [{"id": m, "object": "model"} for m in self.models]}

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Any:
            body = await request.json()
            self.requests.append(body)
            self.headers.append(dict(request.headers))
            turn = sum(1 for m in body["messages"] if m["role"] == "assistant")
            out = self.script(body, turn)
            reply = Reply(out) if isinstance(out, str) else out
            if isinstance(reply, Error):
                return JSONResponse(status_code=reply.status, content={"error": {"message": reply.body}})
            await asyncio.sleep(reply.delay_s)
            return self.answer(body, reply)

        return app

    def answer(self, body: dict[str, Any], reply: Reply) -> dict[str, Any]:
        text, finish, matched = reply.text, reply.finish, None
        hits = [(text.find(s), s) for s in body.get("stop") or [] if s in text]
        if hits:
            i, matched = min(hits)
            text, finish = text[:i], "stop"
        choice: dict[str, Any] = {"index": 0, "finish_reason": "tool_calls" if reply.tool_calls else finish,
                                  "message": {"role": "assistant", "content": text or None,
                                              "tool_calls": list(reply.tool_calls) or None}}
        if self.style == "sglang":
            choice["matched_stop"] = matched
        out: dict[str, Any] = {"id": "x", "object": "chat.completion", "model": body["model"], "choices": [choice]}
        if reply.usage:
            prompt = sum(len(str(m.get("content") or "").split()) for m in body["messages"])
            out["usage"] = {"prompt_tokens": prompt, "completion_tokens": len(text.split()),
                            "total_tokens": prompt + len(text.split())}
        return out


class Served:
    """``FakeOpenAI``'s app on a real uvicorn server; ``url`` is its base (``…/v1``)."""

    def __init__(self, fake: FakeOpenAI) -> None:
        self.fake = fake
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        fake.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/v1"
        self.server = uvicorn.Server(uvicorn.Config(fake.app(), log_level="warning", lifespan="off"))
        self.task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> FakeOpenAI:
        self.task = asyncio.get_running_loop().create_task(self.server.serve(sockets=[self.sock]))
        for _ in range(500):
            if self.server.started:
                return self.fake
            await asyncio.sleep(0.01)
        raise RuntimeError("uvicorn did not start")

    async def __aexit__(self, *exc: object) -> None:
        self.server.should_exit = True
        if self.task is not None:
            await self.task
        self.sock.close()


def closed_port_url() -> str:
    """A URL where nothing listens (a port bound and released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"
