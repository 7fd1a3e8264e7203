"""The README is the manual: every configuration key a run accepts is named in it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from pydantic import BaseModel

from agentrl.launcher.config import RunConfig
from agentrl.trainer.config import TrainerConfig

README = Path(__file__).resolve().parents[1] / "README.md"


def keys(cls: type[BaseModel], prefix: str = "") -> Iterator[str]:
    for name, field in cls.model_fields.items():
        yield prefix + name
        for inner in (field.annotation, *getattr(field.annotation, "__args__", ())):
            if isinstance(inner, type) and issubclass(inner, BaseModel):
                yield from keys(inner, f"{prefix}{name}.")


def test_every_config_key_is_documented_in_the_readme() -> None:
    text = README.read_text()
    every = [*keys(RunConfig), *keys(TrainerConfig, "trainer.")]
    assert len(every) > 100
    missing = [k for k in every if f"`{k.rsplit('.', 1)[-1]}`" not in text]
    assert not missing, f"README.md does not name these configuration keys: {missing}"
