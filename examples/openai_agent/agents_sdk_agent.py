"""An OpenAI Agents SDK agent with one tool (``add``), its model served by the agentrl gateway.

The SDK talks Chat Completions to the session's ``base_url`` (``OpenAIChatCompletionsModel``; tracing off: it
would upload to OpenAI). Run it in its own venv — the SDK needs ``openai>=3``, SGLang's venv pins ``openai==2.8.0``:

    bash scripts/install_agents_venv.sh                  # .venv-agents: openai-agents, langgraph, langchain-openai
    agentrl gateway serve --model smollm2-135m-instruct &
    .venv-agents/bin/python examples/openai_agent/agents_sdk_agent.py --gateway http://127.0.0.1:8100 \\
        --force-tool-call "What is 2+3?"

``--gateway`` creates a session, runs the agent in it and finalizes it (the branches' sizes are printed); or give a
session's ``--base-url`` and ``--api-key`` (env ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY``). ``--force-tool-call``
constrains the turns before the first tool result to a Hermes ``<tool_call>`` block for ``add`` (SGLang's regex,
sent as ``extra_body``; the gateway's ``builtin`` tool parser reads it back): for a model too small to call a tool
by itself. The SDK resolves one ``ModelSettings`` per agent, so the per-turn choice is a small
``OpenAIChatCompletionsModel`` subclass. Prints one JSON line: the final output, the tool calls as the SDK parsed
them (id, name, arguments) and the tool results it sent back.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import session_cli  # this folder's: the shared command line
from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
from agents.items import ToolCallItem, ToolCallOutputItem
from openai import AsyncOpenAI

FORCE_ADD = r'<tool_call>\n\{"name": "add", "arguments": \{"a": [1-9][0-9]?, "b": [1-9][0-9]?\}\}\n</tool_call>'
INSTRUCTIONS = "Answer arithmetic questions. Use the add tool to add numbers, then give the result."


@function_tool
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first integer.
        b: the second integer.
    """
    return a + b


class FirstTurnsForced(OpenAIChatCompletionsModel):
    """Sends ``extra_body={"regex": regex}`` until the input holds a tool result, nothing extra afterwards."""

    def __init__(self, model: str, openai_client: AsyncOpenAI, regex: str) -> None:
        super().__init__(model=model, openai_client=openai_client)
        self.regex = regex

    def _settings(self, items: Any, settings: ModelSettings) -> ModelSettings:
        if isinstance(items, list) and any(isinstance(i, dict) and i.get("type") == "function_call_output"
                                           for i in items):
            return settings
        return dataclasses.replace(settings, extra_body={**dict(settings.extra_body or {}), "regex": self.regex})

    async def get_response(self, system_instructions, input, model_settings, *args, **kwargs):  # type: ignore[override]
        return await super().get_response(system_instructions, input, self._settings(input, model_settings),
                                          *args, **kwargs)

    def stream_response(self, system_instructions, input, model_settings, *args, **kwargs):  # type: ignore[override]
        return super().stream_response(system_instructions, input, self._settings(input, model_settings),
                                       *args, **kwargs)


async def run_agent(question: str, *, base_url: str, api_key: str, model: str = "agentrl", max_tokens: int = 256,
                    force_tool_call: bool = False, stream: bool = False, max_turns: int = 6) -> dict[str, Any]:
    """One episode; returns the final output, the tool calls (id, name, arguments) and the results sent back."""
    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, timeout=300)
    llm = (FirstTurnsForced(model, client, FORCE_ADD) if force_tool_call
           else OpenAIChatCompletionsModel(model=model, openai_client=client))
    agent = Agent(name="calculator", instructions=INSTRUCTIONS, tools=[add], model=llm,
                  model_settings=ModelSettings(max_tokens=max_tokens))
    if stream:
        result: Any = Runner.run_streamed(agent, question, max_turns=max_turns)
        async for _ in result.stream_events():
            pass
    else:
        result = await Runner.run(agent, question, max_turns=max_turns)
    calls = [{"id": i.raw_item.call_id, "name": i.raw_item.name, "arguments": json.loads(i.raw_item.arguments)}
             for i in result.new_items if isinstance(i, ToolCallItem)]
    outputs = [{"id": i.raw_item["call_id"], "output": i.raw_item["output"]}
               for i in result.new_items if isinstance(i, ToolCallOutputItem)]
    await client.close()
    return {"final_output": str(result.final_output), "tool_calls": calls, "tool_results": outputs}


if __name__ == "__main__":
    session_cli.main(run_agent, __doc__, stream_help="Runner.run_streamed instead of Runner.run")
