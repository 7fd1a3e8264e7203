"""``tool_choice`` honoured by constrained decoding: ``"required"`` or a named function becomes an EBNF grammar of
the builtin ``<tool_call>`` format (Hermes / Qwen 2.5 / SmolLM2), which SGLang's grammar backend enforces.

    required      <tool_call>\\n{"name": "<one of the tools>", "arguments": {…}}\\n</tool_call>  (one or more, "\\n"-separated)
    <name>        exactly one such call, of that function

The arguments are a JSON object written as ``json.dumps`` writes it (", " and ": " separators, no other
whitespace). Its keys are the names the tool's ``parameters.properties`` declares (any string when it declares
none or allows ``additionalProperties``); the values are any JSON: types, required keys and repeats are not
enforced (the tool checks its arguments, as with ``auto``). ``auto`` and ``none`` add nothing. A request that
brings its own ``regex``/``ebnf`` keeps it (the gateway adds none). Refused with a :class:`MessageError` (HTTP
400): ``required``/a name with another tool parser than the builtin one (its format is the model family's), a name
no tool has, ``required`` without tools.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from agentrl.env.tool_parsers import BUILTIN, TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from agentrl.gateway.base import ChatCall
from agentrl.gateway.messages import MessageError

SUPPORTED = '"auto", "none", "required" or a function ({"type": "function", "function": {"name": …}})'

# a JSON value as json.dumps writes it; strings without control characters
_JSON = r'''
object ::= "{" (pair (", " pair)*)? "}"
pair ::= string ": " value
array ::= "[" (value (", " value)*)? "]"
value ::= object | array | string | number | "true" | "false" | "null"
string ::= "\"" ([^"\\\x00-\x1f] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F]))* "\""
number ::= "-"? ("0" | [1-9] [0-9]*) ("." [0-9]+)? ([eE] [-+]? [0-9]+)?
'''


def tool_call_ebnf(tools: Sequence[Mapping[str, Any]], *, many: bool) -> str:
    """The grammar of a turn that is only builtin-format calls of ``tools`` (OpenAI function tools): one, or
    (``many``) one or more."""
    head = _literal(TOOL_CALL_OPEN + '\n{"name": ')
    tail = _literal("}\n" + TOOL_CALL_CLOSE)
    arguments = _literal(', "arguments": ')
    rules = ['root ::= call ("\\n" call)*' if many else "root ::= call",
             "call ::= " + " | ".join(f"call{i}" for i in range(len(tools)))]
    for i, tool in enumerate(tools):
        name = _literal(json.dumps(tool["function"]["name"], ensure_ascii=False))
        keys = _declared(tool["function"].get("parameters"))
        if keys is None:
            rules.append(f"call{i} ::= {head} {name} {arguments} object {tail}")
        elif not keys:
            rules.append(f'call{i} ::= {head} {name} {arguments} "{{}}" {tail}')
        else:
            rules.append(f"call{i} ::= {head} {name} {arguments} args{i} {tail}")
            rules.append(f'args{i} ::= "{{" (pair{i} (", " pair{i})*)? "}}"')
            rules.append(f'pair{i} ::= ({" | ".join(_literal(json.dumps(k, ensure_ascii=False)) for k in keys)}) '
                         '": " value')
    return "\n".join(rules) + _JSON


def _declared(parameters: Any) -> list[str] | None:
    """The argument names a parameters schema declares; None: any name (none declared, or more allowed)."""
    if not isinstance(parameters, Mapping) or not isinstance(parameters.get("properties"), Mapping):
        return None
    if parameters.get("additionalProperties", False) not in (False, None):
        return None
    return [str(k) for k in parameters["properties"]]


def constrain(call: ChatCall, tool_parser: str) -> ChatCall:
    """``call`` with the grammar its ``tool_choice`` asks for (see the module docstring), or a MessageError."""
    choice = call.tool_choice
    if choice in ("auto", "none"):
        return call
    names = [t["function"]["name"] for t in call.tools]
    if not names:
        raise MessageError(f"tool_choice {choice!r} needs tools; send tools or use tool_choice \"auto\"")
    if choice != "required" and choice not in names:
        raise MessageError(f"tool_choice names the function {choice!r}, which is not among the tools {names}; "
                           f"tool_choice must be {SUPPORTED}")
    if tool_parser != BUILTIN:
        raise MessageError(f"tool_choice {choice!r} is enforced only with the builtin <tool_call> parser; this "
                           f"gateway parses tool calls with {tool_parser!r}: use tool_choice \"auto\" (or force "
                           "the call yourself with a regex/ebnf in the request)")
    if call.regex or call.ebnf:
        return call  # the request's own constraint
    chosen = call.tools if choice == "required" else [t for t in call.tools if t["function"]["name"] == choice]
    return replace(call, ebnf=tool_call_ebnf(chosen, many=choice == "required"))


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)  # an EBNF string literal: the same escapes as JSON's
