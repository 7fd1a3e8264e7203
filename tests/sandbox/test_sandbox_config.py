"""SandboxConfig: one model for a run's `sandbox:` section and the evaluation service's sandbox; what it builds."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from agentrl.api import ApiSettings
from agentrl.errors import ConfigError
from agentrl.launcher.config import RunConfig
from agentrl.sandbox import LocalSandbox, RemoteSandbox, SandboxConfig


def test_the_run_and_the_evaluation_service_share_one_sandbox_model() -> None:
    assert RunConfig.model_fields["sandbox"].annotation is SandboxConfig
    assert ApiSettings.model_fields["sandbox"].annotation is SandboxConfig
    assert not [f for f in ApiSettings.model_fields if f.startswith("sandbox_") or f == "max_sandbox"]


def test_build_makes_the_backend_with_its_options() -> None:
    local = SandboxConfig(max_concurrency=3, options={"max_sessions": 5}).build()
    assert isinstance(local, LocalSandbox) and local._runs._value == 3  # type: ignore[attr-defined]
    remote = SandboxConfig(backend="remote", url="http://127.0.0.1:9/", options={"timeout_s": 5.0}).build()
    assert isinstance(remote, RemoteSandbox) and remote.url == "http://127.0.0.1:9"
    with pytest.raises(ConfigError, match="needs the sandbox server's url"):
        SandboxConfig(backend="remote").build()


def test_several_servers_make_a_fleet(tmp_path: Path) -> None:
    from agentrl.sandbox import SandboxFleet

    for url in ("http://a:1, http://b:2", ["http://a:1", "http://b:2"]):
        fleet = SandboxConfig(backend="remote", url=url, options={"token": "t"},
                              fleet={"health_interval_s": 1.5}).build()
        assert isinstance(fleet, SandboxFleet) and fleet.urls == ["http://a:1", "http://b:2"]
        assert fleet.config.health_interval_s == 1.5
    listing = tmp_path / "servers.txt"
    listing.write_text("# the sandbox fleet\nhttp://a:1\n\nhttp://b:2  # the second\n")
    fleet = SandboxConfig(backend="remote", urls_file=str(listing)).build()
    assert isinstance(fleet, SandboxFleet) and fleet.urls == ["http://a:1", "http://b:2"]
    one = SandboxConfig(backend="remote", url=["http://a:1"]).build()
    assert isinstance(one, RemoteSandbox)


@pytest.mark.parametrize(("fields", "message"), [
    ({"url": "a:1"}, "expected a sandbox server's URL like http://host:8080, got 'a:1'"),
    ({"url": "http://a:1,ftp://b"}, "got 'ftp://b'"),
    ({"url": " , "}, "sandbox.url is empty"),
    ({"url": "http://a:1", "urls_file": "x.txt"}, "either as sandbox.url or in sandbox.urls_file"),
    ({"fleet": {"failures_to_down": 0}}, "greater than or equal to 1"),
    ({"fleet": {"interval": 1}}, "Extra inputs are not permitted"),
])
def test_bad_server_lists_are_refused_with_what_was_expected(fields: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=re.escape(message)):
        SandboxConfig(backend="remote", **fields)


def test_a_bad_urls_file_says_which_line(tmp_path: Path) -> None:
    listing = tmp_path / "servers.txt"
    with pytest.raises(ConfigError, match="cannot be read"):
        SandboxConfig(backend="remote", urls_file=str(listing)).build()
    listing.write_text("# none yet\n")
    with pytest.raises(ConfigError, match="lists no server URL"):
        SandboxConfig(backend="remote", urls_file=str(listing)).build()
    listing.write_text("http://a:1\nlocalhost:8080\n")
    with pytest.raises(ConfigError, match="line 2: expected a sandbox server's URL"):
        SandboxConfig(backend="remote", urls_file=str(listing)).build()
    listing.write_text("http://a:1\nhttp://a:1/\n")
    with pytest.raises(ConfigError, match="listed twice"):
        SandboxConfig(backend="remote", urls_file=str(listing)).build()
