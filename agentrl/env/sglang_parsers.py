"""SGLang's function-call parsers (``sglang.srt.function_call``) behind agentrl's :class:`ToolParser`.

Why a module of its own, imported late: importing any SGLang parser runs ``import sglang``, which imports torch,
transformers and torch.distributed (sglang 0.5.23 here: ~8 s and ~1 GB RSS in a bare process; ~1 s and ~50 MB
more in a rollout worker that has loaded torch already), patches transformers internals (compatibility shims)
and sets five cache-directory variables in ``os.environ`` (``TRITON_CACHE_DIR``, ``TORCHINDUCTOR_CACHE_DIR``,
``CUDA_CACHE_PATH``, ``TILELANG_CACHE_DIR``, ``FLASHINFER_WORKSPACE_BASE``); it initialises no CUDA. The
parser classes cannot be reached without it (their ``protocol`` module imports torch itself). Hence:

- ``import agentrl`` and building an environment never import sglang: the parser name is checked against
  SGLang's dependency-free ``parser_names.py``, read as a file (and a missing ``sglang`` package is a
  ConfigError then, before any episode);
- the first :meth:`SGLangToolParser.parse` in a process imports the parser module (the process that parses:
  a rollout worker, the eval server), and removes the environment variables that import added (they steer
  SGLang's kernel caches, which never run here, and would leak into every subprocess started later).

SGLang's detectors drop calls of tools they were not given and skip calls they cannot read, logging each at
WARNING or ERROR with the model's text; here they are the model's mistakes, answered to the model, so the
``sglang.srt.function_call`` logger is set to CRITICAL when it is imported (unless its level was configured).
The model must see both mistakes, so the detector is subclassed to keep every call it reads (an unknown name then
gets the environment's "unknown tool" answer), and a turn with fewer calls read than it started (counted by the
per-call marker where the format has one, else "a call was started and none was read") gets one more
:class:`ParsedCall` with ``error`` set. ``raw`` of a call read by SGLang is its ``{"name", "arguments"}`` JSON
(the detectors do not report where in the text a call was).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentrl.env.tool_parsers import BUILTIN, ParsedCall
from agentrl.errors import ConfigError, closest

if TYPE_CHECKING:
    from agentrl.env.tools import Tool

_PARSER_MODULE = "sglang.srt.function_call.function_call_parser"
_PROTOCOL_MODULE = "sglang.srt.entrypoints.openai.protocol"
_CORE_TYPES_MODULE = "sglang.srt.function_call.core_types"

#: formats with one marker per call: a turn's call count is the marker count (else: at least one if started)
CALL_MARKERS = {
    "hermes": "<tool_call>",
    "qwen": "<tool_call>",
    "qwen25": "<tool_call>",
    "deepseekv3": "<｜tool▁call▁begin｜>",
    "deepseekv31": "<｜tool▁call▁begin｜>",
}


def sglang_parser_names() -> list[str] | None:
    """SGLang's tool-call parser names without importing sglang (read from its ``parser_names.py``); ``None``
    when the ``sglang`` package is not installed, ``[]`` when it is but keeps its names elsewhere."""
    try:
        spec = importlib.util.find_spec("sglang")  # finds the top-level package without running its __init__
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        path = Path(root, "srt", "function_call", "parser_names.py")
        if not path.is_file():
            continue
        for node in ast.parse(path.read_text()).body:
            if (isinstance(node, ast.Assign)
                    and any(isinstance(t, ast.Name) and t.id == "TOOL_CALL_PARSER_NAMES" for t in node.targets)):
                return [str(n) for n in ast.literal_eval(node.value)]
    return []


def _unknown(name: str, names: Sequence[str]) -> ConfigError:
    close = closest(name, [BUILTIN, *names])
    hint = f" (did you mean {close!r}?)" if close else ""
    return ConfigError(f"unknown tool_parser {name!r}{hint}; known: {BUILTIN!r} (agentrl's <tool_call> parser) "
                       f"and SGLang's {', '.join(names)}")


class SGLangToolParser:
    """One SGLang detector (by its ``--tool-call-parser`` name) reading the calls of the given tools."""

    def __init__(self, name: str, tools: Sequence[Tool | Mapping[str, Any]]) -> None:
        names = sglang_parser_names()
        if names is None:
            raise ConfigError(
                f"tool_parser {name!r} is one of SGLang's function-call parsers, but the sglang package is not "
                f"installed in this Python ({sys.executable}); install it there (pip install sglang) or use "
                f"tool_parser: {BUILTIN} (the <tool_call>{{json}}</tool_call> format)")
        if names and name not in names:
            raise _unknown(name, names)
        self.name = name
        self._schemas = [dict(t) if isinstance(t, Mapping) else t.schema() for t in tools]
        self._detector_cls: Any = None  # resolved by the first parse (which imports sglang)
        self._sgl_tools: list[Any] = []

    def parse(self, text: str) -> list[ParsedCall]:
        """Every call of ``text``; calls that could not be read become one ParsedCall with ``error``."""
        detector = self._detector()
        marker = CALL_MARKERS.get(self.name)
        started = text.count(marker) if marker else int(bool(detector.has_tool_call(text)))
        if not started:
            return []
        reason = ""
        try:
            items = detector.detect_and_parse(text, self._sgl_tools).calls
        except Exception as exc:  # noqa: BLE001  (the detector failed on the model's text: the model's mistake)
            items, reason = [], f" ({type(exc).__name__}: {exc})"
        calls = [_to_call(item.name, item.parameters) for item in items]
        if len(calls) < started:
            first = text.find(marker) if marker else -1
            what = "the tool call" if started == 1 else f"{started - len(calls)} of {started} tool calls"
            calls.append(ParsedCall("", raw=text[first:] if first >= 0 else text, error=(
                f"{what} could not be read{reason}; {self._expected(detector)}")))
        return calls

    def _expected(self, detector: Any) -> str:
        name = self._schemas[0]["function"]["name"] if self._schemas else "tool_name"
        try:
            info = detector.structure_info()(name)
        except Exception:  # noqa: BLE001  (a detector without a structure example)
            return f"write them in the {self.name} tool-call format"
        return f"write each call like {info.begin}{{...}}{info.end}"

    def _detector(self) -> Any:
        if self._detector_cls is None:
            module = _import_sglang(self.name)
            known = module.FunctionCallParser.ToolCallParserEnum
            if self.name not in known:
                raise _unknown(self.name, list(known))
            self._detector_cls = _keeping_every_call(known[self.name])
            protocol = sys.modules[_PROTOCOL_MODULE]
            self._sgl_tools = [protocol.Tool.model_validate(s) for s in self._schemas]
        try:
            return self._detector_cls()
        except TypeError as exc:
            raise ConfigError(f"SGLang's {self.name!r} tool parser needs constructor arguments agentrl does not "
                              f"pass ({exc}); choose another tool_parser") from exc


def _import_sglang(parser: str) -> Any:
    before = set(os.environ)
    try:
        module = importlib.import_module(_PARSER_MODULE)
    except Exception as exc:  # noqa: BLE001  (an ImportError, or whatever SGLang's import chain raises here)
        raise ConfigError(f"tool_parser {parser!r} needs SGLang's function-call parsers, but importing "
                          f"{_PARSER_MODULE} failed: {exc!r}; fix the sglang install in this Python "
                          f"({sys.executable}) or use tool_parser: {BUILTIN}") from exc
    finally:
        for key in set(os.environ) - before:  # SGLang's kernel-cache defaults (see the module docstring)
            os.environ.pop(key, None)
    quiet = logging.getLogger("sglang.srt.function_call")
    if quiet.level == logging.NOTSET:  # unless configured: the calls it would log are answered to the model
        quiet.setLevel(logging.CRITICAL)
    return module


def _keeping_every_call(detector_cls: type) -> type:
    """``detector_cls`` whose ``parse_base_json`` keeps calls of unknown tools and calls without a name (SGLang's
    drops them) with the same argument rule (``parameters``, else ``arguments``)."""
    tool_call_item = sys.modules[_CORE_TYPES_MODULE].ToolCallItem

    def parse_base_json(self: Any, action: Any, tools: Any) -> list[Any]:
        items = []
        for act in action if isinstance(action, list) else [action]:
            if not isinstance(act, dict):
                items.append(tool_call_item(tool_index=-1, name=None, parameters=json.dumps(act)))
                continue
            name = act.get("name")
            args = act.get("parameters") or act.get("arguments", {})
            items.append(tool_call_item(tool_index=-1, name=name if isinstance(name, str) else None,
                                        parameters=json.dumps(args, ensure_ascii=False)))
        return items

    return type(f"{detector_cls.__name__}KeepingEveryCall", (detector_cls,), {"parse_base_json": parse_base_json})


def _to_call(name: str | None, parameters: str) -> ParsedCall:
    expected = 'expected a tool name and a JSON object of arguments'
    try:
        args = json.loads(parameters) if parameters.strip() else {}
    except ValueError as exc:
        return ParsedCall(name or "", raw=parameters, error=f"the arguments are not valid JSON ({exc}); {expected}")
    if isinstance(args, str):  # arguments written as a JSON string holding the object, as some models do
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            pass
    raw = json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
    if not name:
        return ParsedCall("", raw=raw, error=f"the tool call has no name; {expected}")
    if not isinstance(args, dict):
        return ParsedCall(name, raw=raw, error=f"the arguments of {name} must be a JSON object; {expected}")
    return ParsedCall(name, args, raw)
