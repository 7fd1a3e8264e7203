"""SandboxConfig: one model for a run's `sandbox:` section and the evaluation service's sandbox; what it builds."""

from __future__ import annotations

import pytest

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
