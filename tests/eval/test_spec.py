"""The eval spec (validation messages) and datasets (inline, registered, server-side files)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from agentrl.eval import DatasetSpec, EvalSpec, ModelSpec, SpecError, load_tasks
from agentrl.eval.datasets import tasks_from_json, tasks_to_json
from agentrl.eval.engines import check_model, resolve_model_spec
from agentrl.eval.spec import EXAMPLE


def test_the_issue_example_is_valid_and_normalised() -> None:
    spec = EvalSpec.model_validate({**EXAMPLE, "pass_k": [4, 1, 4]})
    assert spec.pass_k == [1, 4]
    assert spec.dataset.items is not None and spec.dataset.items[0].answer == "396"
    assert spec.model.name == "tiny" and spec.samples_per_item == 4


@pytest.mark.parametrize("patch, where, words", [
    ({"pass_k": [5]}, (), "samples_per_item"),
    ({"samples_per_item": 0}, ("samples_per_item",), "greater than or equal"),
    ({"dataset": {}}, ("dataset",), "exactly one of"),
    ({"dataset": {"items": [{"prompt": "x"}], "name": "arithmetic:heldout"}}, ("dataset",), "exactly one of"),
    ({"dataset": {"items": [{"answer": "1"}]}}, ("dataset", "items", 0, "prompt"), "required"),
    ({"model": {"name": "gpt-5"}}, ("model",), "unknown model name"),
    ({"model": {"run": "r1"}}, ("model",), "go together"),
    ({"model": {"url": "ftp://example.com"}}, ("model", "url"), "pattern"),
    ({"model": {"run": "../etc", "version": 1}}, ("model", "run"), "pattern"),
    ({"sampling": {"temperature": -1}}, ("sampling", "temperature"), "greater than or equal"),
    ({"surprise": 1}, ("surprise",), "Extra inputs"),
    ({"dataset": {"name": "arithmetic:rl", "n": 10_000}, "samples_per_item": 64}, (), "split the evaluation"),
])
def test_invalid_specs_name_the_field(patch: dict, where: tuple, words: str) -> None:
    with pytest.raises(ValidationError) as info:
        EvalSpec.model_validate({**EXAMPLE, **patch})
    errors = info.value.errors()
    assert any(tuple(e["loc"]) == where and words.lower() in e["msg"].lower() for e in errors), errors


def test_datasets_inline_registered_and_files(tmp_path: Path) -> None:
    inline = load_tasks(DatasetSpec(items=[{"prompt": "p", "answer": 3, "tests": [1]}]))
    assert inline[0].answer == "3" and inline[0].metadata == {"tests": [1]} and inline[0].id == "item-0"
    a = load_tasks(DatasetSpec(name="arithmetic:heldout", n=5, seed=3))
    assert len(a) == 5 and a == load_tasks(DatasetSpec(name="arithmetic:heldout", n=5, seed=3))
    assert a != load_tasks(DatasetSpec(name="arithmetic:heldout", n=5, seed=4))
    assert all(t.metadata["family"] == "heldout" for t in a)
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join(json.dumps({"prompt": f"q{i}", "answer": i}) for i in range(4)) + "\n")
    tasks = load_tasks(DatasetSpec(path=str(f), limit=3), allowed_dirs=[tmp_path])
    assert [t.prompt for t in tasks] == ["q0", "q1", "q2"] and tasks[2].answer == "2"


@pytest.mark.parametrize("make, words", [
    (lambda d: DatasetSpec(name="nope"), "registered datasets: arithmetic:heldout"),
    (lambda d: DatasetSpec(path="/etc/passwd"), "outside the directories"),
    (lambda d: DatasetSpec(path=str(d / "missing.jsonl")), "does not exist"),
    (lambda d: DatasetSpec(path=str(d / "x.txt")), "must be a .jsonl"),
    (lambda d: DatasetSpec(path=str(d / "bad.jsonl")), "bad.jsonl, row 1: the prompt ('prompt') is null"),
    (lambda d: DatasetSpec(path=str(d / "bad.jsonl"), answer_key="answers"), "did you mean answer_key='answer'"),
    (lambda d: DatasetSpec(path=str(d / "sub" / ".." / ".." / "escape.jsonl")), "outside the directories"),
])
def test_dataset_errors_name_the_field(tmp_path: Path, make, words: str) -> None:
    (tmp_path / "bad.jsonl").write_text('{"prompt": "ok"}\n{"answer": 1}\n')
    with pytest.raises(SpecError) as info:
        load_tasks(make(tmp_path), allowed_dirs=[tmp_path])
    assert info.value.loc[0] == "dataset" and words in str(info.value)
    if "did you mean" in words:
        assert info.value.loc == ("dataset", "answer_key")


def test_dataset_files_in_every_format_with_keys_and_messages(tmp_path: Path) -> None:
    """The eval API reads server-side files with the training loader: verl's parquet layout, a save_to_disk
    folder, messages prompts; inline items may be chat messages too."""
    import datasets

    rows = [{"prompt": [{"role": "user", "content": f"q{i}"}], "reward_model": {"ground_truth": i},
             "data_source": "t"} for i in range(3)]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "verl.parquet"))
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "folder"))
    for path in ("verl.parquet", "folder"):
        tasks = load_tasks(DatasetSpec(path=path, answer_key="reward_model.ground_truth", limit=2),
                           allowed_dirs=[tmp_path])
        assert [(t.prompt, t.answer, t.messages) for t in tasks] == [
            ("q0", "0", ({"role": "user", "content": "q0"},)), ("q1", "1", ({"role": "user", "content": "q1"},))]
        assert tasks[0].metadata["data_source"] == "t"
    item = {"prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}], "answer": "1"}
    (task,) = load_tasks(DatasetSpec(items=[item]))
    assert task.prompt == "u" and task.messages == tuple(item["prompt"]) and task.id == "item-0"
    assert tasks_from_json(tasks_to_json([task])) == [task]  # what the REST service stores
    with pytest.raises(ValidationError):
        DatasetSpec(items=[{"prompt": [{"role": "wizard", "content": "x"}]}])


def test_model_specs(tmp_path: Path, tiny_model_path: Path) -> None:
    with pytest.raises(SpecError, match="not a model folder") as info:
        check_model(ModelSpec(path=str(tmp_path)), runs_dir=tmp_path)
    assert info.value.loc == ("model", "path")
    with pytest.raises(SpecError, match="no weight version 3"):
        check_model(ModelSpec(run="r", version=3), runs_dir=tmp_path)
    v3 = tmp_path / "r" / "weights" / "v3"
    v3.mkdir(parents=True)
    (v3 / "config.json").write_text("{}")
    got = resolve_model_spec(ModelSpec(run="r", version=3), runs_dir=tmp_path)
    assert got.path == v3.absolute() and got.weight_version == 3 and got.url is None
    assert resolve_model_spec(ModelSpec(name="tiny"), runs_dir=tmp_path).path == tiny_model_path.resolve()
    url = resolve_model_spec(ModelSpec(url="http://127.0.0.1:1/"), runs_dir=tmp_path)
    assert url.url == "http://127.0.0.1:1" and url.path is None
