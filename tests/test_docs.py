"""The README is the manual: every configuration key a run accepts is named in it."""

from __future__ import annotations

from pathlib import Path

from agentrl.launcher.config import config_keys

README = Path(__file__).resolve().parents[1] / "README.md"


def test_every_config_key_is_documented_in_the_readme() -> None:
    text = README.read_text()
    every = list(config_keys())
    assert len(every) > 100
    missing = [k for k in every if f"`{k.rsplit('.', 1)[-1]}`" not in text]
    assert not missing, f"README.md does not name these configuration keys: {missing}"
