"""Turning chat messages and observations into token ids, once, without re-tokenising what came before.

The prompt is rendered with the chat template and tokenised once. Later pieces are tokenised on their own and
appended: raw observation text (ReTool) as is, tool-role messages as the chat template's *delta* — the text the
template adds after a finished assistant message — so the sequence is exactly what the model saw.

Templates without a tools section (SmolLM2's) get the Hermes forms written into the messages instead: the tool list
in the system message (:func:`with_tools_in_system`), an assistant's calls as ``<tool_call>`` blocks in its content
(:func:`with_tool_calls_in_content`).
"""

from __future__ import annotations

import importlib
import json
import logging
import subprocess
import sys
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from agentrl.errors import ConfigError
from agentrl.models import read_json_cache, write_json_cache

logger = logging.getLogger(__name__)

# AutoTokenizer imports torch (its config machinery imports transformers' generation config, which imports torch):
# ~0.5 GB of RSS in each process that only tokenises (the run's controller and rollout actor, the gateway). Which
# class AutoTokenizer picks for a folder depends on rules that read the model's config (transformers'
# tokenization_auto); rather than copy them, a child interpreter asks AutoTokenizer once per folder and this
# process instantiates that class itself, as AutoTokenizer would.
_PICK = """
import sys
from transformers import AutoTokenizer
t = type(AutoTokenizer.from_pretrained(sys.argv[1]))
print(t.__module__, t.__qualname__)
"""
_PICKED: dict[str, tuple[str, str]] = {}
# What decides AutoTokenizer's pick for a local folder: these files (tokenizer_class, model_type, whether a fast
# tokenizer file exists) and the transformers version. The pick is cached on disk under this key, so a process
# that starts cold (the rollout actor, the gateway, each CLI call) does not pay the child's torch import each time.
_DECIDING_FILES = ("tokenizer_config.json", "config.json", "tokenizer.json")
CACHE_FILE = "tokenizer_class.json"


def _pick_key(path: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    folder = Path(path).resolve()
    try:
        transformers = version("transformers")
    except PackageNotFoundError:
        transformers = "?"
    stats = []
    for name in _DECIDING_FILES:
        try:
            st = (folder / name).stat()
            stats.append(f"{name}:{st.st_mtime_ns}:{st.st_size}")
        except OSError:
            stats.append(f"{name}:-")
    return f"{folder}|transformers {transformers}|{' '.join(stats)}"


def _pick_class(path: str, timeout_s: float) -> tuple[str, str] | None:
    """(module, class name) of the tokenizer AutoTokenizer picks for ``path``: from this process's memory, else the
    disk cache, else asked of a child interpreter; ``None`` (logged) if the child fails."""
    if path in _PICKED:
        return _PICKED[path]
    key = _pick_key(path)
    hit = read_json_cache(CACHE_FILE).get(key)
    if isinstance(hit, list) and len(hit) == 2 and all(isinstance(x, str) for x in hit):
        _PICKED[path] = (hit[0], hit[1])
        return _PICKED[path]
    try:
        done = subprocess.run([sys.executable, "-c", _PICK, path], capture_output=True, text=True,
                              timeout=timeout_s, check=True)
        module, name = done.stdout.split()[-2:]
    except (subprocess.SubprocessError, OSError, ValueError) as exc:
        err = (getattr(exc, "stderr", "") or "").strip()
        logger.warning("picking the tokenizer class of %s in a child failed (%s); AutoTokenizer in-process",
                       path, err.splitlines()[-1] if err else type(exc).__name__)
        return None
    _PICKED[path] = (module, name)
    write_json_cache(CACHE_FILE, key, list(_PICKED[path]))
    return _PICKED[path]


def load_hf_tokenizer(path: str | Path, *, timeout_s: float = 300.0) -> Any:
    """``AutoTokenizer.from_pretrained(path)``, without importing torch into this process when it has not been
    already: the class is picked by AutoTokenizer in a child interpreter (a few seconds, once per folder and
    tokenizer files, then cached on disk), then loaded here. Falls back to AutoTokenizer in-process if the child
    fails."""
    key = str(path)
    picked = None if "torch" in sys.modules else _pick_class(key, timeout_s)
    if picked is not None:
        try:
            cls = getattr(importlib.import_module(picked[0]), picked[1])
        except (ImportError, AttributeError) as exc:
            logger.warning("the tokenizer class %s.%s picked for %s is gone (%s); AutoTokenizer in-process",
                           picked[0], picked[1], key, exc)
        else:
            return cls.from_pretrained(key, _from_auto=True)  # what AutoTokenizer passes for a local folder
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(key)


_BASE = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]


def hermes_tools_text(tools: Sequence[Mapping[str, Any]]) -> str:
    """The tool block Qwen2.5's template puts in the system message (Hermes function calling)."""
    specs = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        f"{specs}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def with_tools_in_system(messages: Sequence[Mapping[str, Any]],
                         tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with the Hermes tool block appended to the system message (one is added if missing)."""
    out = [dict(m) for m in messages]
    block = hermes_tools_text(tools)
    if out and out[0].get("role") == "system":
        out[0]["content"] = f"{out[0].get('content') or ''}\n\n{block}".lstrip()
    else:
        out.insert(0, {"role": "system", "content": block})
    return out


def hermes_call_text(name: str, arguments: Any) -> str:
    """One call as Qwen2.5's template writes it in an assistant message (without the leading newline)."""
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments, ensure_ascii=False)}}}\n</tool_call>'


def with_tool_calls_in_content(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with each assistant's ``tool_calls`` (OpenAI form, arguments a dict or a JSON string) written
    into its content as Hermes ``<tool_call>`` blocks, one per line after the text, as Qwen2.5's template does."""
    out = []
    for m in messages:
        m = dict(m)
        calls = m.pop("tool_calls", None) or []
        if m.get("role") == "assistant" and calls:
            blocks = []
            for call in calls:
                fn = call.get("function", call)
                args = fn.get("arguments", {})
                if isinstance(args, str):
                    try:
                        args = json.loads(args) if args.strip() else {}
                    except ValueError:
                        pass  # written as given
                blocks.append(hermes_call_text(fn.get("name", ""), args))
            m["content"] = "\n".join(([m["content"]] if m.get("content") else []) + blocks)
        out.append(m)
    return out


class ChatTokenizer:
    """A Hugging Face tokenizer with the few operations an episode needs."""

    def __init__(self, tokenizer: Any) -> None:
        self.hf = tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError("the tokenizer has no chat template; agentrl renders prompts with it")
        eos = tokenizer.eos_token_id
        if eos is None:
            raise ConfigError("the tokenizer has no eos_token_id")
        self.eos_token_id = int(eos)
        self.eos_token = tokenizer.convert_ids_to_tokens(self.eos_token_id)
        if self.eos_token not in self.render(_BASE, add_generation_prompt=False):
            raise ConfigError("the chat template does not end an assistant message with the EOS token")
        #: whether the chat template renders ``tools`` itself (Qwen2.5/3 do; SmolLM2's does not)
        self.supports_tools = "tools" in str(tokenizer.chat_template)
        # the n samples of a GRPO group share their prompt: render and tokenise it once (bounded LRU)
        self._prompts: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self.prompt_cache_size = 1024

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ChatTokenizer:
        return cls(load_hf_tokenizer(path))

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool,
               tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        return str(self.hf.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt, tools=tools or None
        ))

    def encode_prompt(self, messages: Sequence[Mapping[str, Any]],
                      tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        """The prompt's token ids. ``tools`` (function schemas) go through the template when it renders them,
        else into the system message in the Hermes format (:func:`hermes_tools_text`)."""
        try:
            key = json.dumps([messages, tools], sort_keys=True)
        except (TypeError, ValueError):  # not JSON (unusual message content): no caching
            key = None
        if key is not None and (hit := self._prompts.get(key)) is not None:
            self._prompts.move_to_end(key)
            return list(hit)
        ids = self.encode_text(self.render_prompt(messages, tools, add_generation_prompt=True))
        if key is not None:
            self._prompts[key] = tuple(ids)
            while len(self._prompts) > self.prompt_cache_size:
                self._prompts.popitem(last=False)
        return ids

    def render_prompt(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None,
                      *, add_generation_prompt: bool) -> str:
        """The chat template's text of ``messages`` with ``tools``; a template without a tools section gets the
        Hermes forms in the messages instead (the tool list in the system message, calls in the content)."""
        if not self.supports_tools:
            if any(m.get("tool_calls") for m in messages):
                messages = with_tool_calls_in_content(messages)
            if tools:
                messages, tools = with_tools_in_system(messages, tools), None
        return self.render(messages, add_generation_prompt=add_generation_prompt, tools=tools)

    def encode_text(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def encode_messages_delta(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """Tokens the chat template adds for ``messages`` after an assistant message that ended with EOS,
        including the next assistant header."""
        ids = self.encode_continuation(_BASE, messages)
        if ids is None:
            raise ConfigError("the chat template re-renders earlier turns differently; cannot append tool turns")
        return ids

    def encode_continuation(self, history: Sequence[Mapping[str, Any]], tail: Sequence[Mapping[str, Any]],
                            tools: Sequence[Mapping[str, Any]] | None = None) -> list[int] | None:
        """:meth:`encode_messages_delta` after a real ``history`` (ending with an assistant message): the tokens
        the template adds for ``tail`` after the history's last EOS, up to the next assistant header. ``None``
        when the template renders ``history`` differently once ``tail`` follows (it strips earlier thinking, say):
        the history's tokens cannot be kept then."""
        before = self.render_prompt(history, tools, add_generation_prompt=False)
        cut = before.rfind(self.eos_token)
        if cut < 0:
            return None
        before = before[: cut + len(self.eos_token)]
        after = self.render_prompt([*history, *tail], tools, add_generation_prompt=True)
        if not after.startswith(before):
            return None
        return self.encode_text(after[len(before):])

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.hf.decode(list(ids), skip_special_tokens=False))


def tokenize_trace(tok: ChatTokenizer, messages: Sequence[Mapping[str, Any]],
                   parts: Sequence[tuple[str, bool]]) -> tuple[list[int], list[int]]:
    """Token ids and loss mask of a supervised trace: the prompt (mask 0), then each (text, is_model) part
    tokenised on its own (mask 1 for the model's parts, 0 for observations), then EOS (mask 1).

    Tokenising part by part gives the same token boundaries the rollout produces (where the model's turn stops
    at a tool tag and the observation is appended as its own tokens)."""
    ids = tok.encode_prompt(messages)
    mask = [0] * len(ids)
    for text, is_model in parts:
        piece = tok.encode_text(text)
        ids += piece
        mask += [int(is_model)] * len(piece)
    ids.append(tok.eos_token_id)
    mask.append(1)
    return ids, mask
