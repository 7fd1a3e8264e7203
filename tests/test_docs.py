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


def test_every_eval_server_setting_and_route_is_documented_in_the_readme() -> None:
    import re

    from agentrl.api import ApiSettings, create_app

    text = README.read_text()
    missing = [k for k in ApiSettings.model_fields if f"`{k}`" not in text]
    assert not missing, f"README.md does not name these `agentrl serve` settings: {missing}"
    app = create_app(ApiSettings())
    routes = {(m, re.sub(r"\{[^}]+\}", "{id}", r.path)) for r in app.routes for m in getattr(r, "methods", ())
              if m != "HEAD" and not r.path.startswith(("/docs", "/redoc", "/openapi"))}
    assert len(routes) >= 8
    undocumented = sorted(f"{m} {p}" for m, p in routes if f"`{m} {p}" not in text)
    assert not undocumented, f"README.md does not document these eval REST routes: {undocumented}"
