"""Models by Hugging Face id, resolved offline from a temporary HF cache in the real layout:

    <cache>/models--Org--Name/refs/main            holds the commit hash
    <cache>/models--Org--Name/snapshots/<hash>/    the files (symlinks, as in the real cache)
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from agentrl.errors import ConfigError
from agentrl.models import HubRef, download_command, hub_cache_dir, parse_hub_id, resolve_model

MAIN = "a" * 40
TAGGED = "b" * 40


def _snapshot(cache: Path, repo: str, commit: str, src: Path, *, refs: tuple[str, ...] = (),
              skip: tuple[str, ...] = ()) -> Path:
    folder = cache / ("models--" + repo.replace("/", "--"))
    snap = folder / "snapshots" / commit
    snap.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and f.name not in skip:
            (snap / f.name).symlink_to(f.resolve())
    for ref in refs:
        (folder / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (folder / "refs" / ref).write_text(commit)
    return snap


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Any attempt to reach a non-loopback address fails the test (and is recorded)."""
    attempts: list[object] = []
    real_connect = socket.socket.connect
    real_getaddrinfo = socket.getaddrinfo

    def connect(self: socket.socket, address: object) -> None:
        host = address[0] if isinstance(address, tuple) else None
        if self.family in (socket.AF_INET, socket.AF_INET6) and host not in ("127.0.0.1", "::1", "localhost"):
            attempts.append(address)
            raise OSError(f"test: network access to {address} attempted")
        real_connect(self, address)

    def getaddrinfo(host: object, *args: object, **kw: object) -> object:
        if host not in (None, "127.0.0.1", "::1", "localhost"):
            attempts.append(host)
            raise OSError(f"test: DNS lookup of {host} attempted")
        return real_getaddrinfo(host, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return attempts


@pytest.fixture
def hf_cache(tmp_path: Path, tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch, no_network) -> Path:
    """A hub cache holding ``Org/Name`` at ``main`` and at tag ``v1`` (another commit); env pointed at it."""
    cache = tmp_path / "hub"
    _snapshot(cache, "Org/Name", MAIN, tiny_model_path, refs=("main",))
    _snapshot(cache, "Org/Name", TAGGED, tiny_model_path, refs=("v1",))
    for var in ("HF_HOME", "HUGGINGFACE_HUB_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))  # set after huggingface_hub was imported: read at call time
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_hub_ids_parse_and_paths_do_not() -> None:
    assert parse_hub_id("Qwen/Qwen2.5-1.5B-Instruct") == HubRef("Qwen/Qwen2.5-1.5B-Instruct", "main")
    assert parse_hub_id("Org/Name@v1.0") == HubRef("Org/Name", "v1.0")
    assert parse_hub_id("Org/Name@refs/pr/1") == HubRef("Org/Name", "refs/pr/1")
    assert HubRef("Org/Name").folder_name == "models--Org--Name"
    for not_an_id in ("tiny", "/abs/model", "./rel/model", "~/model", "a/b/c", "Org/Name@", "Org/Name@../../etc",
                      "Org/..", "Org/Na me"):
        assert parse_hub_id(not_an_id) is None, not_an_id


def test_cache_dir_follows_the_environment_at_call_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert hub_cache_dir() == tmp_path / "home" / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hub_cache_dir() == tmp_path / "xdg" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert hub_cache_dir() == tmp_path / "hf" / "hub"
    monkeypatch.setenv("HUGGINGFACE_HUB_CACHE", str(tmp_path / "legacy"))
    assert hub_cache_dir() == tmp_path / "legacy"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "new"))
    assert hub_cache_dir() == tmp_path / "new"


def test_resolves_an_id_and_its_revisions_offline(hf_cache: Path, no_network: list[object]) -> None:
    repo = hf_cache / "models--Org--Name" / "snapshots"
    assert resolve_model("Org/Name") == repo / MAIN
    assert resolve_model("Org/Name@main") == repo / MAIN
    assert resolve_model("Org/Name@v1") == repo / TAGGED  # a tag, through refs/
    assert resolve_model(f"Org/Name@{TAGGED}") == repo / TAGGED  # a commit hash, straight to snapshots/
    assert (resolve_model("Org/Name") / "config.json").is_file()
    assert no_network == []


def test_hf_home_alone_is_enough(tmp_path: Path, tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch,
                                 no_network: list[object]) -> None:
    snap = _snapshot(tmp_path / "hf" / "hub", "Org/Other", MAIN, tiny_model_path, refs=("main",))
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert resolve_model("Org/Other") == snap


def test_a_missing_id_fails_fast_naming_the_cache_and_the_command(hf_cache: Path,
                                                                   no_network: list[object]) -> None:
    with pytest.raises(ConfigError) as info:
        resolve_model("Org/Missing")
    msg = str(info.value)
    assert str(hf_cache) in msg and "models--Org--Missing" in msg
    assert f"`{download_command(HubRef('Org/Missing'))}`" in msg
    assert download_command(HubRef("Org/Missing")) == "hf download Org/Missing"  # huggingface_hub >= 1 ships `hf`
    with pytest.raises(ConfigError) as info:
        resolve_model("Org/Name@v2")
    msg = str(info.value)
    assert "hf download Org/Name --revision v2" in msg and "'main'" in msg and MAIN in msg  # what is cached
    assert no_network == []


def test_a_snapshot_without_weights_is_refused_for_a_model_but_serves_a_tokenizer(
        hf_cache: Path, tiny_model_path: Path) -> None:
    weights = tuple(f.name for f in tiny_model_path.glob("*.safetensors"))
    snap = _snapshot(hf_cache, "Org/TokOnly", MAIN, tiny_model_path, refs=("main",), skip=weights)
    with pytest.raises(ConfigError, match="no weight files") as info:
        resolve_model("Org/TokOnly")
    assert "hf download Org/TokOnly" in str(info.value)
    assert resolve_model("Org/TokOnly", weights=False) == snap


def test_names_and_folders_keep_working_and_anything_else_is_refused(tiny_model_path: Path, tmp_path: Path) -> None:
    assert resolve_model("tiny") == tiny_model_path
    assert resolve_model(str(tiny_model_path)) == tiny_model_path
    with pytest.raises(ConfigError, match="has no config.json"):
        resolve_model(str(tmp_path))
    with pytest.raises(ConfigError, match="unknown model") as info:
        resolve_model(str(tmp_path / "no" / "such" / "model"))
    assert "Hugging Face id" in str(info.value) and "tiny" in str(info.value)


def test_one_sft_step_on_a_model_given_by_id(hf_cache: Path, no_network: list[object]) -> None:
    import torch

    from agentrl.trainer import Trace, Trainer, TrainerConfig

    torch.set_num_threads(2)
    path = resolve_model("Org/Name")
    traces = [Trace([5, 17, 230, 9, 41, 2], [0, 0, 1, 1, 1, 1]), Trace([7, 300, 12, 2], [0, 1, 1, 1])]
    with Trainer(TrainerConfig(model=str(path), optimizer={"lr": 1e-2})) as trainer:
        first = trainer.sft_step(traces)
        second = trainer.sft_step(traces)
    assert first.num_sequences == 2 and first.model_tokens == sum(sum(t.loss_mask[1:]) for t in traces)
    assert torch.isfinite(torch.tensor(first.loss)) and second.loss < first.loss
    assert no_network == []


def test_the_engine_and_the_eval_service_get_the_same_folder(hf_cache: Path, tmp_path: Path) -> None:
    from pydantic import ValidationError

    from agentrl.engine.server import SGLangServer, SGLangServerConfig
    from agentrl.eval.base import SpecError
    from agentrl.eval.engines import check_model, resolve_model_spec
    from agentrl.eval.spec import ModelSpec

    path = resolve_model("Org/Name@v1")
    cmd = SGLangServer(SGLangServerConfig(model_path=str(path))).command()
    assert cmd[cmd.index("--model-path") + 1] == str(hf_cache / "models--Org--Name" / "snapshots" / TAGGED)
    got = resolve_model_spec(ModelSpec(name="Org/Name@v1", tokenizer="Org/Name"), runs_dir=tmp_path)
    assert got.path == path.resolve() and got.label == "Org/Name@v1"
    with pytest.raises(SpecError) as info:
        check_model(ModelSpec(name="Org/Missing"), runs_dir=tmp_path)
    assert info.value.loc == ("model", "name") and "hf download Org/Missing" in str(info.value)
    with pytest.raises(SpecError) as info:
        check_model(ModelSpec(name="tiny", tokenizer="Org/Missing"), runs_dir=tmp_path)
    assert info.value.loc == ("model", "tokenizer") and "models--Org--Missing" in str(info.value)
    with pytest.raises(ValidationError, match="Hugging Face id"):
        ModelSpec(name="not a model")


def test_a_bundled_model_is_built_in_a_child_process(tmp_path: Path, tiny_model_path: Path) -> None:
    """The build loads torch and transformers; the process that asked (the controller) keeps neither. The tiny model
    built again into an empty cache has the same files and weights as the suite's."""
    import hashlib
    import json
    import os
    import subprocess
    import sys

    child = """
import json, sys
from agentrl.models import resolve_model
path = resolve_model("tiny")
print(json.dumps({"path": str(path), "torch": "torch" in sys.modules, "transformers": "transformers" in sys.modules}))
"""
    env = {**os.environ, "AGENTRL_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got == {"path": str(tmp_path / "cache" / "models" / "tiny"), "torch": False, "transformers": False}
    built = Path(got["path"])

    def digest(folder: Path) -> str:
        return hashlib.sha256(b"".join(f.read_bytes() for f in sorted(folder.glob("*.safetensors")))).hexdigest()

    assert {f.name for f in built.iterdir()} == {f.name for f in tiny_model_path.iterdir()}
    assert digest(built) == digest(tiny_model_path)


def test_a_failed_build_says_why(tmp_path: Path) -> None:
    from agentrl.models import _build_in_child

    with pytest.raises(ConfigError, match=r"building the bundled model 'nope'.*exit 1[\s\S]*unknown bundled model"):
        _build_in_child("nope", tmp_path)
