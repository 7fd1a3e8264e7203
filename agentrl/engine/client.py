"""aiohttp client for one SGLang server's native API (``/generate`` with token ids, weight updates, control).

Every call is bounded by ONE deadline (``Timeouts``) that covers its retries and backoff sleeps, so no call can
outlive it; how often and how patiently it retries is the injected :class:`agentrl.retry.Retry`. Only failures
that cannot have had an effect are retried (connection refused, 502/503 before the server accepted the request,
and ``stale_connection_retries`` times, at once, a pooled keep-alive connection the server had just closed; idle
connections are dropped after ``keepalive_s`` = 4 s, before SGLang's uvicorn drops them at 5 s); the rest raise
:class:`EngineError` naming the server and the call (:class:`EngineUnavailable` when the server could not be
reached or dropped the connection). A ``generate`` that times out or is cancelled is also aborted on the server
(``/abort_request`` with its ``rid``), so no orphaned request keeps the server busy.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Literal, Self

import aiohttp

from agentrl.engine.base import (
    PAUSE_MODES,
    EngineFinish,
    EngineTimeout,
    EngineUnavailable,
    GenerateResult,
    PauseMode,
    SamplingParams,
)
from agentrl.engine.config import Timeouts
from agentrl.errors import EngineError
from agentrl.retry import Retry

logger = logging.getLogger(__name__)

RETRYABLE_STATUS = frozenset({502, 503})
Health = Literal["ok", "unreachable", "unresponsive"]


class _Busy(EngineError):
    """The server answered 502/503: it did not act on the request (retried)."""


def parse_version(value: Any) -> int:
    """SGLang reports versions as strings; ours are integers. ``default`` (never set) is version 0."""
    if value in (None, "", "default"):
        return 0
    try:
        return int(value)
    except (TypeError, ValueError):
        raise EngineError(f"weight version {value!r} is not an integer (agentrl numbers versions 0, 1, 2, …)")


class SGLangClient:
    """Client for one SGLang server. Implements :class:`agentrl.engine.base.ControllableEngine`."""

    def __init__(
        self,
        url: str,
        *,
        timeouts: Timeouts = Timeouts(),
        retry: Retry = Retry(),
        max_connections: int = 256,
        keepalive_s: float = 4.0,
        stale_connection_retries: int = 1,
    ) -> None:
        self.url = url.rstrip("/")
        self.timeouts = timeouts
        self.retry = retry
        # a pooled keep-alive connection the server closed just as we reused it (uvicorn closes idle ones after
        # 5 s) fails before the request reached the server: sent again at once, on a new connection, this many
        # times per call, apart from ``retry``'s attempts
        self._stale_connection_retries = stale_connection_retries
        self._max_connections = max_connections
        self._keepalive_s = keepalive_s  # below the server's (SGLang/uvicorn: 5 s), so we close idle ones first
        self._session: aiohttp.ClientSession | None = None
        self._paused: PauseMode | None = None
        self._background: set[asyncio.Task[None]] = set()

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # no aiohttp timeout: every call has its own asyncio deadline (aiohttp's default would cut at 300 s)
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._max_connections, keepalive_timeout=self._keepalive_s),
                timeout=aiohttp.ClientTimeout(total=None),
            )
        return self._session

    async def _call(self, method: str, path: str, *, json: Any = None, timeout_s: float,
                    resend: Callable[[], Any] | None = None) -> Any:
        """One call with its retries, bounded by ``timeout_s``. ``resend`` makes the body of every send after the
        first (a /generate sent again carries a fresh rid: the server may have received the first one and still be
        running it, and SGLang refuses a duplicate rid with a 400)."""
        what = f"{method} {self.url}{path}"
        try:
            async with asyncio.timeout(timeout_s):
                return await self._attempts(method, path, what, json, resend)
        except TimeoutError as exc:
            raise EngineTimeout(f"{what} timed out after {timeout_s:g}s (retries included); is the server "
                              "overloaded or paused?") from exc

    async def _attempts(self, method: str, path: str, what: str, json: Any,
                        resend: Callable[[], Any] | None = None) -> Any:
        stale_left = self._stale_connection_retries
        sends = 0

        async def attempt() -> Any:
            nonlocal stale_left, sends, json
            while True:
                if sends and resend is not None:
                    json = resend()
                sends += 1
                try:
                    async with self._http().request(method, self.url + path, json=json) as resp:
                        body = await resp.read()
                except aiohttp.ClientConnectorError:  # nothing reached the server: the policy retries it
                    raise
                except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
                    if stale_left > 0:  # most likely a stale pooled connection; a dead server refuses the next try
                        stale_left -= 1
                        logger.debug("%s: connection dropped (%r), sending again on a new connection", what, exc)
                        continue
                    raise EngineUnavailable(f"{what}: the server dropped the connection ({exc!r}); did it die?") \
                        from exc
                except aiohttp.ClientError as exc:
                    raise EngineError(f"{what} failed: {exc!r}") from exc
                if resp.status in RETRYABLE_STATUS:
                    raise _Busy(f"{what} answered {resp.status}: {body[:300]!r}", status=resp.status)
                if resp.status >= 400:
                    raise EngineError(f"{what} failed with HTTP {resp.status}: {body[:500].decode(errors='replace')}",
                                      status=resp.status)
                return _decode(body)

        try:
            return await self.retry.call(attempt, retry_on=(aiohttp.ClientConnectorError, _Busy), what=what)
        except aiohttp.ClientConnectorError as exc:
            raise EngineUnavailable(f"{what}: cannot connect after {self.retry.attempts} attempts: {exc!r}") from exc
        except _Busy as exc:
            raise EngineError(f"{what} failed after {self.retry.attempts} attempts: {exc}", status=exc.status) from exc

    async def generate(
        self, input_ids: Sequence[int], sampling: SamplingParams, *, sticky_key: str | None = None
    ) -> GenerateResult:
        del sticky_key  # one server: nothing to route
        t0 = time.monotonic()
        out = await self._generate_call({"input_ids": list(input_ids), "sampling_params": sampling.to_sglang(),
                                         "return_logprob": True, "logprob_start_len": -1})
        return parse_generate(out, url=self.url, latency_s=time.monotonic() - t0)

    async def prefill(self, input_ids: Sequence[int], *, sticky_key: str | None = None) -> None:
        """Compute and cache the KV of ``input_ids`` without generating (a prefill-only request, ``max_new_tokens``
        0, as SGLang's own parallel sampling sends first): requests that then start with these tokens find them in
        the server's prefix cache. Samples of one prompt sent together would each prefill it: SGLang matches the cache
        when it schedules a request, and none of them is cached before their shared batch has run."""
        del sticky_key  # one server: nothing to route
        await self._generate_call({"input_ids": list(input_ids), "sampling_params": {"max_new_tokens": 0}})

    async def _generate_call(self, body: dict[str, Any]) -> Any:
        """One ``/generate`` request: each send with a fresh rid, and the request aborted on the server whenever
        we stop waiting for it while it may still run there."""
        rids = [uuid.uuid4().hex]

        def payload() -> dict[str, Any]:
            return {"rid": rids[-1], **body}

        def resend() -> dict[str, Any]:
            self._abort_in_background(rids[-1])  # the server may have received the last send: stop it
            rids.append(uuid.uuid4().hex)
            return payload()

        try:
            return await self._call("POST", "/generate", json=payload(), timeout_s=self.timeouts.generate_s,
                                    resend=resend)
        except (EngineError, asyncio.CancelledError) as exc:
            if not isinstance(exc, EngineUnavailable):
                self._abort_in_background(rids[-1])  # the server may still be generating it
            raise

    def _abort_in_background(self, rid: str) -> None:
        async def abort() -> None:
            try:
                await self._call("POST", "/abort_request", json={"rid": rid}, timeout_s=self.timeouts.control_s)
            except EngineError as exc:
                logger.debug("could not abort request %s on %s: %s", rid, self.url, exc)

        task = asyncio.get_running_loop().create_task(abort())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def update_weights(self, path: str, version: int) -> None:
        """Load weights from a local HF folder and report them as ``version``. Drain: the server finishes the
        requests in flight first, unless it is paused (then at once). While paused ``in_place`` the KV cache is
        kept (it cannot be flushed under frozen requests)."""
        out = await self._call(
            "POST", "/update_weights_from_disk",
            json={"model_path": path, "weight_version": str(version), "flush_cache": self._paused != "in_place"},
            timeout_s=self.timeouts.update_weights_s,
        )
        if not out.get("success", False):
            raise EngineError(f"{self.url} failed to load weights v{version} from {path}: {out.get('message')}")

    # -- weights through a process group (SGLang's RL update path; agentrl.engine.weight_sync drives the order) --

    async def init_weight_group(self, *, address: str, port: int, rank: int, world_size: int, group: str,
                                backend: str, timeout_s: float) -> None:
        """Join the trainer's group as ``rank``; returns once every member joined (SGLang blocks until then)."""
        await self._checked("/init_weights_update_group", {
            "master_address": address, "master_port": port, "rank_offset": rank, "world_size": world_size,
            "group_name": group, "backend": backend}, f"join weight group {group}", timeout_s)

    async def destroy_weight_group(self, group: str, *, timeout_s: float | None = None) -> None:
        await self._checked("/destroy_weights_update_group", {"group_name": group}, f"leave weight group {group}",
                            timeout_s or self.timeouts.control_s)

    async def begin_weight_update(self, *, timeout_s: float | None = None) -> None:
        """Open SGLang's weight-update session (0.5.23 refuses distributed updates outside one). Unless the server
        is paused this waits for the requests in flight, as a disk update does."""
        await self._checked("/begin_weight_update", {}, "begin a weight update",
                            timeout_s or self.timeouts.update_weights_s)

    async def end_weight_update(self, *, timeout_s: float | None = None) -> None:
        await self._checked("/end_weight_update", {}, "end a weight update", timeout_s or self.timeouts.control_s)

    async def receive_weight_bucket(self, *, group: str, names: Sequence[str], dtype: str,
                                    shapes: Sequence[Sequence[int]], version: int | None, timeout_s: float) -> None:
        """Receive one flattened bucket the trainer broadcasts and load it; ``version`` (the last bucket's) becomes
        the served version and flushes the cache (unless paused ``in_place``: frozen requests keep it)."""
        last = version is not None
        await self._checked("/update_weights_from_distributed", {
            "names": list(names), "dtypes": [dtype] * len(names), "shapes": [list(s) for s in shapes],
            "group_name": group, "load_format": "flattened_bucket",
            "flush_cache": last and self._paused != "in_place",
            **({"weight_version": str(version)} if last else {})}, f"receive weights ({len(names)} tensors)",
            timeout_s)

    async def load_weight_tensors(self, payload: str, *, version: int, timeout_s: float) -> None:
        """Load weights from memory this host shares (``payload``: handles to it, from the trainer's
        :class:`agentrl.weight_sync.TensorOffer`) and serve them as ``version``; inside a weight-update session,
        flushing the cache as :meth:`receive_weight_bucket` does."""
        await self._checked("/update_weights_from_tensor", {
            "serialized_named_tensors": [payload], "load_format": None,
            "flush_cache": self._paused != "in_place", "weight_version": str(version)},
            f"load weights v{version} from shared memory", timeout_s)

    async def _checked(self, path: str, body: dict[str, Any], what: str, timeout_s: float) -> None:
        out = await self._call("POST", path, json=body, timeout_s=timeout_s)
        if not out.get("success", False):
            raise EngineError(f"{self.url} could not {what}: {out.get('message') or out}")

    async def set_weight_version(self, version: int) -> None:
        out = await self._call(
            "POST", "/update_weight_version", json={"new_version": str(version)}, timeout_s=self.timeouts.control_s
        )
        if not out.get("success", False):
            raise EngineError(f"{self.url} refused weight version {version}: {out.get('message')}")

    async def weight_version(self) -> int:
        info = await self._call("GET", "/model_info", timeout_s=self.timeouts.control_s)
        return parse_version(info.get("weight_version"))

    async def health(self, timeout_s: float | None = None) -> bool:
        """True if ``/health`` answers 200 within ``timeout_s`` (default: the control timeout); never raises."""
        return await self.probe(timeout_s) == "ok"

    async def probe(self, timeout_s: float | None = None) -> Health:
        """``/health`` as the pool reads it: ``ok``; ``unreachable`` (nobody listens: connection refused or reset,
        the process is gone); ``unresponsive`` (no 200 in time: busy or hung, e.g. SGLang's 503 "no response from
        the detokenizer" on a starved machine). Never raises."""
        try:
            async with asyncio.timeout(timeout_s or self.timeouts.control_s):
                async with self._http().get(self.url + "/health") as resp:
                    await resp.read()
                    return "ok" if resp.status == 200 else "unresponsive"
        except (aiohttp.ClientConnectorError, ConnectionRefusedError):
            return "unreachable"
        except (aiohttp.ClientError, OSError, TimeoutError):
            return "unresponsive"

    async def pause(self, mode: PauseMode = "abort") -> None:
        """``/pause_generation``; new requests wait on the server until :meth:`resume` (see ``PauseMode``)."""
        if mode not in PAUSE_MODES:
            raise EngineError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        await self._call("POST", "/pause_generation", json={"mode": mode}, timeout_s=self.timeouts.control_s)
        self._paused = mode

    async def resume(self) -> None:
        await self._call("POST", "/continue_generation", json={}, timeout_s=self.timeouts.control_s)
        self._paused = None

    @property
    def paused(self) -> PauseMode | None:
        return self._paused

    async def abort(self, rid: str) -> None:
        await self._call("POST", "/abort_request", json={"rid": rid}, timeout_s=self.timeouts.control_s)

    async def abort_all(self) -> None:
        await self._call("POST", "/abort_request", json={"abort_all": True}, timeout_s=self.timeouts.control_s)

    async def release_memory(self) -> None:
        """``/release_memory_occupation``: SGLang frees its weights and KV cache for another process on its GPU
        (started with ``--enable-memory-saver``; the server must be idle) until :meth:`resume_memory`. GPU only: a
        CPU server of SGLang 0.5.23 dies of it (its scheduler calls ``torch.cuda.synchronize``), so callers check
        the device first (:func:`agentrl.launcher.colocation.hands_over_memory`)."""
        await self._call("POST", "/release_memory_occupation", json={}, timeout_s=self.timeouts.update_weights_s)

    async def resume_memory(self) -> None:
        """``/resume_memory_occupation``: take back what :meth:`release_memory` freed."""
        await self._call("POST", "/resume_memory_occupation", json={}, timeout_s=self.timeouts.update_weights_s)

    async def flush_cache(self, *, wait_s: float = 0.0) -> None:
        """``/flush_cache``: empty the server's prefix cache. SGLang flushes only when no request is running or
        waiting; with ``wait_s`` > 0 it waits up to that long for such a moment (its own deferred flush, the
        ``timeout`` query), else it refuses at once. A refusal raises :class:`EngineError` saying why."""
        if wait_s < 0:
            raise ValueError(f"wait_s must be >= 0, got {wait_s}")
        path = f"/flush_cache?timeout={wait_s:g}" if wait_s else "/flush_cache"
        try:
            await self._call("POST", path, timeout_s=self.timeouts.control_s + wait_s)
        except EngineError as exc:
            if exc.status != 400:
                raise
            raise EngineError(f"{self.url} did not flush its cache: requests were running or waiting"
                              f"{f' for all of {wait_s:g}s' if wait_s else ' (wait_s=0)'}; {exc}") from exc

    async def aclose(self) -> None:
        if self._background:
            await asyncio.wait(set(self._background), timeout=self.timeouts.control_s)
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _decode(body: bytes) -> Any:
    import json

    if not body:
        return {}
    try:
        return json.loads(body)
    except ValueError:
        return {"text": body.decode(errors="replace")}


def parse_generate(out: Any, *, url: str, latency_s: float = 0.0) -> GenerateResult:
    """Turn SGLang's ``/generate`` JSON into a :class:`GenerateResult`; per-token versions from its spans."""
    if isinstance(out, list):
        if len(out) != 1:
            raise EngineError(f"{url}/generate returned {len(out)} results for one prompt")
        out = out[0]
    try:
        meta = out["meta_info"]
        output_ids = list(out["output_ids"])
        lp = meta["output_token_logprobs"]
    except (KeyError, TypeError) as exc:
        raise EngineError(f"{url}/generate answered without output_ids/logprobs: {str(out)[:300]}") from exc
    if len(lp) != len(output_ids) or any(int(e[1]) != t for e, t in zip(lp, output_ids)):
        raise EngineError(f"{url}/generate: logprobs do not line up with output_ids ({len(lp)} vs {len(output_ids)})")
    logprobs = [float(e[0]) for e in lp]
    versions = _versions_per_token(meta, len(output_ids))
    reason = meta.get("finish_reason") or {}
    kind = reason.get("type") if isinstance(reason, dict) else str(reason)
    finish = {"length": EngineFinish.LENGTH, "abort": EngineFinish.ABORT}.get(kind or "", EngineFinish.STOP)
    matched = reason.get("matched") if isinstance(reason, dict) else None
    return GenerateResult(
        output_ids=output_ids, logprobs=logprobs, weight_versions=versions, finish=finish,
        matched_stop=matched, text=out.get("text", ""), latency_s=latency_s, meta=meta,
    )


def _versions_per_token(meta: dict[str, Any], n: int) -> list[int]:
    spans = meta.get("weight_versions")
    if spans:
        versions = [parse_version(meta.get("weight_version"))] * n
        for span in spans:
            v = parse_version(span.get("version"))
            for i in range(max(0, int(span.get("start", 0))), min(n, int(span.get("end", n)))):
                versions[i] = v
        return versions
    return [parse_version(meta.get("weight_version"))] * n
