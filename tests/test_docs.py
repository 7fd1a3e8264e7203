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


def test_every_rest_route_of_the_eval_api_is_documented_in_the_readme() -> None:
    from agentrl.api import ApiSettings, create_app

    text = README.read_text()
    schema = create_app(ApiSettings()).openapi()
    routes = [(m.upper(), p) for p, ms in schema["paths"].items() for m in ms]
    missing = [(m, p) for m, p in routes if f"{p.replace('{eval_id}', '{id}')}" not in text]
    assert not missing, f"README.md does not name these REST routes: {missing}"
    ids = [op["operationId"] for ms in schema["paths"].values() for op in ms.values()]
    assert not [i for i in ids if f"[{i}]" not in text], "README.md's REST table lacks operationIds"


def test_every_eval_server_setting_is_documented_in_the_readme() -> None:
    from agentrl.api import ApiSettings

    text = README.read_text()
    missing = [k for k in ApiSettings.model_fields if f"`{k}`" not in text]
    assert not missing, f"README.md does not name these `agentrl serve` settings: {missing}"
