"""The agent gateway: OpenAI- and Anthropic-compatible chat endpoints per session, token-exact (the ids the model
sampled are kept; a later request is bridged onto them or forks a new branch at the first differing token).

Public names load on first use (``agentrl._lazy``): the session store and the core need no FastAPI, and a run's
configuration reads the settings (:mod:`agentrl.gateway.config`) without the rest.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agentrl._lazy import lazy_exports

if TYPE_CHECKING:
    from agentrl.gateway.app import create_app
    from agentrl.gateway.base import (
        CallOut,
        ChatCall,
        Completion,
        ContinuityError,
        SessionClosed,
        SessionLimits,
        SessionNotFound,
    )
    from agentrl.gateway.config import GatewayConfig
    from agentrl.gateway.core import Gateway
    from agentrl.gateway.local import LocalGateway
    from agentrl.gateway.session import Branch, Session, SessionStore, TurnRecord

_HOME = {
    **dict.fromkeys(["CallOut", "ChatCall", "Completion", "ContinuityError", "SessionClosed", "SessionLimits",
                     "SessionNotFound"], "base"),
    "GatewayConfig": "config",
    "LocalGateway": "local",
    "Gateway": "core",
    "create_app": "app",
    **dict.fromkeys(["Branch", "Session", "SessionStore", "TurnRecord"], "session"),
}

__all__ = [
    "Branch", "CallOut", "ChatCall", "Completion", "ContinuityError", "Gateway", "GatewayConfig", "LocalGateway", "Session",
    "SessionClosed", "SessionLimits", "SessionNotFound", "SessionStore", "TurnRecord", "create_app",
]

__getattr__, __dir__ = lazy_exports(__name__, _HOME)
