"""ChatTokenizer.from_pretrained in a process without torch: the same tokenizer AutoTokenizer gives, torch never
imported (agentrl.tokenizer.load_hf_tokenizer)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from transformers import AutoTokenizer

from agentrl.tokenizer import ChatTokenizer

TEXTS = ["Let me compute this with Python.\n<code>\nprint(17 * (3 + 4))\n</code>", " leading space", "ünïcödé 😀"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]

CHILD = """
import json, sys
from agentrl.tokenizer import ChatTokenizer
tok = ChatTokenizer.from_pretrained(sys.argv[1])
texts, messages = json.loads(sys.argv[2]), json.loads(sys.argv[3])
print(json.dumps({"torch": "torch" in sys.modules, "class": type(tok.hf).__qualname__,
                  "ids": [tok.hf.encode(t, add_special_tokens=False) for t in texts],
                  "prompt": tok.encode_prompt(messages), "eos": tok.eos_token_id}))
"""


def test_a_process_without_torch_loads_the_tokenizer_autotokenizer_picks_without_importing_torch(tiny_model_path):
    out = subprocess.run([sys.executable, "-c", CHILD, str(tiny_model_path), json.dumps(TEXTS),
                          json.dumps(MESSAGES)], capture_output=True, text=True, timeout=300, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["torch"] is False
    auto = AutoTokenizer.from_pretrained(str(tiny_model_path))
    here = ChatTokenizer.from_pretrained(tiny_model_path)  # torch is imported in this process: AutoTokenizer itself
    assert type(here.hf) is type(auto)
    assert got["class"] == type(auto).__qualname__
    assert got["ids"] == [auto.encode(t, add_special_tokens=False) for t in TEXTS]
    assert got["prompt"] == list(here.encode_prompt(MESSAGES))
    assert got["eos"] == auto.eos_token_id


CACHED_CHILD = """
import subprocess, sys
from agentrl.tokenizer import ChatTokenizer

def no_child(*args, **kwargs):
    raise AssertionError("asked a child although the class is cached")

subprocess.run = no_child
tok = ChatTokenizer.from_pretrained(sys.argv[1])
print("torch" in sys.modules, type(tok.hf).__qualname__)
"""


def test_the_picked_class_is_cached_on_disk_and_a_changed_tokenizer_file_asks_again(tiny_model_path, tmp_path,
                                                                                    monkeypatch):
    from agentrl import tokenizer as tk

    monkeypatch.setenv("AGENTRL_CACHE_DIR", str(tmp_path / "cache"))
    env = {**os.environ, "AGENTRL_CACHE_DIR": str(tmp_path / "cache")}
    subprocess.run([sys.executable, "-c", CHILD, str(tiny_model_path), json.dumps(TEXTS), json.dumps(MESSAGES)],
                   capture_output=True, text=True, timeout=300, check=True, env=env)
    cached = json.loads((tmp_path / "cache" / "tokenizer_class.json").read_text())
    auto = type(AutoTokenizer.from_pretrained(str(tiny_model_path)))
    assert list(cached.values()) == [[auto.__module__, auto.__qualname__]]
    out = subprocess.run([sys.executable, "-c", CACHED_CHILD, str(tiny_model_path)], capture_output=True, text=True,
                         timeout=300, check=True, env=env)
    assert out.stdout.split() == ["False", cached[next(iter(cached))][1]]
    # the key follows the files that decide the pick: a copy with an edited tokenizer_config.json is asked anew
    copy = tmp_path / "model"
    shutil.copytree(tiny_model_path, copy)
    before = tk._pick_key(str(copy))
    config = copy / "tokenizer_config.json"
    config.write_text(config.read_text() + "\n")
    assert tk._pick_key(str(copy)) != before
    assert tk._pick_key(str(copy)) not in cached
