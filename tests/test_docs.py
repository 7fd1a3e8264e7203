"""The README is the manual: every configuration key a run accepts is named in it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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


def test_the_defaults_the_readme_states_are_the_code_s() -> None:
    """Where the configuration table writes a key's default as a value, "`key` (16384…", "`ray` (true…", it is the
    value a run gets (RunConfig's defaults; a key is looked up in its own section's row). Descriptions in place of a
    value ("`url` (use running SGLang servers…") are not checked."""
    import re

    from agentrl.launcher.config import RunConfig

    rows: dict[str, str] = {}
    for line in README.read_text().splitlines():
        if m := re.match(r"\| (top level|`(\w+)`) \| (.*)\|\s*$", line):
            rows.setdefault(m.group(2) or "top level", line)
    assert {"top level", "engine", "rollout", "trainer", "sft", "resources"} <= set(rows), sorted(rows)
    number = re.compile(r"^-?\d[\d,]*(\.\d+)?(e-?\d+)?$")

    def written(token: str) -> object:
        token = token.strip("`").rstrip(",")
        if token == "null":
            return None
        if token in ("true", "false"):
            return token == "true"
        return float(token.replace(",", "")) if number.match(token) else token

    defaults = RunConfig().model_dump(mode="json")
    checked, wrong = 0, []
    for key in config_keys():
        parts = key.split(".")
        value: object = defaults
        for part in parts:
            value = value.get(part, KeyError) if isinstance(value, dict) else KeyError
        row = rows.get(parts[0] if len(parts) > 1 else "top level")
        if value is KeyError or isinstance(value, (dict, list)) or row is None:
            continue
        want = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value
        for token in re.findall(rf"`{re.escape(parts[-1])}` \(([^;:)\s]+)", row):
            got = written(token)
            if isinstance(got, str) and not isinstance(want, str):
                continue  # a description, not a value
            checked += 1
            if got != want:
                wrong.append(f"{key}: the README says {token!r}, the code {value!r}")
    assert checked > 100, checked
    assert not wrong, wrong


def test_every_command_line_option_is_named_in_the_readme() -> None:
    import typer.main

    from agentrl import cli

    text = README.read_text()
    seen, missing = 0, []

    def walk(command: Any, path: str) -> None:  # typer's own click: groups have commands, options a type name
        nonlocal seen
        for name, sub in getattr(command, "commands", {}).items():
            walk(sub, f"{path} {name}")
        for param in command.params:
            if param.param_type_name == "option" and not param.hidden:
                for opt in (o for o in (*param.opts, *param.secondary_opts) if o.startswith("--")):
                    seen += 1
                    if opt not in text:
                        missing.append(f"{path} {opt}")

    walk(typer.main.get_command(cli.app), "agentrl")
    assert seen > 50, seen
    assert not missing, f"README.md does not name these command-line options: {missing}"


def test_every_public_name_of_the_package_is_named_in_the_readme() -> None:
    import agentrl

    text = README.read_text()
    assert len(agentrl.__all__) > 10
    missing = [n for n in agentrl.__all__ if f"`{n}`" not in text and f"agentrl.{n}" not in text]
    assert not missing, f"README.md does not name these public names of `agentrl`: {missing}"
