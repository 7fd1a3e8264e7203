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

#: the floor every package may stand on: these modules import nothing of agentrl but errors (and what is named here)
FLOOR: dict[str, tuple[str, ...]] = {
    "agentrl.errors": (), "agentrl.retry": (), "agentrl._http": (), "agentrl.retool_format": (),
    "agentrl.models": (), "agentrl.overrides": (),
    "agentrl.hardware": ("agentrl.models",),  # its measurement cache lives in models.cache_dir()
    "agentrl.tokenizer": ("agentrl.models",),  # its cache of picked tokenizer classes too
}

#: a module only these importers may reach (besides its own package): the launcher is the top, under the command line
ONLY_FROM: dict[str, tuple[str, ...]] = {"agentrl.launcher": ("agentrl.cli",)}


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


def _forbidden(src: str, dst: str) -> bool:
    if any(_under(src, prefix) and any(_under(dst, f) for f in forbidden) for prefix, forbidden in FORBIDDEN):
        return True
    if src in FLOOR and dst != "agentrl.errors" and dst not in FLOOR[src]:
        return True
    return any(_under(dst, top) and not _under(src, top) and src not in importers for top, importers in ONLY_FROM.items())


def _bad_arrows() -> list[str]:
    return [f"{src} -> {dst}" for src, targets in _arrows().items() for dst in sorted(targets) if _forbidden(src, dst)]


def test_no_forbidden_arrow() -> None:
    bad = _bad_arrows()
    assert not bad, "imports that docs/ARCHITECTURE.md forbids:\n" + "\n".join(bad)


def test_a_forbidden_arrow_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check itself can fail: a trainer module that imports the launcher is reported."""
    fake = tmp_path / "agentrl"
    (fake / "trainer").mkdir(parents=True)
    (fake / "trainer" / "sneaky.py").write_text("def f():\n    from agentrl.launcher.config import RunConfig\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    with pytest.raises(AssertionError, match="agentrl.trainer.sneaky -> agentrl.launcher.config"):
        test_no_forbidden_arrow()


@pytest.mark.parametrize(("module", "source", "arrow"), [
    # a floor module that reaches up to a package
    ("retry.py", "from agentrl.engine.base import EngineError\n", "agentrl.retry -> agentrl.engine.base"),
    ("tokenizer.py", "import agentrl.types\n", "agentrl.tokenizer -> agentrl.types"),
    # the launcher imported by anything but the command line (here a module no FORBIDDEN rule names)
    ("client.py", "def f():\n    from agentrl.launcher.config import RunConfig\n",
     "agentrl.client -> agentrl.launcher.config"),
])
def test_the_floor_and_the_top_are_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, module: str,
                                           source: str, arrow: str) -> None:
    fake = tmp_path / "agentrl"
    fake.mkdir()
    (fake / module).write_text(source)
    # allowed: a floor module on errors, hardware on models, the command line on the launcher
    (fake / "hardware.py").write_text("from agentrl.errors import ConfigError\nfrom agentrl.models import cache_dir\n")
    (fake / "cli.py").write_text("from agentrl.launcher import driver\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    assert _bad_arrows() == [arrow]


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
    # nor torch at all: ~280 MB of anonymous memory for the whole run (the CPU kernel's build imports it in a child)
    assert not [m for m in loaded if _under(m, "torch")], "the rollout process imports torch"


def test_the_cli_starts_without_the_heavy_stacks() -> None:
    """Every ``agentrl`` command imports ``agentrl.cli``: mounting ``serve``/``eval`` once loaded FastAPI and the
    evaluation stack (scipy), ~2.3 s at each start; torch and HF datasets load where a command needs them."""
    loaded = _loaded_by("agentrl.cli")
    assert "agentrl.api.cli" in loaded
    heavy = [m for m in loaded if any(_under(m, h) for h in ("fastapi", "scipy", "torch", "datasets", "uvicorn",
                                                              "agentrl.api.app"))]
    assert not heavy, f"agentrl.cli loads {heavy[:10]}"


def test_the_trainer_process_imports_no_sglang_and_no_rollout_code() -> None:
    loaded = _loaded_by("agentrl.launcher.trainer_process")
    assert "agentrl.trainer.engine" in loaded
    rollout = _rollout_code(loaded)
    assert not rollout, f"the trainer process loads rollout code: {rollout}"


#: what the trainer process never loads, but the rollout side's settings (the run's configuration holds them: their
#: modules import no rollout code)
TRAINER_NEVER = ("sglang", "agentrl.async_rollout", "agentrl.engine", "agentrl.env", "agentrl.sandbox",
                 "agentrl.rewards", "agentrl.launcher.rollout_process", "agentrl.eval", "agentrl.gateway",
                 "agentrl.mcp", "agentrl.api")
TRAINER_SETTINGS = ("agentrl.async_rollout", "agentrl.async_rollout.config", "agentrl.engine", "agentrl.engine.base",
                    "agentrl.engine.config", "agentrl.engine.server", "agentrl.gateway", "agentrl.gateway.config", "agentrl.sandbox",
                    "agentrl.sandbox.config", "agentrl.rewards", "agentrl.rewards.config")


def _rollout_code(loaded: list[str]) -> list[str]:
    return [m for m in loaded if m not in TRAINER_SETTINGS and any(_under(m, p) for p in TRAINER_NEVER)]


def test_the_trainer_process_check_can_fail() -> None:
    loaded = ["agentrl.engine.base", "agentrl.gateway.core", "agentrl.mcp", "agentrl.api.app", "agentrl.trainer"]
    assert _rollout_code(loaded) == ["agentrl.gateway.core", "agentrl.mcp", "agentrl.api.app"]
