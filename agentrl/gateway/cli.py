"""``agentrl gateway serve``: an SGLang server for one model and the agent gateway in front of it (standalone, for
debugging agents and evaluating them; training runs place the gateway themselves). ``agentrl.cli`` mounts it."""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated

import typer

from agentrl.env.tool_parsers import BUILTIN
from agentrl.errors import AgentRLError

gateway_app = typer.Typer(add_completion=False, no_args_is_help=True)


@gateway_app.command("serve")
def serve(
    model: Annotated[str, typer.Option(help="a named model (smollm2-135m-instruct, tiny), a local HF folder, or "
                                            "an Org/Name from the local Hugging Face cache")],
    host: Annotated[str, typer.Option(help="bind address")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port")] = 8100,
    tool_parser: Annotated[str, typer.Option(help=f"'{BUILTIN}' (<tool_call> JSON) or an SGLang parser name "
                                                  "(qwen25, llama3, mistral, …)")] = BUILTIN,
    max_tokens: Annotated[int, typer.Option(help="max_tokens of a request that gives none")] = 1024,
    token: Annotated[str | None, typer.Option(envvar="AGENTRL_GATEWAY_TOKEN",
                                              help="bearer token required on the control routes")] = None,
    log_dir: Annotated[Path, typer.Option(help="where the SGLang server's log goes")] = Path("runs/_gateway"),
    max_total_tokens: Annotated[int, typer.Option(help="SGLang's KV-cache size in tokens")] = 16384,
    log_level: Annotated[str, typer.Option(help="uvicorn and agentrl log level")] = "info",
) -> None:
    """Start SGLang with MODEL and serve the agent gateway (POST /sessions, then OpenAI or Anthropic requests)."""
    import uvicorn

    from agentrl.engine.client import SGLangClient
    from agentrl.engine.server import SGLangServer, SGLangServerConfig
    from agentrl.gateway.app import create_app
    from agentrl.gateway.base import GatewayConfig
    from agentrl.gateway.core import Gateway
    from agentrl.gateway.session import SessionStore
    from agentrl.models import resolve_model
    from agentrl.tokenizer import ChatTokenizer

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        path = resolve_model(model)
        tokenizer = ChatTokenizer.from_pretrained(path)
        config = GatewayConfig(model_name=model, tool_parser=tool_parser, max_tokens=max_tokens)
        log_dir.mkdir(parents=True, exist_ok=True)
        server = SGLangServer(SGLangServerConfig(model_path=str(path), max_total_tokens=max_total_tokens),
                              log_path=log_dir / "sglang.log")
    except AgentRLError as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None
    typer.echo(f"starting SGLang for {path} (log: {log_dir / 'sglang.log'}) ...")
    server.start()
    try:
        engine = SGLangClient(server.url)

        @asynccontextmanager
        async def lifespan(_app):  # type: ignore[no-untyped-def]
            yield
            await engine.aclose()

        app = create_app(Gateway(engine, tokenizer, config), SessionStore(),
                         public_url=f"http://{host}:{port}", token=token)
        app.router.lifespan_context = lifespan
        typer.echo(f"gateway on http://{host}:{port}: POST /sessions, then base_url + /chat/completions")
        uvicorn.run(app, host=host, port=port, log_level=log_level)
    finally:
        server.stop()
