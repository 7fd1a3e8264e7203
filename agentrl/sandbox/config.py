"""Which sandbox a process uses (:class:`SandboxConfig`): a run's ``sandbox:`` section and the evaluation service's
sandbox. A module of its own, pydantic only, so the trainer process reads a run's configuration without the
sandbox."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from agentrl.errors import ConfigError

if TYPE_CHECKING:
    from agentrl.sandbox.base import Sandbox


class FleetConfig(BaseModel):
    """How a :class:`agentrl.sandbox.fleet.SandboxFleet` watches its servers (``sandbox.fleet``)."""

    model_config = ConfigDict(extra="forbid")

    health_interval_s: Annotated[float, Field(gt=0)] = 5.0  # GET /v1/ping on every server this often
    health_timeout_s: Annotated[float, Field(gt=0)] = 5.0  # a ping not answered by then is a failure
    failures_to_down: Annotated[int, Field(ge=1)] = 2  # failed pings in a row that take a server out


def check_url(url: str, where: str) -> str:
    """``url`` stripped, if it is an http(s) URL with a host; else a ConfigError naming ``where`` it came from."""
    url = url.strip()
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{where}: expected a sandbox server's URL like http://host:8080, got {url!r}")
    return url


class SandboxConfig(BaseModel):
    """A sandbox backend and how many programs it runs at once; :meth:`build` makes it.

    Backend ``remote`` talks to sandbox servers (``agentrl sandbox serve``): ``url`` names one (a
    :class:`RemoteSandbox`) or several, comma-separated or as a list; ``urls_file`` reads them from a file, one per
    line (``#`` comments). Several servers make a :class:`agentrl.sandbox.fleet.SandboxFleet` (``fleet``: its
    health checks); ``options`` go to each server's client."""

    model_config = ConfigDict(extra="forbid")

    backend: Literal["local", "docker", "remote", "auto"] = "local"  # auto: docker if an engine answers, else local
    url: str | list[str] | None = None  # the sandbox server(s) of backend "remote" (ignored by the others)
    urls_file: str | None = None  # instead of url: a file with one server URL per line (read when built)
    fleet: FleetConfig = Field(default_factory=FleetConfig)  # several servers: their health checks
    max_concurrency: Annotated[int, Field(ge=1)] = 8  # programs running at once (remote: the server's own bound applies)
    options: dict[str, Any] = Field(default_factory=dict)  # more of the backend's constructor options

    @field_validator("url")
    @classmethod
    def _urls_are_urls(cls, value: str | list[str] | None) -> str | list[str] | None:
        if value is not None:
            urls = split_urls(value)
            if not urls:
                raise ValueError("sandbox.url is empty: give a server's URL (several: comma-separated or a list)")
            for u in urls:
                check_url(u, "sandbox.url")
        return value

    @model_validator(mode="after")
    def _one_source(self) -> SandboxConfig:
        if self.url is not None and self.urls_file is not None:
            raise ValueError("give the sandbox servers either as sandbox.url or in sandbox.urls_file, not both")
        return self

    def server_urls(self) -> list[str]:
        """The servers of backend ``remote``: from ``url``, or read from ``urls_file`` (ConfigError if it cannot be
        read, holds no URL or a line that is not one, or names a server twice)."""
        if self.urls_file is None:
            urls = split_urls(self.url) if self.url is not None else []
        else:
            try:
                lines = Path(self.urls_file).read_text().splitlines()
            except OSError as exc:
                raise ConfigError(f"sandbox.urls_file {self.urls_file!r} cannot be read: {exc}") from None
            urls = []
            for i, line in enumerate(lines, 1):
                if text := line.split("#", 1)[0].strip():
                    urls.append(check_url(text, f"sandbox.urls_file {self.urls_file!r} line {i}"))
            if not urls:
                raise ConfigError(f"sandbox.urls_file {self.urls_file!r} lists no server URL (one per line)")
        seen = {u.rstrip("/") for u in urls}
        if len(seen) < len(urls):
            raise ConfigError(f"sandbox servers are listed twice: {urls}")
        return urls

    def build(self) -> Sandbox:
        """The sandbox (:func:`agentrl.sandbox.make_sandbox`); nothing starts until its first use."""
        from agentrl.sandbox import make_sandbox

        if self.backend == "remote":
            urls = self.server_urls()
            if not urls:
                raise ConfigError("sandbox backend 'remote' needs the sandbox server's url (sandbox.url, several "
                                  "comma-separated, or sandbox.urls_file)")
            if len(urls) == 1:
                return make_sandbox("remote", **{**self.options, "url": urls[0]})
            return make_sandbox("remote", **{**self.options, "urls": urls, "fleet": self.fleet})
        return make_sandbox(self.backend, **{"max_concurrency": self.max_concurrency, **self.options})


def split_urls(value: str | list[str]) -> list[str]:
    """One URL, several comma-separated, or a list of them (each may hold commas too), stripped, empties dropped."""
    items = value if isinstance(value, list) else [value]
    return [u.strip() for item in items for u in item.split(",") if u.strip()]
