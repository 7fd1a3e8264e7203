"""agentrl.data.loader: every format, dotted keys, messages prompts, metadata, verl's layout, answers that are not
strings, and errors that name the file, the key, the columns found and the likely intended key."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest

from agentrl.data.loader import DatasetError, answer_text, check_dataset, load_task_file
from agentrl.env.base import prompt_messages
from agentrl.types import Task

ROWS = [{"id": "a", "prompt": "What is 2 + 3?", "answer": "5", "level": 1},
        {"id": "b", "prompt": "What is 4 * 4?", "answer": "16", "level": 2}]

VERL_ROWS = [
    {"data_source": "math", "prompt": [{"role": "user", "content": "What is 6 * 7?"}], "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "42"}, "extra_info": {"split": "train", "index": 0}},
    {"data_source": "math", "prompt": [{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": "What is 9 - 4?"}], "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "5"}, "extra_info": {"split": "train", "index": 1}},
]


def write(tmp_path: Path, fmt: str, rows: list[dict]) -> Path:
    import datasets

    if fmt == "jsonl":
        p = tmp_path / "d.jsonl"
        p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "json-list":
        p = tmp_path / "d.json"
        p.write_text(json.dumps(rows))
    elif fmt == "json-lines":
        p = tmp_path / "d.json"
        p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "parquet":
        p = tmp_path / "d.parquet"
        datasets.Dataset.from_list(rows).to_parquet(str(p))
    elif fmt == "arrow-file":
        p = tmp_path / "d.arrow"
        table = pa.Table.from_pylist(rows)
        with pa.ipc.new_file(str(p), table.schema) as w:
            w.write_table(table)
    elif fmt == "save_to_disk":
        p = tmp_path / "folder"
        datasets.Dataset.from_list(rows).save_to_disk(str(p))
    elif fmt == "dataset_dict":
        p = tmp_path / "dict"
        ds = datasets.Dataset.from_list(rows)
        datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(str(p))
    else:
        raise AssertionError(fmt)
    return p


@pytest.mark.parametrize("fmt", ["jsonl", "json-list", "json-lines", "parquet", "arrow-file", "save_to_disk",
                                 "dataset_dict"])
def test_every_format_gives_the_same_tasks(tmp_path: Path, fmt: str) -> None:
    tasks = load_task_file(write(tmp_path, fmt, ROWS))
    assert [(t.id, t.prompt, t.answer, t.metadata, t.messages) for t in tasks] == [
        ("a", "What is 2 + 3?", "5", {"level": 1}, ()), ("b", "What is 4 * 4?", "16", {"level": 2}, ())]
    check_dataset(write(tmp_path, fmt, ROWS))  # the cheap check agrees


def test_verl_layout_with_messages_prompts_and_nested_ground_truth(tmp_path: Path) -> None:
    path = write(tmp_path, "parquet", VERL_ROWS)
    check_dataset(path, answer_key="reward_model.ground_truth")
    first, second = load_task_file(path, answer_key="reward_model.ground_truth")
    assert first.answer == "42" and second.answer == "5"
    assert first.messages == ({"role": "user", "content": "What is 6 * 7?"},)
    assert first.prompt == "What is 6 * 7?" and second.prompt == "What is 9 - 4?"
    assert first.id == "d-0" and second.id == "d-1"  # no id column: <file stem>-<row>
    # every column but the prompt's goes to metadata; the dotted key's parent column stays whole
    assert first.metadata == {"data_source": "math", "ability": "math",
                              "reward_model": {"style": "rule", "ground_truth": "42"},
                              "extra_info": {"split": "train", "index": 0}}


def test_messages_are_the_conversation_with_the_env_system_prompt_only_when_they_have_none(tmp_path: Path) -> None:
    first, second = load_task_file(write(tmp_path, "jsonl", VERL_ROWS), answer_key="reward_model.ground_truth")
    assert prompt_messages(first, "SYS") == [{"role": "system", "content": "SYS"},
                                             {"role": "user", "content": "What is 6 * 7?"}]
    assert prompt_messages(second, "SYS") == [{"role": "system", "content": "Be brief."},
                                              {"role": "user", "content": "What is 9 - 4?"}]
    plain = Task(id="p", prompt="What is 1 + 1?")
    assert prompt_messages(plain, "SYS") == [{"role": "system", "content": "SYS"},
                                             {"role": "user", "content": "What is 1 + 1?"}]
    assert prompt_messages(plain, None) == [{"role": "user", "content": "What is 1 + 1?"}]


def test_dotted_prompt_key_and_null_answer_key(tmp_path: Path) -> None:
    rows = [{"extra_info": {"question": "Q1", "n": 1}}, {"extra_info": {"question": "Q2", "n": 2}}]
    tasks = load_task_file(write(tmp_path, "jsonl", rows), prompt_key="extra_info.question", answer_key=None)
    assert [(t.prompt, t.answer) for t in tasks] == [("Q1", None), ("Q2", None)]
    assert tasks[0].metadata == {"extra_info": {"question": "Q1", "n": 1}}


@pytest.mark.parametrize("value, text", [
    (None, None), ("x", "x"), (7, "7"), (-3, "-3"), (3.0, "3"), (2.5, "2.5"), (0.1, "0.1"), (True, "true"),
    (["42"], "42"), ([12], "12"), ([1, 2], "[1, 2]"), ({"a": 1}, '{"a": 1}'), (float("nan"), "nan"),
])
def test_answers_that_are_not_strings(value: object, text: str | None) -> None:
    assert answer_text(value) == text


def test_int_and_list_answers_from_files(tmp_path: Path) -> None:
    rows = [{"prompt": "p0", "answer": 12}, {"prompt": "p1", "answer": 7}]
    assert [t.answer for t in load_task_file(write(tmp_path, "parquet", rows))] == ["12", "7"]
    (tmp_path / "mixed.jsonl").write_text('{"prompt": "p0", "answer": 3}\n{"prompt": "p1", "answer": ["x", "y"]}\n')
    assert [t.answer for t in load_task_file(tmp_path / "mixed.jsonl")] == ["3", '["x", "y"]']


def test_limit_and_max_rows(tmp_path: Path) -> None:
    path = write(tmp_path, "jsonl", [{"prompt": f"q{i}", "answer": i} for i in range(10)])
    assert [t.prompt for t in load_task_file(path, limit=3)] == ["q0", "q1", "q2"]
    with pytest.raises(DatasetError, match="holds 10 rows, more than the 5 allowed"):
        load_task_file(path, max_rows=5)


@pytest.mark.parametrize("kwargs, field, words", [
    ({"answer_key": "answr"}, "answer_key", ["no column 'answr'", "columns found: id, prompt, answer, level",
                                             "did you mean answer_key='answer'?"]),
    ({"prompt_key": "promt"}, "prompt_key", ["no column 'promt'", "did you mean prompt_key='prompt'?"]),
    ({"prompt_key": "question"}, "prompt_key", ["no column 'question'", "set prompt_key to the column"]),
])
def test_missing_keys_name_the_file_the_key_the_columns_and_a_guess(tmp_path: Path, kwargs, field, words) -> None:
    path = write(tmp_path, "jsonl", ROWS)
    for load in (load_task_file, check_dataset):
        with pytest.raises(DatasetError) as info:
            load(path, **kwargs)
        assert info.value.field == field and str(path) in str(info.value)
        for w in words:
            assert w in str(info.value), str(info.value)


def test_a_misspelt_nested_key_is_guessed(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match=r"did you mean answer_key='reward_model.ground_truth'\?"):
        check_dataset(write(tmp_path, "parquet", VERL_ROWS), answer_key="reward_model.groundtruth")


@pytest.mark.parametrize("make, words", [
    (lambda d: d / "missing.parquet", "does not exist"),
    (lambda d: (d / "x.csv").write_text("a,b\n") and d / "x.csv", "unknown format '.csv'"),
    (lambda d: (d / "bad.json").write_text("{not json") and d / "bad.json", "cannot be read"),
    (lambda d: (d / "plain").mkdir() or d / "plain", "not one written by save_to_disk"),
])
def test_unreadable_datasets(tmp_path: Path, make, words: str) -> None:
    path = make(tmp_path)
    for load in (load_task_file, check_dataset):
        with pytest.raises(DatasetError, match=words):
            load(path)


def test_an_empty_dataset_is_an_error(tmp_path: Path) -> None:
    import datasets

    features = datasets.Features({"prompt": datasets.Value("string"), "answer": datasets.Value("string")})
    datasets.Dataset.from_dict({"prompt": [], "answer": []}, features=features).to_parquet(str(tmp_path / "e.parquet"))
    (tmp_path / "e.jsonl").write_text("")
    for path in (tmp_path / "e.parquet", tmp_path / "e.jsonl"):
        for load in (load_task_file, check_dataset):
            with pytest.raises(DatasetError, match="holds no rows") as info:
                load(path)
            assert str(path) in str(info.value)


@pytest.mark.parametrize("prompt, words", [
    ([], "non-empty list of chat messages"),
    ([{"role": "system", "content": "s"}], "no user message"),
    ([{"content": "hi"}], "not a {role, content} mapping"),
    ([{"role": "user", "content": 3}], "no string content"),
    ("", "empty string"),
    (None, "is null"),
])
def test_malformed_prompts_name_the_row(tmp_path: Path, prompt, words: str) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps([{"prompt": "fine", "answer": "1"}, {"prompt": prompt, "answer": "2"}]))
    with pytest.raises(DatasetError, match=words) as info:
        load_task_file(path)
    assert "row 1" in str(info.value) and info.value.field == "prompt_key"


def test_the_check_before_a_run_reads_a_file_without_importing_torch(tmp_path: Path) -> None:
    """HF datasets' streaming datasets import torch (for DataLoader workers agentrl never uses): the controller's
    check of a run's data file paid ~3 s and ~280 MB for it, for the whole run. Its switch is put back after."""
    import subprocess
    import sys

    rows = [{"prompt": "1+1?", "answer": "2"}, {"prompt": "2+2?", "answer": "4"}]
    files = [write(tmp_path, fmt, rows) for fmt in ("jsonl", "parquet")]
    code = ("import sys, datasets; from agentrl.data.loader import check_dataset, first_row; "
            f"rows = [first_row(p) for p in {[str(f) for f in files]!r}]; "
            f"[check_dataset(p) for p in {[str(f) for f in files]!r}]; "
            "print(rows[0]['prompt'], rows[1]['answer'], 'torch' in sys.modules, datasets.config.TORCH_AVAILABLE)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert out.stdout.split() == ["1+1?", "2", "False", "True"], out.stderr[-2000:]
