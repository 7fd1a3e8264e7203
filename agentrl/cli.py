"""The ``agentrl`` command line."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Annotated

import typer

from agentrl.errors import AgentRLError

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="agentrl: asynchronous, agentic, multi-turn RL for LLMs with tool sandboxes.")


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        typer.echo(f"agentrl {version('agentrl')}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="print the version and exit")] = False,
) -> None:
    """agentrl: asynchronous, agentic, multi-turn RL for LLMs with tool sandboxes."""


Resume = Annotated[bool, typer.Option("--resume", help="continue the run in its directory from its last checkpoint")]
Overwrite = Annotated[bool, typer.Option("--overwrite", help="delete the run directory's earlier run and start over")]
Debug = Annotated[bool, typer.Option("--debug", help="run the controller, rollout and trainer (world size 1) in this "
                                     "one process without Ray, so breakpoint() and debuggers work anywhere "
                                     "(resources.ray=false)")]


def _run(config_path: Path | None, overrides: list[str], base: dict | None, prefix: str, *, resume: bool,
         overwrite: bool) -> None:
    from agentrl.launcher.config import load_config
    from agentrl.launcher.driver import run_training
    from agentrl.launcher.signals import stop_on_sigterm, terminated

    stop_on_sigterm()
    try:
        cfg = load_config(config_path, overrides, base=base).with_default_name(prefix)
        summary = asyncio.run(run_training(cfg, resume=resume, overwrite=overwrite))
    except AgentRLError as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        how, code = ("terminated (SIGTERM)", 143) if terminated() else ("interrupted", 130)
        typer.secho(f"{how}: every process of the run was stopped", fg=typer.colors.YELLOW, err=True)
        raise typer.Exit(code) from None
    typer.echo(json.dumps(summary, indent=2))
    typer.echo(f"run directory: {cfg.run_dir()}")


@app.command()
def demo(
    smoke: Annotated[bool, typer.Option("--smoke", help="tiny random model, 2 RL steps, a few minutes")] = False,
    lora: Annotated[bool, typer.Option("--lora", help="train LoRA adapters (r 16) instead of the whole model, "
                                                      "with LoRA's learning rates")] = False,
    overrides: Annotated[list[str] | None, typer.Argument(help="key=value overrides, e.g. steps=3")] = None,
    resume: Resume = False,
    overwrite: Overwrite = False,
    debug: Debug = False,
    verbose: Annotated[bool, typer.Option("-v", "--verbose")] = False,
) -> None:
    """The main job on embedded defaults: ReTool-style cold-start SFT, then async RL with a code interpreter."""
    from agentrl.launcher import recipes

    if smoke and lora:
        raise typer.BadParameter("--smoke and --lora do not go together: the rates --lora sets are the 135M model's "
                                 "(set trainer.lora.r=… and the rates with --smoke yourself)")
    _setup_logging(verbose)
    base, prefix = ((recipes.SMOKE, "smoke") if smoke else (recipes.DEMO_LORA, "demo-lora") if lora
                    else (recipes.DEMO, "demo"))
    _run(None, _with_debug(overrides, debug), base, prefix, resume=resume, overwrite=overwrite)


@app.command()
def train(
    config: Annotated[Path, typer.Argument(help="run config YAML (see examples/)")],
    overrides: Annotated[list[str] | None, typer.Argument(help="key=value overrides")] = None,
    resume: Resume = False,
    overwrite: Overwrite = False,
    debug: Debug = False,
    verbose: Annotated[bool, typer.Option("-v", "--verbose")] = False,
) -> None:
    """A training run from a config file (a run directory that holds a run needs --resume or --overwrite)."""
    _setup_logging(verbose)
    _run(config, _with_debug(overrides, debug), None, "train", resume=resume, overwrite=overwrite)


def _with_debug(overrides: list[str] | None, debug: bool) -> list[str]:
    return [*(overrides or []), *(["resources.ray=false"] if debug else [])]


def _mount_sandbox() -> None:
    from agentrl.sandbox.cli import sandbox_app

    app.add_typer(sandbox_app, name="sandbox", help="Run the sandbox server, or one program in the sandbox.")


_mount_sandbox()


def _mount_eval_api() -> None:
    from agentrl.api.cli import eval_command, serve

    app.command("serve")(serve)
    app.command("eval")(eval_command)


_mount_eval_api()


def _mount_gateway() -> None:
    from agentrl.gateway.cli import gateway_app

    app.add_typer(gateway_app, name="gateway", help="The agent gateway: OpenAI/Anthropic endpoints, token-exact.")


_mount_gateway()


def _mount_mcp() -> None:
    from agentrl.mcp.cli import mcp_app

    app.add_typer(mcp_app, name="mcp", help="Serve agentrl's tools and sandboxed interpreter over MCP.")


_mount_mcp()


if __name__ == "__main__":
    app()
