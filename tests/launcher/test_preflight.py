"""Checks before anything starts: wrong env options, unknown envs and sources fail at once, with a hint."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentrl.errors import ConfigError
from agentrl.launcher.config import load_config
from agentrl.launcher.preflight import check_env_options, check_run


def test_env_options_are_checked_against_the_constructor() -> None:
    check_env_options("retool", {"code_timeout_s": 5.0})
    with pytest.raises(ConfigError, match=r"unknown option 'code_timout_s' \(did you mean 'code_timeout_s'\?\)"):
        check_env_options("retool", {"code_timout_s": 5.0})
    with pytest.raises(ConfigError, match="unknown environment 'retol'"):
        check_env_options("retol", {})


def test_unknown_sources_are_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"data.train: 'nwe' is neither a problem family .*did you mean 'new'"):
        check_run(load_config(None, ["model=tiny", "data.train=nwe"]))
    with pytest.raises(ConfigError, match="sft.family: unknown problem family 'sfft'"):
        check_run(load_config(None, ["model=tiny", "sft.family=sfft"]))
    with pytest.raises(ConfigError, match="imports:"):
        check_run(load_config(None, ["model=tiny", f"imports=[{tmp_path / 'missing.py'}]"]))


def test_a_bad_run_fails_before_any_server_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """run_training checks first: Ray, Redis and SGLang are never started for a run that cannot work."""
    import asyncio

    from agentrl.launcher import driver

    def boom(*_: object) -> None:
        raise AssertionError("the processes were placed for a run that fails its checks")

    monkeypatch.setattr(driver, "place", boom)
    cfg = load_config(None, ["model=tiny", f"runs_dir={tmp_path}", "name=bad", "env.options={code_timout_s: 1}"])
    with pytest.raises(ConfigError, match="did you mean 'code_timeout_s'"):
        asyncio.run(driver.run_training(cfg))
    assert not (tmp_path / "bad" / "config.yaml").exists()


def test_an_agent_environment_is_checked_too() -> None:
    root = Path(__file__).resolve().parents[2]
    cfg = load_config(root / "examples" / "openai_agent" / "train.yaml", [f"imports=[{root}/examples/openai_agent/agent.py]"])
    check_run(cfg)  # its options (timeout_s) bind to the agent factory, not to the agent function
    with pytest.raises(ConfigError, match=r"unknown option 'timeout' \(did you mean 'timeout_s'\?\)"):
        check_env_options("calculator_agent", {"timeout": 5})
    # a held-out evaluation runs the agent through a gateway of its own (agentrl.eval.runner)
    check_run(cfg.model_copy(update={"data": cfg.data.model_copy(update={"num_heldout": 4})}))
