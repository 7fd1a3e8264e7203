"""Named datasets (benchmarks) a server offers: files under its dataset roots, plugins, and the built-ins, each
with versions and a sha256 content hash, so a spec says ``dataset: {name: gsm8k, version: "2"}`` instead of
uploading items, and every task records exactly which content it ran on.

Where they come from (the first source that names a dataset wins; a clash is logged):

1. **files** at the top level of each dataset root (``dataset_dirs``; nothing deeper is scanned):
   ``ROOT/NAME.jsonl`` (or ``.json``, ``.parquet``, ``.arrow``, or a ``save_to_disk`` folder ``ROOT/NAME/``): one
   version, ``default``; ``ROOT/NAME/VERSION.jsonl`` … or ``ROOT/NAME/VERSION/`` (a save_to_disk folder): one
   version each, the latest being the greatest in natural order (``v2 < v10``). An optional ``ROOT/NAME/
   dataset.yaml`` gives ``description``, ``prompt_key`` and ``answer_key`` (default: the spec's). Read by
   :mod:`agentrl.data.loader`. sha256: of the file's bytes (a folder: of its files' relative paths and hashes).
2. **plugins**: entry points of the group ``agentrl.datasets``; the name is the entry point's, the target a
   callable with no arguments returning the rows (``{prompt, answer, …}`` mappings, or :class:`Task`); the version
   is the plugin distribution's version. sha256: of the tasks' canonical JSON.
3. **built-ins** (``arithmetic:<family>``): generated from ``n`` and ``seed``; version ``builtin``; sha256 of
   the generated tasks' canonical JSON (so it depends on ``n`` and ``seed``).

Hashes are cached per file (path, size, mtime) and per plugin; a root is listed again on every call, so new
files show up without a restart.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from agentrl.data.loader import FORMATS, DatasetError, load_task_file, task_from_row
from agentrl.eval.base import SpecError
from agentrl.types import Task

logger = logging.getLogger(__name__)

PLUGIN_GROUP = "agentrl.datasets"
DEFAULT_VERSION = "default"
MANIFEST = "dataset.yaml"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$")
MAX_ENTRIES = 1000  # files and folders looked at per root

Source = Literal["file", "plugin", "builtin"]


def tasks_sha256(tasks: Sequence[Task]) -> str:
    """The sha256 of tasks' canonical JSON (sorted keys, no spaces): equal content, equal hash."""
    from agentrl.eval.datasets import tasks_to_json

    blob = json.dumps(tasks_to_json(tasks), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def natural_order(version: str) -> tuple[Any, ...]:
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"(\d+)", version) if p)


@dataclass(frozen=True, slots=True)
class DatasetVersion:
    """One version of a named dataset: a file or folder, or a plugin's loader, or a built-in generator."""

    version: str
    source: Source
    path: Path | None = None
    loader: Callable[[], Any] | None = None
    factory: Callable[[int, int], list[Task]] | None = None
    keys: tuple[tuple[str, Any], ...] = ()  # prompt_key / answer_key from the dataset's manifest
    origin: str = ""  # a plugin's entry point (module:attr)

    def describe(self, sha256: str | None) -> dict[str, Any]:
        out: dict[str, Any] = {"version": self.version, "source": self.source, "sha256": sha256}
        if self.path is not None:
            out["size_bytes"] = _size(self.path)
        return out


@dataclass(frozen=True, slots=True)
class NamedDataset:
    name: str
    description: str
    versions: dict[str, DatasetVersion] = field(default_factory=dict)

    @property
    def latest(self) -> str:
        return max(self.versions, key=natural_order)


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else path.stat().st_size


def _is_saved_folder(path: Path) -> bool:
    return path.is_dir() and any((path / m).exists() for m in ("dataset_dict.json", "state.json", "dataset_info.json"))


class DatasetCatalog:
    """The named datasets of a server (module docstring). ``roots``: its dataset directories; ``builtins``:
    generators by name (``agentrl.eval.datasets.builtin_datasets()``); ``plugins``: read the entry points."""

    def __init__(self, roots: Sequence[Path] = (), *, builtins: Mapping[str, Callable[[int, int], list[Task]]]
                 | None = None, plugins: bool = True) -> None:
        self.roots = [Path(r) for r in roots]
        self.builtins = dict(builtins or {})
        self.plugins = plugins
        self._hashes: dict[tuple[Any, ...], str] = {}
        self._lock = threading.Lock()  # hashing runs in threads

    # ------------------------------------------------------------------------------------------- discovery
    def datasets(self) -> dict[str, NamedDataset]:
        """Every named dataset, by name (blocking: lists the roots)."""
        found: dict[str, NamedDataset] = {}

        def add(ds: NamedDataset) -> None:
            if ds.name in found:
                logger.warning("dataset %r is defined twice; the first (%s) is used", ds.name,
                               next(iter(found[ds.name].versions.values())).source)
                return
            found[ds.name] = ds

        for root in self.roots:
            for ds in self._scan(root):
                add(ds)
        if self.plugins:
            for ep in importlib.metadata.entry_points(group=PLUGIN_GROUP):
                if not NAME_RE.match(ep.name):
                    logger.warning("dataset plugin %r: not a valid dataset name; skipped", ep.name)
                    continue
                version = ep.dist.version if ep.dist is not None else "0"
                add(NamedDataset(ep.name, f"plugin {ep.value}",
                                 {version: DatasetVersion(version, "plugin", loader=ep.load, origin=ep.value)}))
        for name, factory in self.builtins.items():
            add(NamedDataset(name, "built-in generator (sized by n and seed)",
                             {"builtin": DatasetVersion("builtin", "builtin", factory=factory)}))
        return dict(sorted(found.items()))

    def _scan(self, root: Path) -> list[NamedDataset]:
        try:
            entries = sorted(root.iterdir())[:MAX_ENTRIES]
        except OSError:
            return []
        out = []
        for p in entries:
            if p.name.startswith("."):
                continue
            if p.is_file() and p.suffix in FORMATS and NAME_RE.match(p.stem):
                out.append(NamedDataset(p.stem, "", {DEFAULT_VERSION: DatasetVersion(DEFAULT_VERSION, "file", p)}))
            elif p.is_dir() and NAME_RE.match(p.name):
                ds = self._folder(p)
                if ds is not None:
                    out.append(ds)
        return out

    def _folder(self, folder: Path) -> NamedDataset | None:
        if _is_saved_folder(folder):
            return NamedDataset(folder.name, "", {DEFAULT_VERSION: DatasetVersion(DEFAULT_VERSION, "file", folder)})
        manifest: dict[str, Any] = {}
        if (folder / MANIFEST).is_file():
            try:
                manifest = dict(yaml.safe_load((folder / MANIFEST).read_text()) or {})
            except (OSError, ValueError, yaml.YAMLError) as exc:
                logger.warning("dataset %s: %s unreadable (%s); ignored", folder.name, MANIFEST, exc)
        keys = tuple((k, manifest[k]) for k in ("prompt_key", "answer_key") if k in manifest)
        versions = {}
        for p in sorted(folder.iterdir())[:MAX_ENTRIES]:
            stem = p.stem if p.is_file() else p.name
            if p.name.startswith(".") or not NAME_RE.match(stem):
                continue
            if (p.is_file() and p.suffix in FORMATS) or _is_saved_folder(p):
                versions[stem] = DatasetVersion(stem, "file", p, keys=keys)
        if not versions:
            return None
        return NamedDataset(folder.name, str(manifest.get("description", "")), versions)

    # --------------------------------------------------------------------------------------------- content
    def sha256(self, v: DatasetVersion) -> str | None:
        """The version's content hash (module docstring); None for a built-in (it depends on ``n``, ``seed``)."""
        if v.source == "builtin":
            return None
        if v.source == "plugin":
            key: tuple[Any, ...] = ("plugin", v.origin, v.version)
        else:
            assert v.path is not None
            st = v.path.stat()
            key = ("file", str(v.path), st.st_size, st.st_mtime_ns)
        with self._lock:
            if key in self._hashes:
                return self._hashes[key]
        if v.source == "plugin":
            digest = tasks_sha256(self._plugin_tasks(v))
        else:
            assert v.path is not None
            digest = file_sha256(v.path)
        with self._lock:
            self._hashes[key] = digest
        return digest

    def _plugin_tasks(self, v: DatasetVersion) -> list[Task]:
        assert v.loader is not None
        try:
            rows = v.loader()()
            return [r if isinstance(r, Task) else task_from_row(r, i, path="plugin", id_prefix="item")
                    for i, r in enumerate(rows)]
        except DatasetError:
            raise
        except Exception as exc:  # a plugin's bug is the server's problem, said clearly
            raise DatasetError(f"the dataset plugin failed: {exc!r}") from exc

    def load(self, name: str, version: str | None, *, n: int, seed: int, prompt_key: str,
             answer_key: str | None, max_rows: int) -> tuple[list[Task], str, str | None]:
        """(tasks, version, sha256) of a named dataset. Raises SpecError naming ``dataset.name`` or
        ``dataset.version``."""
        known = self.datasets()
        ds = known.get(name)
        if ds is None:
            raise SpecError(("dataset", "name"), f"unknown dataset {name!r}; registered datasets: "
                            f"{', '.join(known) or 'none'} (GET /v1/datasets), or give 'items' or a server-side "
                            "'path'")
        chosen = version or ds.latest
        v = ds.versions.get(chosen)
        if v is None:
            raise SpecError(("dataset", "version"), f"dataset {name!r} has no version {chosen!r}; its versions: "
                            f"{', '.join(sorted(ds.versions, key=natural_order))}")
        try:
            if v.source == "builtin":
                assert v.factory is not None
                tasks = v.factory(n, seed)
                return tasks, chosen, tasks_sha256(tasks)
            if v.source == "plugin":
                tasks = self._plugin_tasks(v)
            else:
                assert v.path is not None
                keys = {"prompt_key": prompt_key, "answer_key": answer_key} | dict(v.keys)
                tasks = load_task_file(v.path, max_rows=max_rows, **keys)
        except DatasetError as exc:
            raise SpecError(("dataset", "name"), f"dataset {name!r} version {chosen!r}: {exc.message}") from None
        return tasks, chosen, self.sha256(v)


def file_sha256(path: Path) -> str:
    """The sha256 of a file's bytes; of a folder: of the lines ``<relative path> <sha256>`` of its files, sorted."""
    files = sorted(f for f in path.rglob("*") if f.is_file()) if path.is_dir() else [path]
    if not path.is_dir():
        return _bytes_sha256(path)
    lines = [f"{f.relative_to(path).as_posix()} {_bytes_sha256(f)}" for f in files]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def _bytes_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
