"""``agentrl sandbox serve`` and ``agentrl sandbox run FILE`` (a typer sub-app, mounted by ``agentrl.cli``)."""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path
from typing import Annotated

import typer

from agentrl.errors import AgentRLError
from agentrl.sandbox.base import Limits, RunRequest, RunStatus

SUFFIXES = {".py": "python", ".sh": "bash", ".cpp": "cpp", ".cc": "cpp", ".cxx": "cpp", ".c": "c", ".java": "java",
            ".go": "go", ".rs": "rust", ".js": "nodejs", ".mjs": "nodejs", ".ts": "typescript"}

sandbox_app = typer.Typer(add_completion=False, no_args_is_help=True,
                          help="Run the sandbox server, or one program in the sandbox.")

Backend = Annotated[str, typer.Option("--backend", help="local (bubblewrap), docker, remote (--url), auto")]


def _options(backend: str, max_concurrency: int, image: str | None, url: str | None,
             token: str | None) -> dict[str, object]:
    if backend == "remote":
        from agentrl.sandbox.config import split_urls

        urls = split_urls(url or "")
        if not urls:
            raise typer.BadParameter("--backend remote needs --url (several servers: comma-separated)")
        return {"url": urls[0], "token": token} if len(urls) == 1 else {"urls": urls, "token": token}
    opts: dict[str, object] = {"max_concurrency": max_concurrency}
    if backend == "docker" and image:
        opts["image"] = image
    return opts


@sandbox_app.command()
def serve(
    backend: Backend = "local",
    host: Annotated[str, typer.Option(help="bind address (0.0.0.0 exposes the sandbox to the network)")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port")] = 8080,
    token: Annotated[str | None, typer.Option(envvar="AGENTRL_SANDBOX_TOKEN", help="require this bearer token")] = None,
    max_concurrency: Annotated[int, typer.Option(help="programs running at once")] = 8,
    max_queue: Annotated[int, typer.Option(help="requests waiting beyond that before 429")] = 64,
    max_output_bytes: Annotated[int, typer.Option(help="stdout/stderr cut past this (with a marker)")] = 64 * 1024,
    image: Annotated[str | None, typer.Option(help="docker backend: the sandbox image")] = None,
) -> None:
    """Serve a sandbox over HTTP: SandboxFusion's /run_code and /run_jupyter, plus /v1/run and sessions."""
    if backend == "remote":  # before any import or start: there is no --url to proxy to, and serving one is not ours
        raise typer.BadParameter("sandbox serve runs programs on this machine: local, docker or auto "
                                 "(remote is `sandbox run --backend remote --url URL`)", param_hint="--backend")
    import uvicorn

    from agentrl.sandbox import make_sandbox
    from agentrl.sandbox.server import create_app

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    async def main() -> None:
        sandbox = make_sandbox(backend, **_options(backend, max_concurrency, image, None, None))
        start = getattr(sandbox, "start", None)
        if start is not None:
            await start()  # fail now, with the backend's message, rather than on the first request
        app = create_app(sandbox, max_concurrency=max_concurrency, max_queue=max_queue, token=token,
                         max_output_bytes=max_output_bytes, close_sandbox=True)
        await uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="info")).serve()

    try:
        asyncio.run(main())
    except AgentRLError as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None


@sandbox_app.command()
def run(
    file: Annotated[Path, typer.Argument(exists=True, dir_okay=False,
                                         help="a program: .py .sh .cpp .cc .c .java .go .rs .js .ts")],
    backend: Backend = "local",
    time_s: Annotated[float, typer.Option("--time", help="wall-clock limit in seconds")] = 10.0,
    memory_mb: Annotated[int, typer.Option(help="memory limit")] = 256,
    url: Annotated[str | None, typer.Option(help="remote backend: the server's URL (several: comma-separated)")] = None,
    token: Annotated[str | None, typer.Option(envvar="AGENTRL_SANDBOX_TOKEN")] = None,
) -> None:
    """Run one program in the sandbox; prints its stdout/stderr and exits with its exit code."""
    from agentrl.sandbox import make_sandbox

    language = SUFFIXES.get(file.suffix.lower())
    if language is None:
        typer.secho(f"error: {file.name}: the language is told by the suffix, one of {', '.join(SUFFIXES)}",
                    fg=typer.colors.RED, err=True)
        raise typer.Exit(2)
    stdin = "" if sys.stdin.isatty() else sys.stdin.read()
    request = RunRequest(code=file.read_text(), language=language, stdin=stdin,
                         limits=Limits(time_s=time_s, memory_mb=memory_mb))

    async def main() -> int:
        sandbox = make_sandbox(backend, **_options(backend, 1, None, url, token))
        try:
            result = await sandbox.run(request)
        finally:
            await sandbox.aclose()
        if result.compile is not None and not result.compile.ok:
            sys.stderr.write(result.compile.stdout + result.compile.stderr)
        sys.stdout.write(result.stdout)
        sys.stderr.write(result.stderr)
        if result.run_status is not RunStatus.FINISHED:
            typer.secho(f"[{result.status.value}] {result.message}", fg=typer.colors.YELLOW, err=True)
        if result.is_sandbox_error:
            return 125
        if result.run_status is RunStatus.TIME_LIMIT_EXCEEDED:
            return 124  # as timeout(1)
        code = result.exit_code or 0
        if result.run_status is RunStatus.FINISHED:
            return 0
        return (128 - code if code < 0 else code & 0xFF) or 1  # killed by signal N: 128 + N, as a shell

    try:
        code = asyncio.run(main())
    except AgentRLError as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None
    raise typer.Exit(code)
