"""The OpenAI Agents SDK and LangGraph agents of ``examples/openai_agent/`` drive the gateway on the shared real
SGLang server (tiny random model): a tool call, its result fed back, a final answer; one branch, exact tokens.

The frameworks live in their own venv (``.venv-agents``, made by ``scripts/install_agents_venv.sh``; ``make test``
runs it, this module too if needed): ``openai-agents`` needs ``openai>=3`` and this venv has SGLang's
``openai==2.8.0``. Each agent runs as a subprocess, as a user's agent process would. The random model calls no tool
by itself: the agents' ``--force-tool-call`` constrains the turns before the first tool result with SGLang's regex
(``extra_body``, per call: a ``ModelSettings`` override in the SDK, an ``ainvoke`` keyword in LangChain).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest
from gateway_support import Served, check_branch

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "openai_agent"


@pytest.fixture(scope="session")
def agents_python() -> Path:
    """The Python of the agent frameworks' venv (created or brought up to date first: ~20 s once, then a no-op)."""
    venv = Path(os.environ.get("AGENTRL_AGENTS_VENV") or ROOT / ".venv-agents").resolve()
    subprocess.run(["bash", str(ROOT / "scripts" / "install_agents_venv.sh"), str(venv)], check=True, timeout=900)
    return venv / "bin" / "python"


async def _run_agent(python: Path, script: str, session: dict[str, str], *, stream: bool) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    args = [str(EXAMPLES / script), "--base-url", session["base_url"], "--api-key", session["api_key"],
            "--model", "tiny", "--max-tokens", "64", "--force-tool-call", *(["--stream"] if stream else []),
            "What is 2+3?"]
    proc = await asyncio.create_subprocess_exec(str(python), *args, env=env, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    try:
        async with asyncio.timeout(300):
            out, err = await proc.communicate()
    except TimeoutError:
        proc.kill()
        raise
    assert proc.returncode == 0, f"{script} failed:\n{err.decode()[-4000:]}"
    return json.loads(out.decode().strip().splitlines()[-1])


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("script", ["agents_sdk_agent.py", "langgraph_agent.py"])
async def test_framework_agent_completes_a_tool_episode_on_one_exact_branch(
        gateway: Served, agents_python: Path, chat_tokenizer, script: str, stream: bool) -> None:
    async with httpx.AsyncClient(timeout=60) as http:
        session = (await http.post(f"{gateway.url}/sessions")).json()
        out = await _run_agent(agents_python, script, session, stream=stream)
        done = (await http.post(f"{gateway.url}/sessions/{session['id']}/finalize")).json()

    # the episode: one tool call (forced), its result fed back, a free final answer
    sampled = [chat_tokenizer.decode(g["output_ids"]) for g in gateway.generations()]
    assert len(gateway.requests) == 2, (out, sampled)
    (call,) = out["tool_calls"]
    assert call["name"] == "add" and call["id"].startswith("call_") and set(call["arguments"]) == {"a", "b"}
    a, b = call["arguments"]["a"], call["arguments"]["b"]
    assert out["tool_results"] == [{"id": call["id"], "output": str(a + b)}]
    assert isinstance(out["final_output"], str)
    first, second = gateway.requests
    assert "regex" in first and "regex" not in second
    assert [t["function"]["name"] for t in first["tools"]] == ["add"] and second["tools"] == first["tools"]

    # the arguments are what the model sampled; the id and the arguments come back as the framework received them
    forced = re.match(r"<tool_call>\n(.*)\n</tool_call>", sampled[0])
    assert forced and json.loads(forced.group(1))["arguments"] == {"a": a, "b": b}, sampled[0]
    (sent,) = [m for m in second["messages"] if m["role"] == "assistant"]
    (sent_call,) = sent["tool_calls"]
    assert sent_call["id"] == call["id"] and sent_call["function"]["name"] == "add"
    assert json.loads(sent_call["function"]["arguments"]) == {"a": a, "b": b}
    (result,) = [m for m in second["messages"] if m["role"] == "tool"]
    assert result["tool_call_id"] == call["id"] and str(result["content"]) == str(a + b)

    # a linear agent: exactly one branch, the second turn bridged onto the sampled ids, the invariant holds
    (branch,) = done["branches"]
    assert [t["bridged"] for t in branch["turns"]] == [False, True]
    assert branch["turns"][0]["tool_calls"] == 1 and not branch["turns"][0]["ill_formed"]
    check_branch(branch, gateway.generations())
