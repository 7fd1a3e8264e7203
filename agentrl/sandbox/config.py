"""Which sandbox a process uses (:class:`SandboxConfig`): a run's ``sandbox:`` section and the evaluation service's
sandbox. A module of its own, pydantic only, so the trainer process reads a run's configuration without the
sandbox."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from agentrl.errors import ConfigError

if TYPE_CHECKING:
    from agentrl.sandbox.base import Sandbox


class SandboxConfig(BaseModel):
    """A sandbox backend and how many programs it runs at once; :meth:`build` makes it."""

    model_config = ConfigDict(extra="forbid")

    backend: Literal["local", "docker", "remote", "auto"] = "local"  # auto: docker if an engine answers, else local
    url: str | None = None  # the sandbox server of backend "remote" (ignored by the others)
    max_concurrency: Annotated[int, Field(ge=1)] = 8  # programs running at once (remote: the server's own bound applies)
    options: dict[str, Any] = Field(default_factory=dict)  # more of the backend's constructor options

    def build(self) -> Sandbox:
        """The sandbox (:func:`agentrl.sandbox.make_sandbox`); nothing starts until its first use."""
        from agentrl.sandbox import make_sandbox

        if self.backend == "remote":
            if not self.url:
                raise ConfigError("sandbox backend 'remote' needs the sandbox server's url (sandbox.url)")
            return make_sandbox("remote", **{**self.options, "url": self.url})
        return make_sandbox(self.backend, **{"max_concurrency": self.max_concurrency, **self.options})
