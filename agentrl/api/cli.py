"""``agentrl serve`` (the evaluation REST API) and ``agentrl eval CONFIG.yaml`` (local, or on a server).

Plain typer command functions; ``agentrl.cli`` mounts them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
from pathlib import Path
from typing import IO, Annotated, Any

import typer

from agentrl.api.base import TOKEN_ENV, WEBHOOK_SECRET_ENV
from agentrl.errors import AgentRLError, ConfigError


def serve(
    config: Annotated[Path | None, typer.Option(help="server settings (YAML: every key of ApiSettings, e.g. "
                                                     "tenants, model_hosts, max_store_bytes); flags override it")]
    = None,
    host: Annotated[str, typer.Option(help="bind address (0.0.0.0 exposes the API to the network)")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port")] = 8000,
    token: Annotated[str | None, typer.Option(envvar=TOKEN_ENV, help="require this bearer token on /v1 (the admin "
                                                                     "tenant 'default')")] = None,
    redis_url: Annotated[str | None, typer.Option(help="external Redis (default: $AGENTRL_REDIS_URL, "
                                                       "else an embedded one in --data-dir)")] = None,
    data_dir: Annotated[Path | None, typer.Option(help="embedded Redis data and SGLang logs [runs/_api]")] = None,
    max_tasks: Annotated[int | None, typer.Option(help="tasks run at once by this process (0: queue only) [2]")]
    = None,
    max_episodes: Annotated[int | None, typer.Option(help="episodes at once over all tasks [16]")] = None,
    max_servers: Annotated[int | None, typer.Option(help="SGLang servers started at most [1]")] = None,
    sandbox: Annotated[str | None, typer.Option(help="sandbox backend: local, docker, auto [local]")] = None,
    max_sandbox: Annotated[int | None, typer.Option(help="sandboxed programs at once [8]")] = None,
    lease_s: Annotated[float | None, typer.Option(help="seconds before a dead worker's task is resumed elsewhere "
                                                       "[30]")] = None,
    runs_dir: Annotated[Path | None, typer.Option(help="training runs (for model run+version) [runs]")] = None,
    dataset_dir: Annotated[list[Path] | None, typer.Option(help="server-side datasets must be under these "
                                                                "(repeatable; default: the working directory)")] = None,
    model_dir: Annotated[list[Path] | None, typer.Option(help="model.path folders must be under these "
                                                              "(repeatable; default: the working directory)")] = None,
    model_host: Annotated[list[str] | None, typer.Option(help="hosts model.url may point at: a name, an IP or a "
                                                              "network (repeatable; default: loopback)")] = None,
    finished_ttl_s: Annotated[float | None, typer.Option(help="purge finished tasks after this many seconds "
                                                              "[never]")] = None,
    max_store_mb: Annotated[float | None, typer.Option(help="bound of the stored datasets + records; at it new "
                                                            "tasks get 507 [1024]")] = None,
    max_body_mb: Annotated[float | None, typer.Option(help="largest request body [8]")] = None,
    namespace: Annotated[str | None, typer.Option(help="Redis key prefix (separate services sharing one Redis) "
                                                       "[{agentrl-evals}]")] = None,
    log_level: Annotated[str, typer.Option(help="uvicorn and agentrl log level")] = "info",
    imports: Annotated[list[str] | None, typer.Option("--import", help="a module or .py file to import first (it "
                                                      "registers environments and tools; repeatable)")] = None,
    webhook_secret: Annotated[str | None, typer.Option(envvar=WEBHOOK_SECRET_ENV, help="key of the webhooks' "
                                                       "HMAC-SHA256 signature (unset: no webhooks)")] = None,
) -> None:
    """Serve the evaluation REST API (POST /v1/evals, GET /v1/evals/ID and its results, DELETE, environments)."""
    import uvicorn

    from agentrl.api.app import create_app

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = serve_settings(config, token=token, redis_url=redis_url, data_dir=data_dir, max_tasks=max_tasks,
                                  max_episodes=max_episodes, max_servers=max_servers,
                                  sandbox=None if sandbox is None and max_sandbox is None
                                  else _sandbox_config(sandbox or "local", max_sandbox or 8), lease_s=lease_s,
                                  runs_dir=runs_dir,
                                  dataset_dirs=dataset_dir, model_dirs=model_dir, model_hosts=model_host,
                                  finished_ttl_s=finished_ttl_s,
                                  max_store_bytes=None if max_store_mb is None else int(max_store_mb * (1 << 20)),
                                  max_body_bytes=None if max_body_mb is None else int(max_body_mb * (1 << 20)),
                                  namespace=namespace, webhook_secret=webhook_secret)
        if host not in ("127.0.0.1", "localhost", "::1") and not settings.all_tenants():
            typer.secho(f"warning: serving on {host} without a token; set {TOKEN_ENV} or tenants",
                        fg=typer.colors.YELLOW, err=True)
        _import(imports)
        uvicorn.run(create_app(settings), host=host, port=port, log_level=log_level)
    except AgentRLError as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None


def serve_settings(config: Path | None, **flags: Any) -> Any:
    """ApiSettings from a YAML file (or none) with the flags given (not None) on top; invalid: ConfigError."""
    from pydantic import ValidationError

    from agentrl.api.base import ApiSettings
    from agentrl.overrides import read_mapping

    data = read_mapping(config, "server settings") if config is not None else {}
    data.update({k: v for k, v in flags.items() if v is not None})
    try:
        return ApiSettings.from_env(**data)
    except ValidationError as exc:
        raise ConfigError(f"invalid server settings{f' in {config}' if config else ''}:\n{exc}") from None


def _sandbox_config(backend: str, max_concurrency: int = 8) -> Any:
    """``--sandbox`` / ``--max-sandbox`` as a :class:`agentrl.sandbox.SandboxConfig` (a bad value is a usage error)."""
    from pydantic import ValidationError

    from agentrl.sandbox.config import SandboxConfig

    try:
        return SandboxConfig(backend=backend, max_concurrency=max_concurrency)  # type: ignore[arg-type]  # checked
    except ValidationError as exc:
        raise typer.BadParameter(f"--sandbox {backend!r} / --max-sandbox {max_concurrency}: "
                                 + "; ".join(e["msg"] for e in exc.errors())) from None


def _import(imports: list[str] | None) -> None:
    """``--import``: like a run config's ``imports:``, so a one-file environment can be served or evaluated."""
    from agentrl.env.registry import load_imports

    load_imports([str(Path(i).resolve()) if i.endswith(".py") else i for i in imports or []])


def load_spec(path: Path, overrides: list[str]) -> Any:
    """An EvalSpec from a YAML (or JSON) file plus ``key=value`` overrides (dotted keys, YAML values)."""
    from pydantic import ValidationError

    from agentrl.eval.spec import EvalSpec
    from agentrl.overrides import merge, parse_overrides, read_mapping

    data = merge(read_mapping(path, "eval config"), parse_overrides(overrides))
    try:
        return EvalSpec.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"invalid eval config {path}:\n{exc}") from None


def eval_command(
    config: Annotated[Path, typer.Argument(help="an eval spec in YAML (the body of POST /v1/evals)")],
    overrides: Annotated[list[str] | None, typer.Argument(help="key=value overrides, e.g. samples_per_item=8")] = None,
    server: Annotated[str | None, typer.Option(help="submit to this agentrl serve URL instead of running here")] = None,
    token: Annotated[str | None, typer.Option(envvar=TOKEN_ENV, help="bearer token of the server")] = None,
    out: Annotated[Path | None, typer.Option(help="write every sample record (JSON lines) here")] = None,
    wait: Annotated[bool, typer.Option(help="with --server: wait for the result")] = True,
    sandbox: Annotated[str, typer.Option(help="local run: sandbox backend")] = "local",
    runs_dir: Annotated[Path, typer.Option(help="local run: where training runs live")] = Path("runs"),
    verbose: Annotated[bool, typer.Option("-v", "--verbose")] = False,
    imports: Annotated[list[str] | None, typer.Option("--import", help="a module or .py file to import first (it "
                                                      "registers environments and tools; repeatable)")] = None,
) -> None:
    """Run an evaluation here (starting what it needs), or submit it to a server with --server."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        _import(imports)
        spec = load_spec(config, overrides or [])
        if server:
            state = _remote(spec, server, token, out, wait)
        else:
            with open(out, "w") if out is not None else contextlib.nullcontext() as records:
                state = asyncio.run(_local(spec, records, sandbox, runs_dir))
    except AgentRLError as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    typer.echo(json.dumps(state, indent=2))
    if state.get("status") not in ("succeeded", "queued", "running"):
        raise typer.Exit(2)


def _remote(spec: Any, server: str, token: str | None, out: Path | None, wait: bool) -> dict[str, Any]:
    from agentrl.client import EvalClient

    with EvalClient(server, token=token) as client:
        eval_id = client.submit(spec)
        typer.secho(f"submitted evaluation {eval_id} to {server}", err=True)
        if not wait:
            return client.get(eval_id)

        def show(state: dict[str, Any]) -> None:
            p = state["progress"]
            sys.stderr.write(f"\r{state['status']}: {p['done']}/{p['total']} samples")
            sys.stderr.flush()

        state = client.wait(eval_id, on_progress=show)
        sys.stderr.write("\n")
        if out is not None:
            with open(out, "w") as f:
                f.writelines(json.dumps(record) + "\n" for record in client.iter_results(eval_id))
        return {k: state[k] for k in ("id", "status", "progress", "metrics", "error")}


async def _local(spec: Any, records: IO[str] | None, sandbox: str, runs_dir: Path) -> dict[str, Any]:
    from agentrl.eval.services import EvalServices

    async def write(record: Any) -> None:
        if records is not None:
            records.write(json.dumps(record.to_dict()) + "\n")
            records.flush()
        sys.stderr.write(f"\r{record.key} {record.status}")
        sys.stderr.flush()

    try:
        async with await EvalServices.create(sandbox=_sandbox_config(sandbox), runs_dir=runs_dir,
                                             log_dir=runs_dir / "_eval" / "logs") as services:
            result = await services.evaluate(spec, on_record=write, keep_records=False)
    finally:
        sys.stderr.write("\n")
    return {"status": result.status, "progress": {"done": result.done, "total": result.total},
            "metrics": result.metrics, "wall_time_s": result.wall_time_s}
