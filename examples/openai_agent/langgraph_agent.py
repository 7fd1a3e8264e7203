"""A LangGraph agent with one tool (``add``), its model served by the agentrl gateway.

The classic two-node graph (model → tools → model …, ``tools_condition`` ends it) on ``langchain-openai``'s
``ChatOpenAI`` pointed at the session's ``base_url``. Run it in its own venv (as the Agents SDK example; LangChain
pulls a newer ``openai`` than SGLang's venv pins):

    bash scripts/install_agents_venv.sh                  # .venv-agents: openai-agents, langgraph, langchain-openai
    agentrl gateway serve --model smollm2-135m-instruct &
    .venv-agents/bin/python examples/openai_agent/langgraph_agent.py --gateway http://127.0.0.1:8100 \\
        --force-tool-call "What is 2+3?"

``--gateway`` creates a session, runs the agent in it and finalizes it (the branches' sizes are printed); or give a
session's ``--base-url`` and ``--api-key`` (env ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY``). ``--force-tool-call``
constrains the model turns before the first tool result to a Hermes ``<tool_call>`` block for ``add`` (SGLang's
regex, passed per call as ``extra_body``; the gateway's ``builtin`` tool parser reads it back): for a model too
small to call a tool by itself. Prints one JSON line: the final answer, the tool calls as LangChain parsed them
(id, name, arguments) and the tool results it sent back.
"""

from __future__ import annotations

from typing import Any

import session_cli  # this folder's: the shared command line
from langchain_core.messages import AIMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

FORCE_ADD = r'<tool_call>\n\{"name": "add", "arguments": \{"a": [1-9][0-9]?, "b": [1-9][0-9]?\}\}\n</tool_call>'
INSTRUCTIONS = "Answer arithmetic questions. Use the add tool to add numbers, then give the result."


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def build_graph(llm: ChatOpenAI, *, force_tool_call: bool = False) -> Any:
    """model ⇄ tools until the model answers without a tool call."""
    model = llm.bind_tools([add])

    async def call_model(state: MessagesState) -> dict[str, Any]:
        messages = state["messages"]
        extra = {}
        if force_tool_call and not any(isinstance(m, ToolMessage) for m in messages):
            extra = {"extra_body": {"regex": FORCE_ADD}}
        return {"messages": [await model.ainvoke([SystemMessage(INSTRUCTIONS), *messages], **extra)]}

    graph = StateGraph(MessagesState)
    graph.add_node("model", call_model)
    graph.add_node("tools", ToolNode([add]))
    graph.add_edge(START, "model")
    graph.add_conditional_edges("model", tools_condition)
    graph.add_edge("tools", "model")
    return graph.compile()


async def run_agent(question: str, *, base_url: str, api_key: str, model: str = "agentrl", max_tokens: int = 256,
                    force_tool_call: bool = False, stream: bool = False, max_turns: int = 6) -> dict[str, Any]:
    """One episode; returns the final answer, the tool calls (id, name, arguments) and the results sent back."""
    llm = ChatOpenAI(model=model, base_url=base_url, api_key=api_key, max_tokens=max_tokens, timeout=300,
                     streaming=stream)
    app = build_graph(llm, force_tool_call=force_tool_call)
    state = await app.ainvoke({"messages": [("user", question)]}, {"recursion_limit": 2 * max_turns})
    messages = state["messages"]
    calls = [{"id": c["id"], "name": c["name"], "arguments": c["args"]}
             for m in messages if isinstance(m, AIMessage) for c in m.tool_calls]
    outputs = [{"id": m.tool_call_id, "output": m.content} for m in messages if isinstance(m, ToolMessage)]
    return {"final_output": str(messages[-1].content), "tool_calls": calls, "tool_results": outputs}


if __name__ == "__main__":
    session_cli.main(run_agent, __doc__, stream_help="ChatOpenAI(streaming=True)")
