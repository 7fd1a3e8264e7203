"""Named datasets: files under a dataset root (one version, versions in a folder, a manifest, a save_to_disk folder),
a plugin from a real (temporary) installed distribution, the built-ins; sha256 hashes against hashlib; the spec
resolved with version and sha256; a pinned hash that no longer matches is refused."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest

from agentrl.eval import DatasetSpec, SpecError, builtin_datasets
from agentrl.eval.catalog import DatasetCatalog, tasks_sha256
from agentrl.eval.datasets import resolve_tasks

PLUGIN = '''
def rows():
    """Two fixed problems shipped by a plugin."""
    return [{"prompt": "What is 1 + 1?", "answer": "2", "level": "easy"},
            {"prompt": "What is 12 * 12?", "answer": 144, "level": "hard"}]
'''


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "data"
    write_jsonl(r / "single.jsonl", [{"prompt": "p1", "answer": "1"}])
    write_jsonl(r / "bench" / "v1.jsonl", [{"prompt": "a", "answer": "1"}])
    write_jsonl(r / "bench" / "v10.jsonl", [{"prompt": "b", "answer": "2"}, {"prompt": "c", "answer": "3"}])
    write_jsonl(r / "bench" / "v2.jsonl", [{"prompt": "d", "answer": "4"}])
    write_jsonl(r / "verl" / "2024.jsonl", [{"question": "q", "reward_model": {"ground_truth": "7"}}])
    (r / "verl" / "dataset.yaml").write_text("description: verl layout\nprompt_key: question\n"
                                             "answer_key: reward_model.ground_truth\n")
    (r / "notes.txt").write_text("not a dataset")
    (r / "empty").mkdir()
    return r


@pytest.fixture
def plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "agentrl_testds.py").write_text(PLUGIN)
    info = site / "agentrl_testds-0.7.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: agentrl-testds\nVersion: 0.7\n")
    (info / "entry_points.txt").write_text("[agentrl.datasets]\ntiny-bench = agentrl_testds:rows\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delitem(sys.modules, "agentrl_testds", raising=False)


def test_files_plugins_and_builtins_are_named_with_versions_and_hashes(root: Path, plugin: None) -> None:
    catalog = DatasetCatalog([root], builtins=builtin_datasets())
    found = catalog.datasets()
    assert {"single", "bench", "verl", "tiny-bench", "arithmetic:heldout"} <= set(found)
    assert "notes" not in found and "empty" not in found
    bench = found["bench"]
    assert bench.latest == "v10" and set(bench.versions) == {"v1", "v2", "v10"}  # natural order
    v1 = bench.versions["v1"]
    assert catalog.sha256(v1) == hashlib.sha256((root / "bench" / "v1.jsonl").read_bytes()).hexdigest()
    assert found["single"].versions["default"].source == "file"
    assert found["verl"].description == "verl layout"
    tiny = found["tiny-bench"]
    assert list(tiny.versions) == ["0.7"] and tiny.versions["0.7"].source == "plugin"
    assert found["arithmetic:heldout"].versions["builtin"].source == "builtin"

    tasks, version, digest = catalog.load("bench", None, n=20, seed=0, prompt_key="prompt", answer_key="answer",
                                          max_rows=100)
    assert version == "v10" and [t.prompt for t in tasks] == ["b", "c"]
    tasks, _, _ = catalog.load("verl", None, n=20, seed=0, prompt_key="prompt", answer_key="answer", max_rows=100)
    assert tasks[0].prompt == "q" and tasks[0].answer == "7"  # the manifest's keys
    tasks, version, digest = catalog.load("tiny-bench", None, n=20, seed=0, prompt_key="prompt",
                                          answer_key="answer", max_rows=100)
    assert version == "0.7" and [t.answer for t in tasks] == ["2", "144"] and tasks[1].metadata["level"] == "hard"
    assert digest == tasks_sha256(tasks) == catalog.sha256(tiny.versions["0.7"])


def test_resolve_fills_in_version_and_sha256_and_checks_a_pinned_hash(root: Path) -> None:
    catalog = DatasetCatalog([root], builtins=builtin_datasets())
    tasks, resolved = resolve_tasks(DatasetSpec(name="bench", version="v2"), catalog=catalog)
    digest = hashlib.sha256((root / "bench" / "v2.jsonl").read_bytes()).hexdigest()
    assert [t.prompt for t in tasks] == ["d"] and resolved.version == "v2" and resolved.sha256 == digest
    assert resolve_tasks(DatasetSpec(name="bench", sha256=digest, version="v2"), catalog=catalog)[1] == resolved

    write_jsonl(root / "bench" / "v2.jsonl", [{"prompt": "changed", "answer": "4"}])
    with pytest.raises(SpecError) as info:
        resolve_tasks(DatasetSpec(name="bench", version="v2", sha256=digest), catalog=catalog)
    assert info.value.loc == ("dataset", "sha256") and "changed on the server" in info.value.message

    with pytest.raises(SpecError) as info:
        resolve_tasks(DatasetSpec(name="bench", version="v3"), catalog=catalog)
    assert info.value.loc == ("dataset", "version") and "v1, v2, v10" in info.value.message
    with pytest.raises(SpecError) as info:
        resolve_tasks(DatasetSpec(name="nope"), catalog=catalog)
    assert info.value.loc == ("dataset", "name") and "bench" in info.value.message

    a = resolve_tasks(DatasetSpec(name="arithmetic:heldout", n=3, seed=1), catalog=catalog)[1]
    b = resolve_tasks(DatasetSpec(name="arithmetic:heldout", n=3, seed=2), catalog=catalog)[1]
    assert a.version == "builtin" and a.sha256 != b.sha256 and a.sha256 is not None
    inline = resolve_tasks(DatasetSpec(items=[{"prompt": "x", "answer": "1"}]))[1]
    assert inline.sha256 is not None and inline.version is None
    path = resolve_tasks(DatasetSpec(path=str(root / "single.jsonl")), allowed_dirs=[root])[1]
    assert path.sha256 == hashlib.sha256((root / "single.jsonl").read_bytes()).hexdigest()


def test_a_version_needs_a_name() -> None:
    with pytest.raises(ValueError, match="'version' goes with 'name'"):
        DatasetSpec(items=[{"prompt": "x"}], version="1")
