"""agentrl.mcp.server: ``agentrl mcp serve`` (a real process, over stdio and streamable HTTP on 127.0.0.1, the python
tool on the local bubblewrap sandbox) driven by the official SDK's client: listing, a registered tool, the sandboxed
interpreter (and where it keeps state), the caller's mistakes as ``isError`` answers, an unknown tool and our own
infrastructure failing as JSON-RPC errors, and both time limits."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest
from mcp import Client, MCPError, StdioServerParameters
from mcp_support import agentrl_serve_args, child_env, free_port, http_server

from agentrl.env import tool
from agentrl.errors import ConfigError
from agentrl.mcp import McpClient, McpServerError, build_server
from agentrl.mcp.base import INTERNAL_ERROR, INVALID_PARAMS

TOOLS = {"add", "divide", "nap", "broken_backend", "python"}


def text(result) -> str:
    return "\n".join(block.text for block in result.content)


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    port = free_port()
    with http_server(agentrl_serve_args("--transport", "http", "--port", str(port)), port) as endpoint:
        yield endpoint


async def test_lists_the_registered_tools_and_the_interpreter(url: str) -> None:
    async with Client(url) as client:
        tools = {t.name: t for t in (await client.list_tools()).tools}
    assert set(tools) == TOOLS
    assert tools["add"].description == "Add two integers."
    assert tools["add"].input_schema["properties"]["a"] == {"type": "integer", "description": "the first addend"}
    assert tools["python"].input_schema["required"] == ["code"]


async def test_calls_a_registered_tool(url: str) -> None:
    async with Client(url) as client:
        result = await client.call_tool("add", {"a": 2, "b": 3})
    assert not result.is_error and text(result) == "5"


async def test_the_python_tool_runs_code_in_the_sandbox(url: str) -> None:
    async with Client(url) as client:
        result = await client.call_tool("python", {"code": "import os\nprint(6 * 7, os.getuid())"})
        failed = await client.call_tool("python", {"code": "1 / 0"})
    assert not result.is_error and text(result).split()[0] == "42"
    assert text(result).split()[1] != "0"  # not root inside the sandbox
    assert failed.is_error and "ZeroDivisionError: division by zero" in text(failed)


@pytest.mark.parametrize("mode, kept", [("legacy", True), ("auto", False)])
async def test_interpreter_state_lives_as_long_as_the_mcp_session(url: str, mode: str, kept: bool) -> None:
    """A handshake-era HTTP session (Mcp-Session-Id) keeps one interpreter; the 2026-07-28 protocol has no
    sessions, so each call there runs in a fresh one (the module docstring of agentrl.mcp.server says so)."""
    async with Client(url, mode=mode) as client:
        await client.call_tool("python", {"code": "x = 41"})
        result = await client.call_tool("python", {"code": "print(x + 1)"})
    if kept:
        assert not result.is_error and text(result) == "42"
    else:
        assert result.is_error and "NameError" in text(result)


async def test_the_callers_mistakes_are_tool_errors_it_can_read(url: str) -> None:
    async with Client(url) as client:
        raised = await client.call_tool("divide", {"a": 1, "b": 0})
        bad = await client.call_tool("add", {"a": "2", "c": 1})
        bad_code = await client.call_tool("python", {"source": "print(1)"})
    assert raised.is_error and text(raised) == "Error: ZeroDivisionError: float division by zero"
    assert bad.is_error and text(bad).startswith("invalid arguments for add(a, b): ")
    assert "argument 'a': expected a valid integer, got \"2\"" in text(bad) and "unknown argument 'c'" in text(bad)
    assert bad_code.is_error and "python(code)" in text(bad_code)


async def test_an_unknown_tool_is_a_protocol_error_naming_the_tools(url: str) -> None:
    async with Client(url) as client:
        with pytest.raises(MCPError) as exc:
            await client.call_tool("nope", {})
    assert exc.value.code == INVALID_PARAMS
    assert "unknown tool 'nope'; available: add, broken_backend, divide, nap, python" in exc.value.message


async def test_time_limits_are_enforced(url: str) -> None:
    """Served with --tool-timeout 1 and --python-timeout 3."""
    async with Client(url, read_timeout_seconds=30) as client:
        slow = await client.call_tool("nap", {"seconds": 20})
        loop = await client.call_tool("python", {"code": "while True:\n    pass"})
    assert slow.is_error and text(slow) == "Error: nap did not finish within 1s"
    assert loop.is_error and "ran past its time limit (3s)" in text(loop)


async def test_our_infrastructure_failing_is_not_a_tool_answer(url: str) -> None:
    async with Client(url) as client:
        with pytest.raises(MCPError) as exc:
            await client.call_tool("broken_backend", {})
    assert exc.value.code == INTERNAL_ERROR and "did not answer" in exc.value.message


async def test_over_stdio_one_interpreter_serves_the_processs_one_client() -> None:
    params = StdioServerParameters(command=sys.executable, args=agentrl_serve_args(), env=child_env())
    async with Client(params, read_timeout_seconds=60) as client:  # the SDK's default: the 2026-07-28 protocol
        assert {t.name for t in (await client.list_tools()).tools} == TOOLS
        assert text(await client.call_tool("add", {"a": 20, "b": 22})) == "42"
        await client.call_tool("python", {"code": "import math\nr = 2"})
        result = await client.call_tool("python", {"code": "math.pi * r ** 2"})  # a trailing expression's value
        with pytest.raises(MCPError):
            await client.call_tool("nope", {})
    assert not result.is_error and text(result).startswith("12.566")


async def test_agentrls_client_consumes_agentrls_server(url: str) -> None:
    async with McpClient.http(url, call_timeout_s=30) as client:
        tools = {t.name: t for t in await client.tools()}
        assert set(tools) == TOOLS
        assert await tools["python"](code="print(sum(range(10)))") == "45"
        assert tools["add"].validate({"a": 1, "b": 2}) == {"a": 1, "b": 2}


def test_a_registered_tool_cannot_take_the_interpreters_name() -> None:
    @tool
    def python(code: str) -> str:
        """Shadows the sandbox's interpreter."""
        return code

    with pytest.raises(ConfigError, match="named 'python'"):
        build_server([python], sandbox=object())  # type: ignore[arg-type]
    server = build_server([python])  # without a sandbox there is no interpreter to shadow
    assert server.name == "agentrl"


def test_without_the_sdk_the_error_says_how_to_install_it(tmp_path) -> None:
    import subprocess

    code = """
import sys
sys.modules["mcp"] = None  # as if not installed
import agentrl.cli
from agentrl.errors import ConfigError
from agentrl.mcp import McpClient, McpServerError, build_server
for make in (lambda: build_server([]), lambda: McpClient("http://127.0.0.1:1/mcp")):
    try:
        make()
    except ConfigError as exc:
        print(exc)
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, **child_env()})
    lines = out.stdout.strip().splitlines()
    assert out.returncode == 0 and len(lines) == 2, out.stderr[-2000:]
    assert all("pip install 'agentrl[mcp]'" in line for line in lines)


async def test_http_with_a_token_refuses_requests_without_it() -> None:
    port = free_port()
    args = agentrl_serve_args("--transport", "http", "--port", str(port), "--sandbox", "none", "--token", "s3cret")
    with http_server(args, port) as endpoint:
        with pytest.raises(McpServerError, match="could not be started"):
            await McpClient.http(endpoint, connect_timeout_s=20).start()
        async with McpClient.http(endpoint, headers={"Authorization": "Bearer s3cret"}) as client:
            assert {t.name for t in await client.tools()} == TOOLS - {"python"}
            assert await client.call("add", {"a": 1, "b": 2}) == "3"


async def test_an_interpreter_closed_for_idling_is_restarted_and_says_so() -> None:
    """The sandbox closes interpreters left idle (``session_idle_s``); the MCP session outlives that, so its next
    call gets a fresh interpreter and a note that the old variables are gone (not a SandboxError forever)."""
    import asyncio

    from agentrl.sandbox import make_sandbox

    async with make_sandbox("local", max_concurrency=2, session_idle_s=1.0) as sandbox:
        server = build_server([], sandbox=sandbox, one_client=True)
        async with Client(server) as client:  # in process: the server object itself, no transport
            await client.call_tool("python", {"code": "x = 1"})
            assert text(await client.call_tool("python", {"code": "print(x)"})) == "1"
            await asyncio.sleep(2.0)
            result = await client.call_tool("python", {"code": "print('x' in globals())"})
    assert not result.is_error and text(result).splitlines() == [
        "(the interpreter had been idle too long and was restarted: earlier variables are gone)", "False"]
