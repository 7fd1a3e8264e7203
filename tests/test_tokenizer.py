"""ChatTokenizer: prompts with tool schemas (through the template when it renders tools, else a Hermes block in
the system message), the per-prompt cache, observation deltas."""

from __future__ import annotations

import copy

from agentrl.tokenizer import ChatTokenizer, hermes_tools_text

TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3?"}]


def test_tools_go_into_the_system_message_when_the_template_ignores_them(chat_tokenizer):
    assert not chat_tokenizer.supports_tools  # SmolLM2's ChatML template
    text = chat_tokenizer.decode(chat_tokenizer.encode_prompt(MESSAGES, TOOLS))
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert hermes_tools_text(TOOLS) in text and text.endswith("<|im_start|>user\n2+3?<|im_end|>\n"
                                                              "<|im_start|>assistant\n")
    without_system = chat_tokenizer.decode(chat_tokenizer.encode_prompt(MESSAGES[1:], TOOLS))
    assert without_system.startswith("<|im_start|>system\n# Tools\n")


def test_a_template_that_renders_tools_gets_them(chat_tokenizer):
    hf = copy.deepcopy(chat_tokenizer.hf)
    hf.chat_template = ("{% if tools %}<tools>{{ tools | length }}</tools>{% endif %}"
                        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok = ChatTokenizer(hf)
    assert tok.supports_tools
    assert tok.decode(tok.encode_prompt(MESSAGES, TOOLS)).startswith("<tools>1</tools><|im_start|>system\nBe brief.")


def test_prompt_cache_returns_fresh_equal_lists(chat_tokenizer):
    first = chat_tokenizer.encode_prompt(MESSAGES)
    first.append(-1)  # the caller owns its list: the cached ids must not change
    second = chat_tokenizer.encode_prompt(MESSAGES)
    assert second == first[:-1] == chat_tokenizer.encode_text(chat_tokenizer.render(MESSAGES,
                                                                                   add_generation_prompt=True))
    assert chat_tokenizer.encode_prompt(MESSAGES, TOOLS) != second  # tools are part of the key
