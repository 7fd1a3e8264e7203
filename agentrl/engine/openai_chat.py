"""aiohttp client for any OpenAI-compatible ``/v1/chat/completions`` server (SGLang's or vLLM's own OpenAI route,
or a provider): a :class:`agentrl.engine.base.ChatEngine`, text in and out, no token ids.

Every call is bounded by ONE deadline (``timeout_s``) covering its retries and backoff sleeps; how often and how
patiently it retries is the injected :class:`agentrl.retry.Retry`. Retried: connection refused, a dropped
connection, 429 and 500/502/503/504 (a chat completion has no effect but its cost). Everything else raises
:class:`EngineError` naming the server (``EngineUnavailable`` when it cannot be reached, ``EngineTimeout`` past
the deadline), so the caller records an infrastructure error, never a score. The API key goes in the
``Authorization`` header only; no message or log holds it.

Stop strings. The OpenAI API removes the stop string from the text and need not say which one matched, while an
environment must see it (ReTool's turn ends at ``</code>``). SGLang reports it (``matched_stop``), vLLM too
(``stop_reason``); other servers do not. So the client sends the stop strings to the server only once a response
showed that the server reports matches (the first calls run without them), re-appends the reported match, and
always cuts the text after the first stop string itself — the same turn text on every server, and the server's
stop only saves tokens.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any, Self

import aiohttp

from agentrl.engine.base import (
    ChatEndpoint,
    ChatResult,
    ChatToolCall,
    EngineFinish,
    EngineTimeout,
    EngineUnavailable,
    SamplingParams,
)
from agentrl.errors import EngineError
from agentrl.retry import Retry

logger = logging.getLogger(__name__)

RETRYABLE_STATUS = frozenset({429, 500, 502, 503, 504})
MAX_SERVER_STOPS = 4  # the OpenAI API's limit on `stop`; more are applied here only
_FINISH = {"length": EngineFinish.LENGTH}


class _Retryable(EngineError):
    """A 429/5xx answer or a dropped connection: the server did nothing we keep (retried)."""


def chat_base_url(url: str) -> str:
    """The base URL (``…/v1``) of ``url``, given as the base (what the ``openai`` client takes) or as the full
    ``…/chat/completions`` address."""
    url = url.rstrip("/")
    suffix = "/chat/completions"
    return url[: -len(suffix)] if url.endswith(suffix) else url


def cut_at_stop(text: str, stops: Sequence[str]) -> tuple[str, str | None]:
    """``text`` up to and including the first occurrence of any stop string, and that string (None: no stop)."""
    found = [(i, s) for s in stops if s and (i := text.find(s)) >= 0]
    if not found:
        return text, None
    i, stop = min(found, key=lambda f: (f[0], -len(f[1])))
    return text[: i + len(stop)], stop


class OpenAIChatClient:
    """Client of one OpenAI-compatible server. ``url``: its base (``http://host:port/v1``) or the full
    ``…/chat/completions`` address; ``model``: the model name to send (None: the first of ``GET /models``)."""

    def __init__(self, url: str, *, model: str | None = None, api_key: str | None = None, timeout_s: float = 300.0,
                 retry: Retry = Retry(attempts=3, base_delay_s=1.0, max_delay_s=8.0),
                 max_connections: int = 64) -> None:
        self.base_url = chat_base_url(url)
        self.model = model
        self.timeout_s = timeout_s
        self.retry = retry
        self._api_key = api_key
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        self._model_lock = asyncio.Lock()
        self.reports_stop: bool | None = None  # None: not known yet (see the module docstring)

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
            self._session = aiohttp.ClientSession(
                headers=headers, connector=aiohttp.TCPConnector(limit=self._max_connections, keepalive_timeout=4.0),
                timeout=aiohttp.ClientTimeout(total=None))  # the deadline is ours (asyncio.timeout)
        return self._session

    async def _call(self, method: str, path: str, body: Any = None) -> Any:
        what = f"{method} {self.base_url}{path}"

        async def attempt() -> Any:
            try:
                async with self._http().request(method, self.base_url + path, json=body) as resp:
                    raw = await resp.read()
            except aiohttp.ClientConnectorError:
                raise
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
                raise _Retryable(f"{what}: the server dropped the connection ({exc!r})") from exc
            except aiohttp.ClientError as exc:
                raise EngineError(f"{what} failed: {exc!r}") from exc
            text = raw[:500].decode(errors="replace")
            if resp.status in RETRYABLE_STATUS:
                raise _Retryable(f"{what} answered HTTP {resp.status}: {text}", status=resp.status)
            if resp.status in (401, 403):
                raise EngineError(f"{what} refused the request (HTTP {resp.status}: {text}); check the API key "
                                  "(model.api_key_env names the environment variable holding it)", status=resp.status)
            if resp.status >= 400:
                raise EngineError(f"{what} failed with HTTP {resp.status}: {text}", status=resp.status)
            try:
                return json.loads(raw)
            except ValueError as exc:
                raise EngineError(f"{what} answered HTTP {resp.status} with a body that is not JSON: {text}",
                                  status=resp.status) from exc

        try:
            async with asyncio.timeout(self.timeout_s):
                return await self.retry.call(attempt, retry_on=(aiohttp.ClientConnectorError, _Retryable), what=what)
        except TimeoutError as exc:
            raise EngineTimeout(f"{what} did not answer within {self.timeout_s:g}s (retries included)") from exc
        except aiohttp.ClientConnectorError as exc:
            raise EngineUnavailable(f"{what}: cannot connect to the OpenAI-compatible server after "
                                    f"{self.retry.attempts} attempts ({exc}); is it running? (model.openai_url)") \
                from exc
        except _Retryable as exc:
            raise EngineError(f"{exc} (after {self.retry.attempts} attempts)", status=exc.status) from exc

    async def model_name(self) -> str:
        """The model name sent with each request: the given one, or the first the server lists."""
        async with self._model_lock:
            if self.model is None:
                body = await self._call("GET", "/models")
                try:
                    self.model = str(body["data"][0]["id"])
                except (KeyError, IndexError, TypeError) as exc:
                    raise EngineError(f"GET {self.base_url}/models lists no model ({str(body)[:200]}); give "
                                      "model.openai_model") from exc
            return self.model

    async def endpoint(self) -> ChatEndpoint:
        """This server as a client of its own calls it (the model name resolved): for an agent's client."""
        return ChatEndpoint(self.base_url, self._api_key, await self.model_name())

    async def chat(self, messages: Sequence[Mapping[str, Any]], sampling: SamplingParams, *,
                   tools: Sequence[Mapping[str, Any]] = ()) -> ChatResult:
        """One completion of ``messages`` (``n=1``, not streamed); ``sampling.stop`` ends the turn (kept in the
        text), ``tools``: function schemas sent as the request's ``tools``."""
        t0 = time.monotonic()
        body = self._request(await self.model_name(), messages, sampling, tools)
        out = await self._call("POST", "/chat/completions", body)
        return self._parse(out, sampling.stop, latency_s=time.monotonic() - t0)

    def _request(self, model: str, messages: Sequence[Mapping[str, Any]], sampling: SamplingParams,
                 tools: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        body: dict[str, Any] = {"model": model, "messages": list(messages), "max_tokens": sampling.max_new_tokens,
                                "temperature": sampling.temperature, "top_p": sampling.top_p, "n": 1,
                                "stream": False}
        if sampling.top_k != -1:  # not an OpenAI field (SGLang and vLLM take it): sent only when asked for
            body["top_k"] = sampling.top_k
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        if self.reports_stop and 0 < len(sampling.stop) <= MAX_SERVER_STOPS:
            body["stop"] = list(sampling.stop)
        if tools:
            body["tools"] = [{"type": "function", "function": dict(t)} for t in tools]
        return body

    def _parse(self, out: Any, stops: Sequence[str], *, latency_s: float) -> ChatResult:
        try:
            choice = out["choices"][0]
            message = choice["message"]
        except (KeyError, IndexError, TypeError) as exc:
            raise EngineError(f"{self.base_url}/chat/completions answered without choices[0].message: "
                              f"{str(out)[:300]}") from exc
        reason = choice.get("finish_reason")
        if reason == "abort":
            raise EngineError(f"{self.base_url}/chat/completions: the server aborted the request")
        self.reports_stop = "matched_stop" in choice or "stop_reason" in choice
        reported = choice.get("matched_stop", choice.get("stop_reason"))
        text = message.get("content") or ""
        if reason == "stop" and isinstance(reported, str) and reported in stops and not text.endswith(reported):
            text += reported  # the server trimmed it
        text, matched = cut_at_stop(text, stops)
        finish = EngineFinish.STOP if matched is not None else _FINISH.get(str(reason), EngineFinish.STOP)
        calls = tuple(ChatToolCall(id=str(c.get("id") or f"call_{i}"), name=str(c["function"]["name"]),
                                   arguments=_arguments(c["function"].get("arguments")))
                      for i, c in enumerate(message.get("tool_calls") or []) if isinstance(c, dict)
                      and isinstance(c.get("function"), dict) and "name" in c["function"])
        usage = out.get("usage") if isinstance(out.get("usage"), dict) else {}
        return ChatResult(text=text, finish=finish, matched_stop=matched, tool_calls=calls,
                          prompt_tokens=_int(usage.get("prompt_tokens")),
                          completion_tokens=_int(usage.get("completion_tokens")), latency_s=latency_s)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _arguments(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value if value is not None else {})


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
