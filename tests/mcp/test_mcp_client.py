"""agentrl.mcp.client: a real MCP server process (the SDK's ``MCPServer`` in mcp_test_server.py, over stdio and over
streamable HTTP on 127.0.0.1) consumed through ``McpClient`` by an environment's tool calls: results become
observations, the tool's own errors become error observations, bad arguments are refused before any call, and a
server that hangs, dies or never starts is an infrastructure error, never an observation or a score."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator, Iterator

import pytest
from mcp_support import TEST_SERVER, free_port, http_server

from agentrl.async_rollout import EpisodeRunner
from agentrl.engine.base import SamplingParams
from agentrl.env import EnvResources, ToolArgumentsError, ToolCallingEnv
from agentrl.errors import InfrastructureError
from agentrl.mcp import McpClient, McpServerError, McpTool, McpToolError
from agentrl.rewards import RewardInput, RewardResult
from agentrl.types import Task


class McpCalcEnv(ToolCallingEnv):
    """An ordinary tool-calling environment; its tools come from an MCP server."""

    name = "mcp_calc"
    system_prompt = "You are a calculator."

    async def score(self, response: RewardInput) -> RewardResult:
        return RewardResult.scored(1.0 if "\\boxed{5}" in response.text else 0.0)


def call(name: str, **arguments: object) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


@pytest.fixture(scope="module")
def http_url() -> Iterator[str]:
    port = free_port()
    with http_server([TEST_SERVER, "http", str(port)], port) as url:
        yield url


@pytest.fixture(scope="module", params=["stdio", "http"])
async def client(request: pytest.FixtureRequest) -> AsyncIterator[McpClient]:
    if request.param == "stdio":
        mcp = McpClient.stdio(sys.executable, [TEST_SERVER, "stdio"], call_timeout_s=5.0)
    else:
        mcp = McpClient.http(request.getfixturevalue("http_url"), call_timeout_s=5.0,
                             headers={"Authorization": "Bearer not-checked"})
    async with mcp:
        yield mcp


async def env_with(client: McpClient, **options: object) -> McpCalcEnv:
    env = McpCalcEnv(EnvResources(), tools=await client.tools(), tool_timeout_s=10.0, **options)
    await env.reset(Task(id="t", prompt="2+3?"))
    return env


async def test_the_servers_tools_become_agentrl_tools(client: McpClient) -> None:
    tools = {t.name: t for t in await client.tools()}
    assert set(tools) == {"add", "shout", "divide", "slow", "crash"}
    add = tools["add"]
    assert isinstance(add, McpTool) and add.description == "Add two integers."
    assert add.parameters["properties"]["a"]["type"] == "integer" and add.parameters["required"] == ["a", "b"]
    assert add.schema()["function"]["name"] == "add"  # what the chat template renders
    assert tools["shout"].validate({"text": "hi"}) == {"text": "hi"}  # the server's default applies there


async def test_arguments_are_checked_against_the_listed_schema(client: McpClient) -> None:
    add = {t.name: t for t in await client.tools()}["add"]
    with pytest.raises(ToolArgumentsError) as exc:
        add.validate({"a": "2"})
    assert str(exc.value) == ("invalid arguments for add(a, b): argument 'b' is missing; "
                              "argument 'a': '2' is not of type 'integer'")
    with pytest.raises(ToolArgumentsError, match="must be a JSON object"):
        add.validate([1, 2])


async def test_an_environment_calls_the_tool_and_reads_its_answer(client: McpClient) -> None:
    env = await env_with(client)
    result = await env.step(call("add", a=2, b=3) + call("shout", text="hi", times=2))
    assert [r.status for r in result.tool_results] == ["ok", "ok"]
    assert [m["content"] for m in result.observation.messages] == ["5", "HI HI"]


async def test_a_tool_error_is_the_models_mistake_shown_as_an_observation(client: McpClient) -> None:
    env = await env_with(client)
    result = await env.step(call("divide", a=1, b=0))
    [r] = result.tool_results
    assert r.status == "Error" and "cannot divide by zero" in r.output and not result.done
    with pytest.raises(McpToolError, match="Unknown tool: nope"):  # the SDK's server answers isError for it
        await client.call("nope", {})


async def test_bad_arguments_never_reach_the_server(client: McpClient) -> None:
    env = await env_with(client)
    result = await env.step(call("add", a=2))
    [r] = result.tool_results
    assert r.status == "malformed" and "argument 'b' is missing" in r.output


async def test_a_call_past_the_deadline_is_an_infrastructure_error(client: McpClient) -> None:
    env = await env_with(client)
    t0 = asyncio.get_running_loop().time()
    with pytest.raises(McpServerError, match="tools/call slow") as exc:
        await env.step(call("slow", seconds=30))
    assert isinstance(exc.value, InfrastructureError)
    assert asyncio.get_running_loop().time() - t0 < 25  # the 5 s deadline ended it, not the tool's 30 s
    assert (await client.call("add", {"a": 1, "b": 1})) == "2"  # the connection is still usable


async def test_calls_from_concurrent_episodes_share_one_connection(client: McpClient) -> None:
    answers = await asyncio.gather(*(client.call("add", {"a": i, "b": i}) for i in range(8)))
    assert answers == [str(2 * i) for i in range(8)]


async def test_a_whole_episode_with_an_mcp_tool(client: McpClient, chat_tokenizer) -> None:
    from env_support import ScriptedEngine  # tests/env's scripted engine: the model's turns as given

    engine = ScriptedEngine(chat_tokenizer, [(call("add", a=2, b=3), True), ("So \\boxed{5}.", True)])
    runner = EpisodeRunner(engine, chat_tokenizer, SamplingParams(max_new_tokens=64))
    async with McpCalcEnv(EnvResources(), tools=await client.tools(), tool_timeout_s=10.0) as env:
        traj = await runner.run(env, Task(id="t", prompt="2+3?"), env_name="mcp_calc")
    assert '"name": "add"' in chat_tokenizer.decode(engine.requests[0])  # the MCP tool's schema in the prompt
    assert traj.turns[0].tool_results[0].output == "5" and traj.reward == 1.0
    assert "5" in chat_tokenizer.decode(engine.requests[1][len(engine.requests[0]) + len(engine.outputs[0]):])


async def test_a_server_that_dies_is_an_infrastructure_error() -> None:
    async with McpClient.stdio(sys.executable, [TEST_SERVER, "stdio"], call_timeout_s=5) as client:
        env = await env_with(client)
        with pytest.raises(McpServerError, match="tools/call crash"):
            await env.step(call("crash"))
        with pytest.raises(McpServerError):
            await client.call("add", {"a": 1, "b": 1})


async def test_a_server_that_cannot_start_or_never_answers() -> None:
    with pytest.raises(McpServerError, match="could not be started"):
        await McpClient.stdio("/nonexistent/mcp-server").start()
    silent = McpClient.stdio("sleep", ["60"], connect_timeout_s=1.0)
    with pytest.raises(McpServerError, match="did not answer within 1s"):
        await silent.start()
    with pytest.raises(McpServerError, match="closed"):
        await silent.call("add", {})
    await silent.aclose()  # idempotent


async def test_nothing_connects_before_use_and_close_is_final() -> None:
    client = McpClient.stdio(sys.executable, [TEST_SERVER, "stdio"], call_timeout_s=5)
    assert (await client.call("add", {"a": 20, "b": 22})) == "42"  # connects on first use
    await client.aclose()
    with pytest.raises(McpServerError, match="closed"):
        await client.call("add", {"a": 1, "b": 1})
