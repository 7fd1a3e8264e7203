"""The arrows of docs/ARCHITECTURE.md, checked on the code: every import statement in agentrl/ (also those inside
functions), and what each process of a run loads (its ``sys.modules`` after importing its entry module)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "agentrl"

#: (importer prefix, imported prefixes it must not reach). A prefix names a module and everything under it.
FORBIDDEN: list[tuple[str, tuple[str, ...]]] = [
    # the trainer is a library: types, errors, queue contracts, hardware/models, nothing of the rollout or the run
    ("agentrl.trainer", ("agentrl.launcher", "agentrl.async_rollout", "agentrl.engine", "agentrl.env",
                         "agentrl.sandbox", "agentrl.rewards", "agentrl.eval", "agentrl.api", "agentrl.data",
                         "agentrl.cli", "agentrl.client", "agentrl.gateway")),
    ("agentrl.data", ("agentrl.env", "agentrl.async_rollout", "agentrl.engine", "agentrl.trainer", "agentrl.launcher",
                      "agentrl.gateway")),
    ("agentrl.env", ("agentrl.async_rollout", "agentrl.trainer", "agentrl.launcher", "agentrl.eval", "agentrl.api",
                     "agentrl.gateway", "agentrl.mcp")),
    # MCP sits beside the rollout, on top of env: its tools go into environments, env's tools and the sandbox out
    ("agentrl.mcp", ("agentrl.async_rollout", "agentrl.engine", "agentrl.queue", "agentrl.trainer", "agentrl.launcher",
                     "agentrl.eval", "agentrl.api", "agentrl.data")),
    ("agentrl.rewards", ("agentrl.env", "agentrl.async_rollout", "agentrl.trainer", "agentrl.launcher", "agentrl.mcp")),
    ("agentrl.sandbox", ("agentrl.env", "agentrl.rewards", "agentrl.async_rollout", "agentrl.trainer",
                         "agentrl.launcher", "agentrl.mcp")),
    ("agentrl.async_rollout", ("agentrl.trainer", "agentrl.launcher", "agentrl.eval", "agentrl.api")),
    ("agentrl.engine", ("agentrl.async_rollout", "agentrl.env", "agentrl.trainer", "agentrl.launcher",
                        "agentrl.gateway")),
    # the agent gateway sits under the rollout (agent episodes): engine, env (tool parsers), tokenizer below it
    ("agentrl.gateway", ("agentrl.trainer", "agentrl.launcher", "agentrl.eval", "agentrl.api", "agentrl.queue",
                         "agentrl.async_rollout")),
    ("agentrl.queue", ("agentrl.async_rollout", "agentrl.env", "agentrl.engine", "agentrl.trainer",
                       "agentrl.launcher")),
    ("agentrl.eval", ("agentrl.trainer", "agentrl.launcher", "agentrl.api")),
    # the launcher is the top: only the command line imports it
    ("agentrl.api", ("agentrl.launcher", "agentrl.trainer")),
    ("agentrl.types", ("agentrl.queue", "agentrl.env", "agentrl.async_rollout", "agentrl.trainer", "agentrl.launcher")),
    ("agentrl.errors", ("agentrl.",)),
]


def _under(module: str, prefix: str) -> bool:
    return module == prefix.rstrip(".") or module.startswith(prefix.rstrip(".") + ".")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every agentrl module ``path`` imports, at module level or inside a function (a lazy import is an arrow
    too; ``TYPE_CHECKING`` imports as well)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names if _is_module(f"{node.module}.{a.name}")}
    return {m for m in found if _under(m, "agentrl")}


def _is_module(name: str) -> bool:
    """``agentrl.x.y`` is a module or package of the tree (``from agentrl.x import y`` imports a submodule)."""
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _arrows() -> dict[str, set[str]]:
    return {_module_name(p): _imports(p) for p in sorted(PACKAGE.rglob("*.py"))}


def test_the_import_walk_sees_every_kind_of_import() -> None:
    arrows = _arrows()
    assert "agentrl.launcher.config" in arrows["agentrl.launcher.trainer_process"]  # module level
    assert "agentrl.launcher.trainer_process" in arrows["agentrl.launcher.placement"]  # inside a function
    assert "agentrl.queue" in arrows["agentrl.launcher.protocol"]


def test_no_forbidden_arrow() -> None:
    bad = [f"{src} -> {dst}" for src, targets in _arrows().items() for prefix, forbidden in FORBIDDEN
           if _under(src, prefix) for dst in sorted(targets) if any(_under(dst, f) for f in forbidden)]
    assert not bad, "imports that docs/ARCHITECTURE.md forbids:\n" + "\n".join(bad)


def test_a_forbidden_arrow_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check itself can fail: a trainer module that imports the launcher is reported."""
    fake = tmp_path / "agentrl"
    (fake / "trainer").mkdir(parents=True)
    (fake / "trainer" / "sneaky.py").write_text("def f():\n    from agentrl.launcher.config import RunConfig\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    with pytest.raises(AssertionError, match="agentrl.trainer.sneaky -> agentrl.launcher.config"):
        test_no_forbidden_arrow()


def _loaded_by(module: str) -> list[str]:
    """``sys.modules`` of a fresh interpreter after ``import module``: what that process carries."""
    code = f"import json, sys, {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    return json.loads(out.stdout.splitlines()[-1])


def test_the_rollout_process_imports_no_torch_training_code() -> None:
    loaded = _loaded_by("agentrl.launcher.rollout_process")
    assert "agentrl.launcher.rollout_process" in loaded and "agentrl.async_rollout.scheduler" in loaded
    training = [m for m in loaded if _under(m, "agentrl.trainer") and m not in ("agentrl.trainer", "agentrl.trainer.config")
                or _under(m, "torch.distributed.fsdp") or _under(m, "torch.optim")]
    assert not training, f"the rollout process loads torch training code: {training}"


def test_the_trainer_process_imports_no_sglang_and_no_rollout_code() -> None:
    loaded = _loaded_by("agentrl.launcher.trainer_process")
    assert "agentrl.trainer.engine" in loaded
    # the run's configuration holds the rollout side's settings: their modules import no rollout code
    settings = ("agentrl.async_rollout", "agentrl.async_rollout.config", "agentrl.engine", "agentrl.engine.base",
                "agentrl.engine.server")
    rollout = [m for m in loaded if m not in settings and any(
        _under(m, p) for p in ("sglang", "agentrl.async_rollout", "agentrl.engine", "agentrl.env", "agentrl.sandbox",
                               "agentrl.rewards", "agentrl.launcher.rollout_process", "agentrl.eval"))]
    assert not rollout, f"the trainer process loads rollout code: {rollout}"
