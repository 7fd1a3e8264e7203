"""``key=value`` overrides and the merge of a config's layers."""

import pytest

from agentrl.errors import ConfigError
from agentrl.overrides import merge, parse_overrides


def test_overrides_nest_and_parse_yaml_scalars():
    assert parse_overrides(["rollout.n_samples=4", "model=tiny", "sft.enabled=false", "x.y.z=1.5"]) == {
        "rollout": {"n_samples": 4}, "model": "tiny", "sft": {"enabled": False}, "x": {"y": {"z": 1.5}}}
    with pytest.raises(ConfigError, match="key=value"):
        parse_overrides(["nonsense"])


def test_merge_keeps_both_layers_and_changes_neither():
    base = {"rollout": {"n_samples": 2, "max_turns": 3}, "model": "tiny"}
    over = {"rollout": {"n_samples": 4}, "steps": 3}
    assert merge(base, over) == {"rollout": {"n_samples": 4, "max_turns": 3}, "model": "tiny", "steps": 3}
    assert base == {"rollout": {"n_samples": 2, "max_turns": 3}, "model": "tiny"} and over["rollout"] == {"n_samples": 4}
