"""Training on the user's datasets: data sources checked before anything starts, task streams and SFT traces from
files, and one-step training runs (real SGLang, Redis, Ray, FSDP2) from a verl-layout parquet (messages prompts,
nested ground truth, SFT on a messages jsonl with <interpreter> spans), a save_to_disk folder and a .json list."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from itertools import islice
from pathlib import Path

import pytest
import yaml

from agentrl.data.loader import DatasetError
from agentrl.errors import ConfigError
from agentrl.launcher import driver, preflight
from agentrl.launcher.config import load_config
from agentrl.launcher.resources import check_data, heldout_tasks, sft_traces_file, tasks_from
from agentrl.launcher.trainer_process import load_traces
from agentrl.tokenizer import ChatTokenizer

VERL_ROWS = [
    {"data_source": "arith", "prompt": [{"role": "user", "content": "What is 6 * 7?"}], "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "42"}, "extra_info": {"index": 0}},
    {"data_source": "arith", "prompt": [{"role": "system", "content": "Answer in one line."},
                                        {"role": "user", "content": "What is 9 - 4?"}], "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "5"}, "extra_info": {"index": 1}},
]
PLAIN_ROWS = [{"prompt": "What is 3 + 4?", "answer": 7}, {"prompt": "What is 2 * 8?", "answer": 16}]
SPAN = "\n<interpreter>\n42\n</interpreter>\n"
SFT_ROWS = [
    {"messages": [{"role": "user", "content": "What is 6 * 7?"},
                  {"role": "assistant", "content": f"<code>\nprint(6 * 7)\n</code>{SPAN}So \\boxed{{42}}."}]},
    {"messages": [{"role": "user", "content": "What is 5 + 5? " * 60},  # longer than sft.max_tokens: cut, kept
                  {"role": "assistant", "content": "\\boxed{10}"}]},
]


def verl_parquet(d: Path) -> Path:
    import datasets

    datasets.Dataset.from_list(VERL_ROWS).to_parquet(str(d / "verl.parquet"))
    return d / "verl.parquet"


def jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# --- fail before anything starts -------------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, words", [
    (["data.train=rll"], "data.train: 'rll' is neither a problem family"),
    (["data.train=rll"], "did you mean 'rl'?"),
    (["data.train=missing.parquet"], "missing.parquet does not exist"),
    (["data.train={verl}"], "data.train: dataset"),
    (["data.train={verl}"], "has no column 'answer'"),
    (["data.train={verl}", "data.answer_key=reward_model.groundtruth"],
     "did you mean answer_key='reward_model.ground_truth'?"),
    (["data.heldout=heldot", "data.num_heldout=2"], "did you mean 'heldout'?"),
    (["sft.data={plain}"], "sft.data: dataset"),
    (["sft.data={plain}"], "or give token_ids and loss_mask columns"),
])
def test_bad_data_is_refused_by_the_check(tmp_path: Path, overrides: list[str], words: str) -> None:
    paths = {"verl": verl_parquet(tmp_path), "plain": jsonl(tmp_path / "plain.jsonl", PLAIN_ROWS)}
    cfg = load_config(None, [o.format(**paths) for o in overrides])
    with pytest.raises(ConfigError) as info:
        check_data(cfg)
    assert words in str(info.value), str(info.value)


def test_a_file_without_the_keys_is_rejected_before_any_server_starts(tmp_path: Path, monkeypatch) -> None:
    def forbidden(*args, **kwargs):
        raise AssertionError("a server was about to start")

    monkeypatch.setattr(driver, "place", forbidden)
    monkeypatch.setattr(driver, "connect_redis", forbidden)
    monkeypatch.setattr(preflight, "resolve_model", forbidden)
    cfg = load_config(None, [f"runs_dir={tmp_path / 'runs'}", "name=bad", f"data.train={verl_parquet(tmp_path)}",
                             "data.answer_key=reward_model.answer"])
    with pytest.raises(DatasetError) as info:
        asyncio.run(driver.run_training(cfg))
    assert "no column 'reward_model.answer'" in str(info.value) and "reward_model.ground_truth" in str(info.value)
    assert not (tmp_path / "runs" / "bad").exists(), "nothing of the run is created before the data is checked"


def test_relative_dataset_paths_are_made_absolute(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "folder").mkdir()
    cfg = load_config(None, ["data.train=d/x.parquet", "data.heldout=folder", "sft.data=s.json"])
    out = cfg.with_absolute_paths()
    assert out.data.train == str(tmp_path / "d" / "x.parquet")
    assert out.data.heldout == str(tmp_path / "folder") and out.sft.data == str(tmp_path / "s.json")
    assert load_config(None, ["data.train=rl"]).with_absolute_paths().data.train == "rl"  # a family stays a name
    for name in ("t.arrow", "t.json", "t.jsonl"):
        assert load_config(None, [f"data.train={name}"]).with_absolute_paths().data.train == str(tmp_path / name)


# --- task streams and SFT traces from files ----------------------------------------------------------------------------

def test_a_dataset_streams_shuffled_epochs_with_messages_and_answers(tmp_path: Path) -> None:
    path = verl_parquet(tmp_path)
    tasks = list(islice(tasks_from(str(path), seed=3, answer_key="reward_model.ground_truth"), 4))
    assert sorted(t.id for t in tasks[:2]) == ["verl-0@0", "verl-1@0"]
    assert sorted(t.id for t in tasks[2:]) == ["verl-0@1", "verl-1@1"]
    by_id = {t.id: t for t in tasks}
    assert by_id["verl-1@0"].answer == "5" and by_id["verl-1@0"].messages[0]["role"] == "system"
    cfg = load_config(None, [f"data.heldout={path}", "data.num_heldout=1", "data.answer_key=reward_model.ground_truth"])
    (first,) = heldout_tasks(cfg)
    assert first.id == "verl-0" and first.answer == "42"  # the first rows, in file order


def test_sft_traces_file_from_user_data_and_from_the_generator(tmp_path: Path, chat_tokenizer: ChatTokenizer) -> None:
    data = jsonl(tmp_path / "sft.jsonl", SFT_ROWS)
    cfg = load_config(None, [f"sft.data={data}", "sft.max_tokens=96"])
    stats = sft_traces_file(cfg, chat_tokenizer, tmp_path / "sft_traces.jsonl")
    traces = load_traces(tmp_path / "sft_traces.jsonl")  # the trainer's hand-off
    assert len(traces) == stats.traces == 2 and stats.truncated == 1
    assert stats.observation_tokens == len(chat_tokenizer.encode_text(SPAN))
    assert max(len(t.token_ids) for t in traces) == 96
    generated = sft_traces_file(load_config(None, ["sft.num_traces=3"]), chat_tokenizer, tmp_path / "gen.jsonl")
    assert generated.source == "arithmetic:sft" and generated.traces == 3 and generated.truncated == 0
    assert generated.max_tokens == 2048 and generated.observation_tokens > 0  # rollout.max_context_tokens


# --- one-step training runs (real SGLang, Redis, Ray, FSDP2) -------------------------------------------------------

def _train(tmp_path: Path, sglang_url: str, name: str, data: dict, sft: dict) -> dict:
    config = {
        "name": name, "model": "tiny", "steps": 1, "runs_dir": str(tmp_path / "runs"), "log_rollouts": "full",
        "engine": {"url": sglang_url}, "data": data, "sft": sft,
        "rollout": {"n_samples": 2, "groups_per_step": 2, "max_new_tokens": 16, "max_turns": 2,
                    "max_response_tokens": 48, "max_context_tokens": 192},
        "trainer": {"micro_batch_tokens": 2048},
        "monitor": {"live": False, "prometheus_port": None, "tensorboard": False},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = subprocess.run([sys.executable, "-m", "agentrl.cli", "train", str(path)], capture_output=True, text=True,
                          timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    run = tmp_path / "runs" / name
    summary = json.loads((run / "summary.json").read_text())
    assert summary["final_weight_version"] == 1 and summary["trajectories_consumed"] == 4 and summary["books_balanced"]
    summary["rollouts"] = [json.loads(x) for x in (run / "rollouts.jsonl").read_text().splitlines()]
    return summary


@pytest.mark.slow
@pytest.mark.sglang
@pytest.mark.redis  # the run starts its embedded Redis
def test_one_step_from_a_verl_parquet_after_sft_on_a_messages_jsonl(tmp_path: Path, shared_server: str,
                                                                    chat_tokenizer: ChatTokenizer) -> None:
    parquet = verl_parquet(tmp_path)
    sft = jsonl(tmp_path / "sft.jsonl", SFT_ROWS)
    summary = _train(tmp_path, shared_server, "verl",
                     {"train": str(parquet), "answer_key": "reward_model.ground_truth", "heldout": str(parquet),
                      "num_heldout": 2},
                     {"enabled": True, "data": str(sft), "steps": 1, "batch_size": 2, "max_tokens": 128})
    # SFT ran on the user's conversations: the interpreter span masked, the long one cut and kept
    assert summary["sft_data"]["observation_tokens"] == len(chat_tokenizer.encode_text(SPAN))
    assert summary["sft_data"]["traces"] == 2 and summary["sft_data"]["truncated"] == 1
    # the messages prompts were the conversation (the env's system prompt only where they had none)
    answers = {"What is 6 * 7?": "42", "What is 9 - 4?": "5"}
    for t in summary["rollouts"]:
        prompt = chat_tokenizer.decode(t["token_ids"][: t["prompt_len"]])
        user = next(u for u in answers if u in prompt)
        assert t["metadata"]["answer"] == answers[user]
        assert ("Answer in one line." in prompt) == (user == "What is 9 - 4?")
        assert ("<code>" in prompt) == (user == "What is 6 * 7?")  # the ReTool system prompt mentions <code>
        assert "[{" not in prompt
    assert {t["prompt_id"].split("@")[0] for t in summary["rollouts"]} == {"verl-0", "verl-1"}
    assert summary["heldout_accuracy_after"] is not None


@pytest.mark.slow
@pytest.mark.sglang
@pytest.mark.redis  # the run starts its embedded Redis
@pytest.mark.parametrize("fmt", ["save_to_disk", "json-list"])
def test_one_step_from_a_folder_and_a_json_list(tmp_path: Path, shared_server: str, chat_tokenizer: ChatTokenizer,
                                                fmt: str) -> None:
    import datasets

    if fmt == "save_to_disk":
        source = tmp_path / "folder"
        datasets.Dataset.from_list(PLAIN_ROWS).save_to_disk(str(source))
    else:
        source = tmp_path / "tasks.json"
        source.write_text(json.dumps(PLAIN_ROWS))
    summary = _train(tmp_path, shared_server, fmt.replace("_", "-"), {"train": source.name}, {"enabled": False})
    answers = {r["prompt"]: str(r["answer"]) for r in PLAIN_ROWS}
    for t in summary["rollouts"]:
        prompt = chat_tokenizer.decode(t["token_ids"][: t["prompt_len"]])
        (user,) = [u for u in answers if u in prompt]
        assert t["metadata"]["answer"] == answers[user]
