"""Webhooks of the evaluation service: when a task ends, its final state is POSTed to the spec's ``webhook_url``.

    POST <webhook_url>
    Content-Type: application/json
    X-Agentrl-Event: eval.finished
    X-Agentrl-Delivery: <uuid>                     (the same on every retry of one delivery)
    X-Agentrl-Signature: sha256=<hex>              HMAC-SHA256 of the raw body with the server's webhook secret
    {"id", "status", "progress", "metrics", "error", "finished_at"}

A receiver recomputes the HMAC over the bytes it received and compares in constant time
(``hmac.compare_digest``). Delivery is at least once, in the background: each POST has ``webhook_timeout_s``;
connection errors, 429 and 5xx are retried (:class:`agentrl.retry.Retry`, ``webhook_attempts`` tries in all);
another answer ends the delivery (a 4xx is the receiver's verdict, not retried). A delivery that fails is
logged, never raised: the task's outcome does not depend on its webhook.

Only hosts the server allows are called (checked at submission, 422 otherwise): those of its ``model_hosts``
(:class:`agentrl.api.policy.SpecPolicy`; default loopback), the list that bounds ``model.url``.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import uuid
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import httpx

from agentrl.api.base import WEBHOOK_SECRET_ENV, ApiSettings
from agentrl.eval.base import SpecError
from agentrl.retry import Retry

logger = logging.getLogger(__name__)

SIGNATURE_HEADER = "X-Agentrl-Signature"
EVENT = "eval.finished"


def sign(secret: str, body: bytes) -> str:
    """The signature header's value: ``sha256=`` + the hex HMAC-SHA256 of ``body`` keyed by ``secret``."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def check_webhook(url: str | None, settings: ApiSettings, host_allowed: Callable[[str], bool]) -> None:
    """Raise a SpecError naming ``webhook_url`` unless this server can sign webhooks and may call its host
    (``host_allowed``: the server's model-host allow-list)."""
    if url is None:
        return
    if settings.webhook_secret is None:
        raise SpecError(("webhook_url",), "this server has no webhook secret to sign webhooks with (set "
                        f"{WEBHOOK_SECRET_ENV} where it runs), so it sends none; drop webhook_url or follow the "
                        "task with GET /v1/evals/{id}/events")
    host = urlsplit(url).hostname or ""
    if not host_allowed(host):
        raise SpecError(("webhook_url",), f"webhook host {host!r} is not allowed: it is not on this server's "
                        f"model_hosts ({', '.join(settings.model_hosts) or 'none'}); ask the operator to add it")


class _Retryable(Exception):
    def __init__(self, status: int) -> None:
        super().__init__(f"HTTP {status}")
        self.status = status


class WebhookSender:
    """Delivers webhooks in background tasks (see the module docstring). Close with ``aclose``."""

    def __init__(self, settings: ApiSettings, *, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.secret = settings.webhook_secret
        self.timeout_s = settings.webhook_timeout_s
        self.retry = Retry(attempts=settings.webhook_attempts, base_delay_s=0.5, max_delay_s=8.0, jitter=0.5)
        self._http = httpx.AsyncClient(timeout=settings.webhook_timeout_s, transport=transport,
                                       follow_redirects=False, headers={"User-Agent": "agentrl-webhook/1"})
        self._pending: set[asyncio.Task[bool]] = set()

    def schedule(self, url: str, payload: dict[str, Any]) -> None:
        """Deliver ``payload`` to ``url`` in the background."""
        task = asyncio.get_running_loop().create_task(self.deliver(url, payload), name=f"webhook-{payload.get('id')}")
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def deliver(self, url: str, payload: dict[str, Any]) -> bool:
        """POST ``payload`` until it is taken (2xx/3xx) or refused; True when taken. Never raises (but cancels)."""
        if self.secret is None:
            logger.warning("webhook to %s not sent: no webhook secret is set", url)
            return False
        body = json.dumps(payload, allow_nan=False).encode()
        headers = {"Content-Type": "application/json", "X-Agentrl-Event": EVENT,
                   "X-Agentrl-Delivery": uuid.uuid4().hex, SIGNATURE_HEADER: sign(self.secret, body)}

        async def post() -> int:
            resp = await self._http.post(url, content=body, headers=headers)
            if resp.status_code == 429 or resp.status_code >= 500:
                raise _Retryable(resp.status_code)
            return resp.status_code

        deadline = self.timeout_s * self.retry.attempts + self.retry.max_delay_s * (self.retry.attempts - 1)
        try:
            async with asyncio.timeout(deadline):
                status = await self.retry.call(post, retry_on=(httpx.TransportError, _Retryable),
                                               what=f"webhook POST {url}", log_level=logging.INFO)
        except (httpx.HTTPError, _Retryable, TimeoutError) as exc:
            logger.warning("webhook of task %s to %s failed: %r", payload.get("id"), url, exc)
            return False
        if status >= 400:
            logger.warning("webhook of task %s to %s refused: HTTP %d", payload.get("id"), url, status)
            return False
        logger.info("webhook of task %s delivered to %s", payload.get("id"), url)
        return True

    async def aclose(self) -> None:
        for task in list(self._pending):
            task.cancel()
        await asyncio.gather(*self._pending, return_exceptions=True)
        await self._http.aclose()
