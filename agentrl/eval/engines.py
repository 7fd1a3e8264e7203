"""Inference engines for evaluations: which server serves a :class:`ModelSpec`, started on demand and reused.

:class:`ModelServers` holds at most ``max_servers`` SGLang servers it started (one per model folder), reuses a
running one for every evaluation of the same folder, and stops the least recently used idle one when a new
model needs room (waiting while all are busy). A ``url`` model is a running server the pool only connects to.
Every engine is wrapped in :class:`LimitedEngine`: at most ``max_inflight`` generate calls per server at once,
whatever the number of evaluations sharing it. An ``openai_url`` model is leased as a text-level chat engine
(:class:`agentrl.engine.openai_chat.OpenAIChatClient`, its API key read from the environment variable the spec
names, at lease time), under the same per-server limit; its lease has no tokenizer. Its server is not contacted
before the first sample: one that is down fails the samples (infrastructure errors), not the submission.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, Self

import aiohttp

from agentrl.engine.base import (
    ChatEndpoint,
    ChatEngine,
    ChatResult,
    GenerateResult,
    InferenceEngine,
    SamplingParams,
)
from agentrl.engine.client import SGLangClient
from agentrl.engine.openai_chat import OpenAIChatClient
from agentrl.engine.server import SGLangServer, SGLangServerConfig, wait_healthy
from agentrl.errors import ConfigError, EngineError
from agentrl.eval.base import SpecError
from agentrl.eval.spec import OPENAI_TIMEOUT_S, ModelSpec
from agentrl.models import NAMED_MODELS, is_model_ref, resolve_model
from agentrl.tokenizer import ChatTokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ResolvedModel:
    """Where a model spec points: a running server (``url``), a local folder to serve (``path``), or an
    OpenAI-compatible server (``openai_url``, text level)."""

    label: str
    url: str | None = None
    path: Path | None = None
    tokenizer: str | None = None  # bundled name or folder; None: the model's own
    weight_version: int | None = None  # a training run's version: the server is told to report it
    openai_url: str | None = None
    openai_model: str | None = None
    api_key_env: str | None = None  # the NAME of the environment variable holding the key
    openai_timeout_s: float = OPENAI_TIMEOUT_S

    @property
    def token_level(self) -> bool:
        """False for a chat-completions model: its episodes have no token ids, logprobs or weight versions."""
        return self.openai_url is None


def weights_dir(runs_dir: Path, run: str, version: int) -> Path:
    return runs_dir / run / "weights" / f"v{version}"


def check_model(spec: ModelSpec, *, runs_dir: Path) -> None:
    """Cheap checks of a model spec (no model is built, no server contacted): raise :class:`SpecError` naming the
    field."""
    if spec.api_key_env is not None and not os.environ.get(spec.api_key_env):
        raise SpecError(("model", "api_key_env"), f"the environment variable {spec.api_key_env!r} is not set (or "
                        "empty) on the server: set it where the evaluation runs, or leave 'api_key_env' out for a "
                        "server that needs no key")
    if spec.path is not None and not (Path(spec.path).expanduser() / "config.json").is_file():
        raise SpecError(("model", "path"), f"{spec.path!r} is not a model folder on the server (no config.json)")
    if spec.run is not None and spec.version is not None:
        d = weights_dir(runs_dir, spec.run, spec.version)
        if not (d / "config.json").is_file():
            raise SpecError(("model", "version"), f"run {spec.run!r} has no weight version {spec.version} "
                            f"({d} holds no config.json); published versions are in {d.parent}")
    if spec.name is not None and spec.name not in NAMED_MODELS:
        try:
            resolve_model(spec.name)  # a Hugging Face id: a look in the local cache, nothing is built or fetched
        except ConfigError as exc:
            raise SpecError(("model", "name"), str(exc)) from exc
    if spec.tokenizer is not None and spec.tokenizer not in NAMED_MODELS \
            and not Path(spec.tokenizer).expanduser().is_dir():
        if not is_model_ref(spec.tokenizer):
            raise SpecError(("model", "tokenizer"), f"tokenizer {spec.tokenizer!r} is neither a bundled model "
                            f"({', '.join(NAMED_MODELS)}), a Hugging Face id nor a folder on the server")
        try:
            resolve_model(spec.tokenizer, weights=False)
        except ConfigError as exc:
            raise SpecError(("model", "tokenizer"), str(exc)) from exc


def resolve_model_spec(spec: ModelSpec, *, runs_dir: Path) -> ResolvedModel:
    """The model of a spec; bundled models are built on first use, Hugging Face ids are found in the local cache
    (see :func:`agentrl.models.resolve_model`)."""
    check_model(spec, runs_dir=runs_dir)
    if spec.openai_url is not None:
        return ResolvedModel(label=spec.openai_model or spec.openai_url, openai_url=spec.openai_url,
                             openai_model=spec.openai_model, api_key_env=spec.api_key_env,
                             openai_timeout_s=spec.openai_timeout_s or OPENAI_TIMEOUT_S)
    if spec.url is not None:
        return ResolvedModel(label=spec.url, url=spec.url.rstrip("/"), tokenizer=spec.tokenizer)
    if spec.run is not None and spec.version is not None:
        path = weights_dir(runs_dir, spec.run, spec.version).absolute()  # not resolved: its own server
        return ResolvedModel(label=f"{spec.run}@v{spec.version}", path=path, tokenizer=spec.tokenizer,
                             weight_version=spec.version)
    name = spec.name if spec.name is not None else str(spec.path)
    return ResolvedModel(label=name, path=resolve_model(name).resolve(), tokenizer=spec.tokenizer)


class LimitedEngine:
    """An :class:`InferenceEngine` allowing at most ``limit`` generate calls at once (shared by all users)."""

    def __init__(self, inner: InferenceEngine, limit: asyncio.Semaphore) -> None:
        self.inner = inner
        self._limit = limit

    async def generate(self, input_ids: Sequence[int], sampling: SamplingParams, *,
                       sticky_key: str | None = None) -> GenerateResult:
        async with self._limit:
            return await self.inner.generate(input_ids, sampling, sticky_key=sticky_key)

    async def update_weights(self, path: str, version: int) -> None:
        raise EngineError("evaluation engines are shared and read-only: start another server to load new weights")

    async def weight_version(self) -> int:
        return await self.inner.weight_version()

    async def aclose(self) -> None:
        """The pool owns the inner engine; nothing to do."""


class LimitedChatEngine:
    """A :class:`ChatEngine` allowing at most ``limit`` chat calls at once (shared by all users of its server)."""

    def __init__(self, inner: ChatEngine, limit: asyncio.Semaphore) -> None:
        self.inner = inner
        self._limit = limit

    async def chat(self, messages: Sequence[Mapping[str, Any]], sampling: SamplingParams, *,
                   tools: Sequence[Mapping[str, Any]] = ()) -> ChatResult:
        async with self._limit:
            return await self.inner.chat(messages, sampling, tools=tools)

    async def endpoint(self) -> ChatEndpoint:
        """The inner engine's server (an agent's own calls to it do not count against the limit: the evaluation's
        ``max_concurrency`` bounds them)."""
        endpoint = getattr(self.inner, "endpoint", None)
        if endpoint is None:
            raise ConfigError(f"{type(self.inner).__name__} has no endpoint an agent could call")
        return await endpoint()  # type: ignore[no-any-return]

    async def aclose(self) -> None:
        """The lease owns the inner engine; nothing to do."""


class RunningServer(Protocol):
    @property
    def url(self) -> str: ...

    def stop(self) -> None: ...


#: starts a server for a model folder (blocking is fine: it runs in a thread); the default starts SGLang
Launcher = Callable[[Path], Awaitable[RunningServer]]


@dataclass(frozen=True, slots=True)
class EngineLease:
    """An engine and the tokenizer of its model, for the duration of one evaluation (a chat engine and no
    tokenizer for an ``openai_url`` model)."""

    engine: InferenceEngine | ChatEngine
    tokenizer: ChatTokenizer | None
    label: str
    url: str


@dataclass(eq=False)
class _Entry:
    key: str
    ready: asyncio.Future[tuple[SGLangClient, RunningServer | None]]
    limit: asyncio.Semaphore
    refs: int = 0
    last_used: float = field(default_factory=time.monotonic)
    tokenizer: ChatTokenizer | None = None


class ModelServers:
    """One server per evaluated model, started on demand and leased per evaluation; at most ``max_servers`` at
    once (see the module docstring). Not :class:`agentrl.engine.EnginePool`, which routes the requests of one
    model over several servers."""

    def __init__(self, *, max_servers: int = 1, max_inflight: int = 64,
                 server_config: SGLangServerConfig | None = None, log_dir: Path | None = None,
                 launcher: Launcher | None = None) -> None:
        if max_servers < 1 or max_inflight < 1:
            raise ConfigError(f"ModelServers needs max_servers >= 1 and max_inflight >= 1, got "
                              f"{max_servers}, {max_inflight}")
        self.max_servers = max_servers
        self.max_inflight = max_inflight
        self._config = server_config or SGLangServerConfig()
        self._log_dir = log_dir
        self._launch = launcher or self._launch_sglang
        self._entries: dict[str, _Entry] = {}
        self._changed = asyncio.Condition()
        self._tokenizers: dict[str, ChatTokenizer] = {}
        self._chat_limits: dict[str, asyncio.Semaphore] = {}  # per openai_url: its max_inflight calls
        self._tokenizer_lock = asyncio.Lock()  # one load at a time (transformers' lazy imports are not thread-safe)
        self._closed = False
        self.started = 0  # servers started so far (for metrics and tests)

    async def _launch_sglang(self, path: Path) -> RunningServer:
        log = self._log_dir / f"sglang-{path.name}-{int(time.time())}.log" if self._log_dir else None
        server = SGLangServer(self._config.model_copy(update={"model_path": str(path), "port": 0}),
                              log_path=log, name=f"sglang[{path.name}]")
        await asyncio.to_thread(server.start)
        return server

    @contextlib.asynccontextmanager
    async def lease(self, model: ResolvedModel) -> AsyncIterator[EngineLease]:
        """Hold an engine for ``model`` (starting a server if needed) until the block ends."""
        if model.openai_url is not None:
            async with self._chat_lease(model) as lease:
                yield lease
            return
        entry = await self._acquire(model)
        try:
            client, _ = await asyncio.shield(entry.ready)
            if entry.tokenizer is None:
                entry.tokenizer = await self._tokenizer(model, client)
            if model.weight_version is not None:
                await client.set_weight_version(model.weight_version)
            yield EngineLease(engine=LimitedEngine(client, entry.limit), tokenizer=entry.tokenizer,
                              label=model.label, url=client.url)
        finally:
            async with self._changed:
                entry.refs -= 1
                entry.last_used = time.monotonic()
                self._changed.notify_all()

    @contextlib.asynccontextmanager
    async def _chat_lease(self, model: ResolvedModel) -> AsyncIterator[EngineLease]:
        assert model.openai_url is not None
        if self._closed:
            raise EngineError("the model servers are closed")
        api_key = os.environ.get(model.api_key_env) if model.api_key_env else None
        if model.api_key_env and not api_key:
            raise EngineError(f"the environment variable {model.api_key_env!r} holding the API key of "
                              f"{model.openai_url} is not set here")
        limit = self._chat_limits.setdefault(model.openai_url, asyncio.Semaphore(self.max_inflight))
        client = OpenAIChatClient(model.openai_url, model=model.openai_model, api_key=api_key,
                                  timeout_s=model.openai_timeout_s)
        try:
            yield EngineLease(engine=LimitedChatEngine(client, limit), tokenizer=None, label=model.label,
                              url=client.base_url)
        finally:
            await client.aclose()

    async def _acquire(self, model: ResolvedModel) -> _Entry:
        key = f"url:{model.url}" if model.url else f"path:{model.path}"
        async with self._changed:
            while True:
                if self._closed:
                    raise EngineError("the model servers are closed")
                entry = self._entries.get(key)
                if entry is not None and entry.ready.done() and entry.ready.exception() is not None:
                    del self._entries[key]  # a failed start: try again
                    entry = None
                if entry is not None:
                    break
                if model.url is not None or self._servers() < self.max_servers or self._evict_idle():
                    entry = self._create(key, model)
                    break
                await self._changed.wait()  # every server busy with another model
            entry.refs += 1
            return entry

    def _servers(self) -> int:
        return sum(1 for k in self._entries if k.startswith("path:"))

    def _evict_idle(self) -> bool:
        idle = [e for e in self._entries.values() if e.key.startswith("path:") and e.refs == 0 and e.ready.done()]
        if not idle:
            return False
        victim = min(idle, key=lambda e: e.last_used)
        del self._entries[victim.key]
        logger.info("stopping idle engine %s to make room", victim.key)
        asyncio.get_running_loop().create_task(_stop_entry(victim))
        return True

    def _create(self, key: str, model: ResolvedModel) -> _Entry:
        entry = _Entry(key=key, ready=asyncio.get_running_loop().create_future(),
                       limit=asyncio.Semaphore(self.max_inflight))
        self._entries[key] = entry
        asyncio.get_running_loop().create_task(self._start(entry, model))
        return entry

    async def _start(self, entry: _Entry, model: ResolvedModel) -> None:
        try:
            if model.url is not None:
                if not await wait_healthy(model.url, timeout_s=10.0):
                    raise EngineError(f"no SGLang server answers at {model.url} (GET /health failed); start it or "
                                      "fix model.url")
                result: tuple[SGLangClient, RunningServer | None] = (SGLangClient(model.url), None)
            else:
                assert model.path is not None
                server = await self._launch(model.path)
                self.started += 1
                result = (SGLangClient(server.url), server)
        except Exception as exc:  # noqa: BLE001 - handed to every waiter of this entry
            err = exc if isinstance(exc, EngineError) else EngineError(f"could not start a server for "
                                                                       f"{model.label}: {exc!r}")
            entry.ready.set_exception(err)
            async with self._changed:
                self._changed.notify_all()
            return
        if self._closed:
            await _stop_entry_result(result)
            entry.ready.set_exception(EngineError("the model servers were closed while a server started"))
            return
        entry.ready.set_result(result)

    async def _tokenizer(self, model: ResolvedModel, client: SGLangClient) -> ChatTokenizer:
        source = model.tokenizer
        if source is None and model.path is not None:
            source = str(model.path)
        if source is None:
            source = await _served_model_path(client.url)
        async with self._tokenizer_lock:
            if is_model_ref(source) and not Path(source).expanduser().is_dir():
                source = str(await asyncio.to_thread(resolve_model, source, weights=False))
            folder = source
            if folder not in self._tokenizers:
                self._tokenizers[folder] = await asyncio.to_thread(ChatTokenizer.from_pretrained, folder)
            return self._tokenizers[folder]

    def status(self) -> list[dict[str, Any]]:
        """What the pool holds (for the health endpoint)."""
        return [{"engine": e.key, "ready": e.ready.done() and e.ready.exception() is None, "leases": e.refs}
                for e in self._entries.values()]

    async def aclose(self) -> None:
        """Stop every server the pool started."""
        async with self._changed:
            self._closed = True
            entries = list(self._entries.values())
            self._entries.clear()
            self._changed.notify_all()
        await asyncio.gather(*(_stop_entry(e) for e in entries), return_exceptions=True)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


async def _stop_entry(entry: _Entry) -> None:
    try:
        result = await entry.ready
    except Exception:  # noqa: BLE001 - it never started: nothing to stop
        return
    await _stop_entry_result(result)


async def _stop_entry_result(result: tuple[SGLangClient, RunningServer | None]) -> None:
    client, server = result
    await client.aclose()
    if server is not None:
        await asyncio.to_thread(server.stop)


async def _served_model_path(url: str, timeout_s: float = 10.0) -> str:
    """The model folder a running SGLang server reports (its tokenizer is what we encode with)."""
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as http, \
                http.get(url + "/get_model_info") as resp:
            info = await resp.json(content_type=None) if resp.status == 200 else {}
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        raise EngineError(f"cannot reach the SGLang server at {url} ({exc!r}); is it running?") from exc
    for key in ("tokenizer_path", "model_path"):
        path = info.get(key) if isinstance(info, dict) else None
        if path and (Path(path) / "tokenizer_config.json").is_file():
            return str(path)
    raise SpecError(("model", "tokenizer"), f"the server at {url} serves {info.get('model_path')!r}, which is not a "
                    "folder here; give 'model.tokenizer' (a bundled name or a tokenizer folder)")
