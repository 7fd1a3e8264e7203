"""The gateway's settings (:class:`GatewayConfig`), in a module of their own: a run's configuration holds them
(``gateway:``), so the trainer process reads them without the gateway, its tool parsers or FastAPI."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field


class GatewayConfig(BaseModel):
    """Settings of one gateway (its HTTP server's are the CLI's)."""

    model_config = ConfigDict(extra="forbid")

    model_name: str = "agentrl"  # what /v1/models lists; requests may name any model
    # agentrl.env.tool_parsers: "builtin" (its BUILTIN; a test checks they agree) or one of SGLang's parser names
    tool_parser: str = "builtin"
    max_tokens: Annotated[int, Field(ge=1)] = 1024  # when a request gives none
    # generations the engine aborted (weight update) continued so often; a session's limits may set their own
    max_resumes: Annotated[int, Field(ge=0)] = 4
