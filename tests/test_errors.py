"""errors.py's docstring draws the whole error tree: every subclass of AgentRLError defined in agentrl is in it."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import agentrl.errors

#: imports every module of the package (in a fresh interpreter, so this test process stays light), then prints
#: each AgentRLError subclass defined in agentrl as [module, name]; a module whose third-party dependency (an extra)
#: is not installed is listed apart
LIST_ERRORS = """
import importlib, json, pkgutil
import agentrl
from agentrl.errors import AgentRLError

missing = []
for info in pkgutil.walk_packages(agentrl.__path__, "agentrl."):
    try:
        importlib.import_module(info.name)
    except ModuleNotFoundError as exc:
        if (exc.name or "").startswith("agentrl"):
            raise
        missing.append([info.name, exc.name])

def subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from subclasses(sub)

found = sorted({(c.__module__, c.__name__) for c in subclasses(AgentRLError) if c.__module__.startswith("agentrl")})
print(json.dumps({"errors": found, "missing": missing}))
"""


def _defined_errors() -> tuple[list[tuple[str, str]], list[list[str]]]:
    proc = subprocess.run([sys.executable, "-c", LIST_ERRORS], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return [tuple(e) for e in out["errors"]], out["missing"]


def _undrawn(errors: list[tuple[str, str]], tree: str) -> list[str]:
    """The public classes (no leading underscore) whose name is not a word of ``tree``."""
    return [f"{module}.{name}" for module, name in errors
            if not name.startswith("_") and not re.search(rf"\b{re.escape(name)}\b", tree)]


def test_every_public_error_class_is_drawn_in_the_tree() -> None:
    errors, missing = _defined_errors()
    assert len(errors) > 20, f"the walk found too few errors to be a walk of the package: {errors}"
    undrawn = _undrawn(errors, agentrl.errors.__doc__ or "")
    assert not undrawn, (f"these AgentRLError subclasses are missing from the tree in agentrl/errors.py's docstring: "
                         f"{undrawn}; add each under its parent with its module and one line on what it means"
                         + (f" (modules not imported, their extra is missing: {missing})" if missing else ""))


def test_the_check_can_fail() -> None:
    tree = agentrl.errors.__doc__ or ""
    errors = [("agentrl.gateway.base", "SessionClosed"), ("agentrl.x", "SessionGone"), ("agentrl.x", "_Hidden"),
              ("agentrl.x", "Session")]  # a prefix of a drawn name is not drawn
    assert _undrawn(errors, tree) == ["agentrl.x.SessionGone", "agentrl.x.Session"]


def test_engine_errors_keep_their_http_status_across_pickling() -> None:
    """Ray sends an actor's exception to its caller pickled: the status a caller acts on (a 400 refusal) survives,
    for the subclasses too; an error without an answer has none."""
    import pickle

    from agentrl.engine.base import EngineTimeout
    from agentrl.errors import EngineError

    for err in (EngineError("POST http://s/flush_cache failed with HTTP 400: busy", status=400),
                EngineTimeout("POST http://s/generate timed out after 5s")):
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is type(err) and back.args == err.args and back.status == err.status
    assert EngineTimeout("x").status is None
