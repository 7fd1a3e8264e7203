"""``agentrl mcp serve``: agentrl's registered tools, and the sandbox's Python interpreter, as an MCP server (a typer
sub-app, mounted by ``agentrl.cli``)."""

from __future__ import annotations

import asyncio
import logging
from typing import Annotated

import typer

from agentrl.errors import AgentRLError

mcp_app = typer.Typer(add_completion=False, no_args_is_help=True,
                      help="Serve agentrl's tools and sandboxed interpreter over MCP.")


@mcp_app.command()
def serve(
    transport: Annotated[str, typer.Option(help="stdio (one client, on this process's stdin/stdout) or http "
                                           "(streamable HTTP at http://HOST:PORT/mcp)")] = "stdio",
    imports: Annotated[list[str] | None, typer.Option("--import", help="a module (pkg.mod) or file (tools.py) whose "
                                                      "@agentrl.tool registrations to serve; repeatable")] = None,
    sandbox: Annotated[str, typer.Option(help="backend of the `python` tool: local (bubblewrap), docker, or none "
                                         "(no python tool)")] = "local",
    host: Annotated[str, typer.Option(help="http: bind address (keep it on loopback: the python tool runs code)")]
    = "127.0.0.1",
    port: Annotated[int, typer.Option(help="http: TCP port")] = 8765,
    token: Annotated[str | None, typer.Option(envvar="AGENTRL_MCP_TOKEN",
                                              help="http: require `Authorization: Bearer TOKEN`")] = None,
    python_timeout: Annotated[float, typer.Option(help="wall-clock limit of one python call, seconds")] = 10.0,
    tool_timeout: Annotated[float, typer.Option(help="limit of one registered tool's call, seconds")] = 30.0,
    verbose: Annotated[bool, typer.Option("-v", "--verbose")] = False,
) -> None:
    """Serve the registered tools (and a sandboxed `python` tool) to any MCP client."""
    from agentrl.mcp.server import build_server, serve_http, serve_stdio

    if transport not in ("stdio", "http"):
        raise typer.BadParameter(f"--transport must be stdio or http, got {transport!r}")
    if sandbox not in ("local", "docker", "none"):
        raise typer.BadParameter(f"--sandbox must be local, docker or none, got {sandbox!r}")
    # stdout is the protocol on stdio: every log line goes to stderr
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger(__name__)

    async def main() -> None:
        from agentrl.env.registry import default_registry, load_imports
        from agentrl.sandbox import Limits, make_sandbox

        load_imports(list(imports or []))
        tools = default_registry.list_tools()
        box = None if sandbox == "none" else make_sandbox(sandbox)
        try:
            if box is not None:
                await box.start()  # type: ignore[attr-defined]  # fail now, with the backend's own message
            server = build_server(tools, sandbox=box, tool_timeout_s=tool_timeout,
                                  python_limits=Limits(time_s=python_timeout), one_client=transport == "stdio")
            names = [t.name for t in tools] + (["python"] if box is not None else [])
            log.info("serving %d tool(s) over %s: %s", len(names), transport, ", ".join(names))
            if transport == "stdio":
                await serve_stdio(server)
            else:
                if token is None and host not in ("127.0.0.1", "localhost", "::1"):
                    log.warning("serving on %s without --token: anyone who reaches it can run code in the sandbox",
                                host)
                await serve_http(server, host=host, port=port, token=token)
        finally:
            if box is not None:
                await box.aclose()

    try:
        asyncio.run(main())
    except AgentRLError as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        pass
