"""Plugins through the ``agentrl.plugins`` entry-point group, from a real (temporary) installed distribution:
a callable taking the registry, a module whose decorators register, a broken one and one whose name clashes
with a built-in (neither may break agentrl), and plugins loaded a second time."""

from __future__ import annotations

import logging
import sys
import textwrap
from pathlib import Path

import pytest

import agentrl
from agentrl.env import default_registry
from agentrl.env.registry import Registry

PLUGIN = '''
import agentrl
from agentrl.env import Environment, StepResult
from agentrl.rewards import RewardResult


class PluginEnv(Environment):
    """An environment shipped by a plugin."""

    name = "plugin_env"

    def __init__(self, resources, **options):
        self.options = options

    async def reset(self, task):
        return [{"role": "user", "content": task.prompt}]

    async def step(self, text):
        return StepResult(None, True)

    async def score(self, response):
        return RewardResult.scored(1.0)


@agentrl.tool
def shout(text: str) -> str:
    """Upper-case the text."""
    return text.upper()


def setup(registry):
    registry.register_env("plugin_env", PluginEnv, tools=[shout])


def clash(registry):
    registry.register_env("math", PluginEnv)  # a built-in's name: refused, reported, the built-in stays
'''

MODULE_PLUGIN = '''
import agentrl
from agentrl_testplugin_env import PluginEnv


@agentrl.register_env("plugin_module_env", description="registered by a module plugin")
class ModuleEnv(PluginEnv):
    pass
'''


@pytest.fixture
def installed_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "agentrl_testplugin_env.py").write_text(PLUGIN)
    (tmp_path / "agentrl_testplugin_mod.py").write_text(MODULE_PLUGIN)
    info = tmp_path / "agentrl_testplugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: agentrl-testplugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(textwrap.dedent("""\
        [agentrl.plugins]
        envs = agentrl_testplugin_env:setup
        module = agentrl_testplugin_mod
        broken = agentrl_testplugin_missing
        clash = agentrl_testplugin_env:clash
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    for module in ("agentrl_testplugin_env", "agentrl_testplugin_mod"):  # imported afresh by each test
        monkeypatch.delitem(sys.modules, module, raising=False)
    # the process-wide registry, restored after the test
    monkeypatch.setattr(default_registry, "envs", dict(default_registry.envs))
    monkeypatch.setattr(default_registry, "tools", dict(default_registry.tools))
    monkeypatch.setattr(default_registry, "_plugins_loaded", False)
    return tmp_path


def test_callable_plugin_registers_into_the_registry_that_loads_it(installed_plugin, caplog):
    registry = Registry()
    with caplog.at_level(logging.ERROR, logger="agentrl.env.registry"):
        specs = {e.name: e for e in registry.list_envs()}
    assert "plugin_env" in specs and specs["plugin_env"].tools == ("shout",)
    assert specs["plugin_env"].description == "An environment shipped by a plugin."
    assert [t.name for t in registry.list_tools()] == ["shout"]
    env = registry.make_env("plugin_env", None, level=3)
    assert env.options == {"level": 3}
    # a broken plugin is reported, by name, and skipped
    assert any("broken" in r.getMessage() and "agentrl_testplugin_missing" in r.getMessage() for r in caplog.records)


def test_plugins_appear_in_the_public_api(installed_plugin):
    names = [e.name for e in agentrl.list_envs()]
    assert {"plugin_env", "plugin_module_env", "retool", "math", "code_tests"} <= set(names)
    assert "shout" in [t.name for t in agentrl.list_tools()]


def test_a_plugin_clashing_with_a_builtin_is_reported_and_the_builtin_stays(installed_plugin, caplog):
    from agentrl.env.math import MathEnv

    with caplog.at_level(logging.ERROR, logger="agentrl.env.registry"):
        agentrl.list_envs()
    assert default_registry.get_env("math").factory is MathEnv
    [msg] = [r.getMessage() for r in caplog.records if "clash" in r.getMessage()]
    assert "environment 'math' is already registered" in msg and "replace=True" in msg


def test_plugins_loaded_twice_do_not_fail(installed_plugin, caplog):
    registry = Registry()
    registry.load_plugins()
    first = registry.get_env("plugin_env")
    registry._plugins_loaded = False
    registry.load_plugins()  # the same module objects: the same registrations again, no-ops
    assert registry.get_env("plugin_env") is first
    for module in ("agentrl_testplugin_env", "agentrl_testplugin_mod"):
        del sys.modules[module]
    registry._plugins_loaded = False
    default_registry._plugins_loaded = False
    with caplog.at_level(logging.ERROR, logger="agentrl.env.registry"):
        registry.load_plugins()  # imported afresh: new objects from the same definitions replace the old
        default_registry.load_plugins()
    again = registry.get_env("plugin_env")
    assert again.factory is not first.factory and again.factory is sys.modules["agentrl_testplugin_env"].PluginEnv
    assert registry.tools["shout"] is sys.modules["agentrl_testplugin_env"].shout
    assert default_registry.get_env("plugin_module_env").factory is sys.modules["agentrl_testplugin_mod"].ModuleEnv
    assert not [r for r in caplog.records if r.getMessage().startswith(("agentrl plugin envs ", "agentrl plugin module "))]
