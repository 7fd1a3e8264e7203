"""Tool-call parsers: agentrl's ``builtin`` one and SGLang's (``env.options.tool_parser``) on real-format model
turns of each family (one call, two calls, a malformed call, an unknown tool), the episode-level dispatch through
them, the cost boundary (no sglang import until a parser reads a turn), and tool schemas rendered by real chat
formats (the bundled SmolLM2 template; Mistral's own tokenizer from ``mistral_common``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from agentrl.env import EnvResources, ToolCallingEnv, make_tool_parser, tool
from agentrl.env.tool_parsers import BUILTIN
from agentrl.errors import ConfigError
from agentrl.rewards import RewardInput, RewardResult
from agentrl.types import Task

ROOT = Path(__file__).resolve().parents[2]


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@tool
def lookup(key: str, keys: list[str] | None = None) -> dict:
    """Look a key up."""
    return {"key": key, "keys": keys}


TOOLS = [add, lookup]

Call = tuple[str, str]  # (tool name, arguments as the model wrote them: JSON text)
DS_CALLS, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_SEP, DS_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"

#: each family's tool-call turn as its models write it (formats of the models' chat templates / model cards)
FORMATS: dict[str, Callable[[list[Call]], str]] = {
    BUILTIN: lambda calls: "Let me compute.\n" + "\n".join(
        f'<tool_call>\n{{"name": "{n}", "arguments": {a}}}\n</tool_call>' for n, a in calls),
    "qwen25": lambda calls: "Let me compute.\n" + "\n".join(
        f'<tool_call>\n{{"name": "{n}", "arguments": {a}}}\n</tool_call>' for n, a in calls),
    "hermes": lambda calls: "".join(f'<tool_call>{{"name": "{n}", "arguments": {a}}}</tool_call>' for n, a in calls),
    "llama3": lambda calls: "<|python_tag|>" + ";".join(f'{{"name": "{n}", "parameters": {a}}}' for n, a in calls),
    "mistral": lambda calls: "[TOOL_CALLS] [" + ", ".join(
        f'{{"name": "{n}", "arguments": {a}}}' for n, a in calls) + "]",
    "deepseekv3": lambda calls: DS_CALLS + "\n".join(
        f"{DS_CALL}function{DS_SEP}{n}\n```json\n{a}\n```{DS_END}" for n, a in calls) + DS_CALLS_END,
    "deepseekv31": lambda calls: DS_CALLS + "".join(f"{DS_CALL}{n}{DS_SEP}{a}{DS_END}" for n, a in calls)
    + DS_CALLS_END,
}
PARSERS = list(FORMATS)

ADD = {"a": 3, "b": -4}
LOOKUP = {"key": 'naïve "quoted" \\ key', "keys": ["x", "ÿ"]}


def written(args: dict) -> str:
    return json.dumps(args, ensure_ascii=False)


@pytest.mark.parametrize("parser", PARSERS)
def test_one_call_round_trips(parser):
    [c] = make_tool_parser(parser, TOOLS).parse(FORMATS[parser]([("lookup", written(LOOKUP))]))
    assert (c.name, c.arguments, c.error) == ("lookup", LOOKUP, None)
    assert lookup.validate(c.arguments) == LOOKUP


@pytest.mark.parametrize("parser", PARSERS)
def test_two_calls_in_order(parser):
    calls = make_tool_parser(parser, TOOLS).parse(FORMATS[parser]([("add", written(ADD)),
                                                                   ("lookup", written(LOOKUP))]))
    assert [(c.name, c.arguments, c.error) for c in calls] == [("add", ADD, None), ("lookup", LOOKUP, None)]


@pytest.mark.parametrize("parser", PARSERS)
def test_a_malformed_call_is_an_error_call_not_an_exception(parser):
    calls = make_tool_parser(parser, TOOLS).parse(FORMATS[parser]([("add", '{"a": }')]))
    assert len(calls) == 1 and calls[0].error
    if parser != BUILTIN:
        assert "the tool call could not be read" in calls[0].error and "write each call like" in calls[0].error


@pytest.mark.parametrize("parser", [p for p in PARSERS if p in ("qwen25", "hermes", "deepseekv3", "deepseekv31")])
def test_a_malformed_call_beside_a_good_one_is_reported(parser):
    """Formats with one marker per call: the count of calls read is checked against the count started."""
    calls = make_tool_parser(parser, TOOLS).parse(FORMATS[parser]([("add", written(ADD)), ("add", '{"a": ')]))
    assert calls[-1].error and "of 2 tool calls could not be read" in calls[-1].error
    assert all(c.error is None and c.arguments == ADD for c in calls[:-1])


@pytest.mark.parametrize("parser", PARSERS)
def test_a_call_of_an_unknown_tool_is_kept_for_the_env_to_answer(parser):
    calls = make_tool_parser(parser, TOOLS).parse(FORMATS[parser]([("mul", written(ADD)), ("add", written(ADD))]))
    assert [(c.name, c.arguments, c.error) for c in calls] == [("mul", ADD, None), ("add", ADD, None)]


@pytest.mark.parametrize("parser", PARSERS)
@pytest.mark.parametrize("text", ["The answer is \\boxed{5}.", ""])
def test_a_turn_without_a_call(parser, text):
    assert make_tool_parser(parser, TOOLS).parse(text) == []


# -- the environment ------------------------------------------------------------------------------------------

class CalcEnv(ToolCallingEnv):
    name = "calc"
    tools = (add, lookup)

    async def score(self, response: RewardInput) -> RewardResult:
        return RewardResult.scored(0.0)


@pytest.mark.parametrize("parser", PARSERS)
async def test_the_env_dispatches_through_its_parser(parser):
    env = CalcEnv(EnvResources(), tool_parser=parser)
    await env.reset(Task(id="t", prompt="?"))
    r = await env.step(FORMATS[parser]([("add", written(ADD)), ("mul", "{}"), ("add", '{"a": "1", "b": 2}')]))
    assert [t.status for t in r.tool_results] == ["ok", "unknown_tool", "malformed"]
    assert [m["content"] for m in r.observation.messages][:2] == ["-1", "Error: unknown tool 'mul'; available: add, lookup"]
    assert "argument 'a': expected a valid integer, got \"1\"" in r.observation.messages[2]["content"]
    bad = await env.step(FORMATS[parser]([("add", '{"a": }')]))
    assert not bad.done and bad.tool_results[0].status == "malformed" and bad.tool_calls[0].error


def test_unknown_parser_names_are_config_errors_that_list_the_known_ones():
    with pytest.raises(ConfigError, match=r"unknown tool_parser 'llama' \(did you mean 'llama3'\?\); known: "
                                          r"'builtin' .* and SGLang's .*\bmistral\b.*\bqwen25\b"):
        CalcEnv(EnvResources(), tool_parser="llama")


def test_without_sglang_its_parsers_are_a_config_error_and_builtin_still_works(monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", None)  # as if the package were not installed
    with pytest.raises(ConfigError, match=r"tool_parser 'llama3' is one of SGLang's .* not installed .*"
                                          r"tool_parser: builtin"):
        CalcEnv(EnvResources(), tool_parser="llama3")
    assert CalcEnv(EnvResources()).parser.name == BUILTIN


def test_sglang_is_imported_only_by_the_first_parse_and_leaves_the_environment_alone(tmp_path):
    code = textwrap.dedent(f"""
        import json, os, sys
        sys.path.insert(0, {str(ROOT / "tests" / "env")!r})
        import agentrl
        from test_tool_parsers import CalcEnv, FORMATS, ADD
        from agentrl.env import EnvResources
        env = CalcEnv(EnvResources(), tool_parser="llama3")
        before = "sglang" in sys.modules, "torch" in sys.modules, dict(os.environ)
        calls = env.parser.parse(FORMATS["llama3"]([("add", json.dumps(ADD))]))
        print(json.dumps({{"before": before[:2], "after": "sglang" in sys.modules,
                          "env_changed": sorted(set(os.environ.items()) ^ set(before[2].items())),
                          "calls": [[c.name, c.arguments] for c in calls]}}))
        """)
    env = {k: v for k, v in os.environ.items() if not k.endswith(("_CACHE_DIR", "_CACHE_PATH", "WORKSPACE_BASE"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["before"] == [False, False]  # building the env imported neither sglang nor torch
    assert out["after"] is True and out["calls"] == [["add", ADD]]
    assert out["env_changed"] == []


# -- schemas through real chat formats ------------------------------------------------------------------------

def test_schemas_are_openai_function_schemas_as_sglang_reads_them():
    make_tool_parser("qwen25", TOOLS).parse("")  # imports SGLang's parser module (and its OpenAI protocol)
    from sglang.srt.entrypoints.openai.protocol import Tool as OpenAITool

    for t in TOOLS:
        parsed = OpenAITool.model_validate(t.schema())
        assert parsed.type == "function" and parsed.function.name == t.name
        assert parsed.function.description == t.description and parsed.function.parameters == t.parameters


def test_tools_prompt_through_the_smollm2_template_and_its_answer_format(chat_tokenizer):
    """SmolLM2's template has no ``tools`` support: the Hermes block goes into the system message, and a turn in
    the format that block asks for reads back with the builtin, qwen25 and hermes parsers."""
    env = CalcEnv(EnvResources())
    prompt = chat_tokenizer.decode(chat_tokenizer.encode_prompt(
        [{"role": "system", "content": "You are a calculator."}, {"role": "user", "content": "3 + -4?"}],
        env.tool_schemas()))
    for schema in env.tool_schemas():
        assert json.dumps(schema, ensure_ascii=False) in prompt
    asked = prompt.split("<tool_call>\n", 1)[1].split("\n</tool_call>", 1)[0]
    assert asked == '{"name": <function-name>, "arguments": <args-json-object>}'
    turn = f'<tool_call>\n{{"name": "add", "arguments": {written(ADD)}}}\n</tool_call>'
    for parser in (BUILTIN, "qwen25", "hermes"):
        [c] = make_tool_parser(parser, TOOLS).parse(turn)
        assert (c.name, add.validate(c.arguments)) == ("add", ADD)


def test_mistral_tools_prompt_and_tool_call_turn_from_mistrals_own_tokenizer():
    """``mistral_common`` (installed with SGLang) renders Mistral's v3 format: our schemas go in as OpenAI tools,
    and the assistant turn it renders for two calls reads back through SGLang's ``mistral`` parser."""
    pytest.importorskip("mistral_common")
    from mistral_common.protocol.instruct.messages import AssistantMessage, ToolMessage, UserMessage
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    from mistral_common.protocol.instruct.tool_calls import FunctionCall, ToolCall
    from mistral_common.protocol.instruct.tool_calls import Tool as MistralTool
    from mistral_common.tokens.tokenizers.base import SpecialTokenPolicy
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    tok = MistralTokenizer.v3()
    calls = [ToolCall(id="call00001", function=FunctionCall(name="add", arguments=written(ADD))),
             ToolCall(id="call00002", function=FunctionCall(name="lookup", arguments=written(LOOKUP)))]
    request = ChatCompletionRequest(
        tools=[MistralTool.model_validate(t.schema()) for t in TOOLS],
        messages=[UserMessage(content="3 + -4?"), AssistantMessage(content=None, tool_calls=calls),
                  ToolMessage(tool_call_id="call00001", name="add", content="-1"),
                  ToolMessage(tool_call_id="call00002", name="lookup", content="{}")])
    tokens = tok.encode_chat_completion(request).tokens
    text = tok.decode(tokens, special_token_policy=SpecialTokenPolicy.KEEP).replace("▁", " ")  # SentencePiece spaces
    assert '"name": "add", "description": "Add two integers."' in text.split("[/AVAILABLE_TOOLS]")[0]
    turn = "[TOOL_CALLS]" + text.split("[TOOL_CALLS]", 1)[1].split("</s>", 1)[0]
    parsed = make_tool_parser("mistral", TOOLS).parse(turn)
    assert [(c.name, c.arguments, c.error) for c in parsed] == [("add", ADD, None), ("lookup", LOOKUP, None)]
