"""RewardsConfig: the math checker pool's size, one model for a run's `rewards:` section and the evaluation service."""

from __future__ import annotations

from agentrl.api import ApiSettings
from agentrl.launcher.config import RunConfig, load_config
from agentrl.rewards import MathVerifier, RewardsConfig


def test_the_run_and_the_evaluation_service_share_one_rewards_model() -> None:
    assert RunConfig.model_fields["rewards"].annotation is RewardsConfig
    assert ApiSettings.model_fields["rewards"].annotation is RewardsConfig
    assert "verifier_workers" not in ApiSettings.model_fields


def test_the_verifier_has_the_configured_workers() -> None:
    assert RewardsConfig().verifier_workers == 1  # the run's pool before this setting existed
    verifier = load_config(None, ["rewards.verifier_workers=3"]).rewards.math_verifier()
    assert isinstance(verifier, MathVerifier) and verifier._size == 3
