"""An agent you already have: a plain ``openai`` client loop with a calculator tool, trained as it is.

Nothing here knows about RL. The only link to agentrl is the decorator, which registers ``solve`` as an
environment of the ``agent`` kind: a training run calls it once per sample with a ``client`` whose ``base_url``
points at agentrl's gateway (one session per call), which keeps the token ids the model sampled, and scores the
returned text with the math reward (its last ``\\boxed{}`` against the task's answer).

    agentrl train examples/openai_agent/train.yaml

The same function runs against any OpenAI-compatible server, e.g. a model served by ``agentrl gateway serve``:

    agentrl gateway serve --model smollm2-135m-instruct --port 8100 &
    python examples/openai_agent/agent.py --gateway http://127.0.0.1:8100 "What is 17 * 23 + 4?"
"""

from __future__ import annotations

import ast
import asyncio
import json
import operator
import sys
from typing import Any

import openai

import agentrl

SYSTEM = ("You are a careful calculator. Use the calculate tool for any arithmetic, then give the final number "
          "as \\boxed{answer}.")
TOOLS = [{"type": "function", "function": {
    "name": "calculate",
    "description": "Evaluate an arithmetic expression (+, -, *, /, //, %, ** and parentheses).",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
}}]
MAX_TURNS = 4

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
        ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(expression: str) -> str:
    """The tool: arithmetic only (an AST walk, no eval); a mistake comes back as text for the model to read."""
    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            right = value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large")
            return _OPS[type(node.op)](value(node.left), right)  # type: ignore[operator]
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))  # type: ignore[operator]
        raise ValueError(f"unsupported: {ast.dump(node)[:60]}")

    try:
        result = value(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, RecursionError) as exc:
        return f"error: {exc}"
    return str(int(result)) if float(result).is_integer() else f"{result:.6g}"


def _run_tool(call: Any) -> str:
    try:
        args = json.loads(call.function.arguments or "{}")
    except json.JSONDecodeError:
        return "error: the arguments are not JSON"
    if call.function.name != "calculate" or not isinstance(args, dict):
        return f"error: unknown tool {call.function.name!r}"
    return calculate(str(args.get("expression", "")))


@agentrl.agent("calculator_agent", reward="math", timeout_s=600)
async def solve(task: agentrl.Task, client: agentrl.ClientConfig) -> str:
    """Arithmetic word problems with a calculator tool (a plain openai client loop)."""
    return await _solve(task, client)


#: the first turn of ``calculator_agent_forced``: a short calculate call (SGLang's regex, through the gateway)
FORCE_CALCULATE = (r'<tool_call>\n\{"name": "calculate", "arguments": \{"expression": "[1-9][0-9]? [-+*] '
                   r'[1-9][0-9]?"\}\}\n</tool_call>')


@agentrl.agent("calculator_agent_forced", reward="math", timeout_s=600)
async def solve_forced(task: agentrl.Task, client: agentrl.ClientConfig) -> str:
    """``solve`` with its first turn constrained to a calculate call: for a model that never calls a tool by
    itself (the tiny random test model), so that episodes are multi-turn. Not for real training."""
    return await _solve(task, client, force_first_call=True)


async def _solve(task: agentrl.Task, client: agentrl.ClientConfig, *, force_first_call: bool = False) -> str:
    # client.http_client: the gateway in this process, reached without a socket (None when it is elsewhere)
    llm = openai.AsyncOpenAI(base_url=client.base_url, api_key=client.api_key, timeout=300, max_retries=2,
                             http_client=client.http_client)
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task.prompt}]
    async with llm:
        for turn in range(MAX_TURNS):
            forced = {"extra_body": {"regex": FORCE_CALCULATE}} if force_first_call and turn == 0 else {}
            reply = await llm.chat.completions.create(model=client.model, messages=messages,  # type: ignore[arg-type]
                                                      tools=TOOLS, max_tokens=256, **forced)  # type: ignore[arg-type]
            msg = reply.choices[0].message
            if not msg.tool_calls:
                return msg.content or ""
            messages.append({"role": "assistant", "content": msg.content or "", "tool_calls": [
                {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
                for c in msg.tool_calls]})
            messages += [{"role": "tool", "tool_call_id": c.id, "content": _run_tool(c)} for c in msg.tool_calls]
    return msg.content or ""


async def _main(gateway: str, question: str) -> None:
    """One episode against a running ``agentrl gateway serve``: a session, the agent, the session's tokens."""
    import httpx

    async with httpx.AsyncClient(base_url=gateway, timeout=60) as http:
        session = (await http.post("/sessions")).json()
        client = agentrl.ClientConfig(base_url=session["base_url"], api_key=session["api_key"], model="agentrl")
        answer = await solve(agentrl.Task(id="cli", prompt=question), client)
        branches = (await http.post(f"/sessions/{session['id']}/finalize")).json()["branches"]
    print(answer)
    print(f"({len(branches)} branch(es), {sum(map(sum, (b['loss_mask'] for b in branches)))} sampled tokens)")


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "--gateway":
        sys.exit("usage: python examples/openai_agent/agent.py --gateway URL QUESTION")
    asyncio.run(_main(sys.argv[2], sys.argv[3]))
