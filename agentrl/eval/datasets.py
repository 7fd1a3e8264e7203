"""Evaluation datasets: inline items, named datasets, or a dataset file on this machine.

Named datasets come from a :class:`agentrl.eval.catalog.DatasetCatalog`: files under the server's dataset roots,
``agentrl.datasets`` plugins, and generators — a plain ``dict[str, factory]``; a factory is called as
``factory(n, seed)`` and returns tasks. Built in: the arithmetic word-problem families of
:mod:`agentrl.data.arithmetic` as ``arithmetic:<family>`` (``arithmetic:heldout`` holds wordings never used for
SFT). :func:`resolve_tasks` also returns the spec with the dataset's ``version`` and ``sha256`` filled in (what a
task records). Files and folders are read by
:mod:`agentrl.data.loader`, the loader training uses (.jsonl, .json, .parquet, .arrow, save_to_disk folders;
``prompt_key`` / ``answer_key`` with dotted paths; prompts as strings or chat messages).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

from agentrl.data import arithmetic
from agentrl.data.loader import DatasetError, is_dataset_path, load_task_file, task_from_row
from agentrl.eval.base import SpecError
from agentrl.eval.catalog import DatasetCatalog, file_sha256, tasks_sha256
from agentrl.eval.spec import MAX_ITEMS, DatasetSpec
from agentrl.types import Task

DatasetFactory = Callable[[int, int], list[Task]]

MAX_FILE_BYTES = 256 << 20


def _arithmetic(family: str, n: int, seed: int) -> list[Task]:
    return [p.task for p in arithmetic.problems(family, n, seed=seed)]


def builtin_datasets() -> dict[str, DatasetFactory]:
    """A fresh registry holding the built-in datasets (add your own: ``datasets["mine"] = factory``)."""
    return {f"arithmetic:{family}": partial(_arithmetic, family) for family in arithmetic.FAMILIES}


def load_tasks(spec: DatasetSpec, *, datasets: dict[str, DatasetFactory] | None = None,
               allowed_dirs: Sequence[Path] | None = None, catalog: DatasetCatalog | None = None) -> list[Task]:
    """The tasks of a dataset spec (see :func:`resolve_tasks`)."""
    return resolve_tasks(spec, datasets=datasets, allowed_dirs=allowed_dirs, catalog=catalog)[0]


def resolve_tasks(spec: DatasetSpec, *, datasets: dict[str, DatasetFactory] | None = None,
                  allowed_dirs: Sequence[Path] | None = None,
                  catalog: DatasetCatalog | None = None) -> tuple[list[Task], DatasetSpec]:
    """The tasks of a dataset spec, and the spec with ``version`` (of a named dataset) and ``sha256`` (of the
    content: see :mod:`agentrl.eval.catalog`) filled in. ``catalog``: the named datasets (default: ``datasets``
    or the built-ins, and the plugins). ``allowed_dirs``: server-side files must lie under one of them, and a
    relative path is taken relative to the first (None: any path, relative to the working directory, for local
    runs). Raises :class:`SpecError` naming the field at fault (``dataset.sha256`` when the content is not the
    one the spec pins)."""
    version = None
    if spec.items is not None:
        try:
            tasks = [task_from_row(item.model_dump(), i, path="items", id_prefix="item")
                     for i, item in enumerate(spec.items)]
        except DatasetError as exc:
            raise SpecError(("dataset", "items"), exc.message) from None
        digest: str | None = tasks_sha256(tasks)
    elif spec.name is not None:
        if catalog is None:
            catalog = DatasetCatalog(builtins=builtin_datasets() if datasets is None else datasets)
        tasks, version, digest = catalog.load(spec.name, spec.version, n=spec.n, seed=spec.seed,
                                              prompt_key=spec.prompt_key, answer_key=spec.answer_key,
                                              max_rows=MAX_ITEMS)
    else:
        assert spec.path is not None
        path = _checked_path(spec.path, allowed_dirs)
        try:
            tasks = load_task_file(path, prompt_key=spec.prompt_key, answer_key=spec.answer_key, limit=spec.limit,
                                   max_rows=MAX_ITEMS)
        except DatasetError as exc:
            raise SpecError(("dataset", exc.field), exc.message) from None
        digest = file_sha256(path)
    if spec.sha256 is not None and digest is not None and spec.sha256 != digest:
        raise SpecError(("dataset", "sha256"), f"the dataset's content has sha256 {digest}, not the {spec.sha256} "
                        "the spec pins: it changed on the server (drop sha256 to take it as it is)")
    resolved = spec.model_copy(update={"version": version, "sha256": digest})
    return (tasks[: spec.limit] if spec.limit is not None else tasks), resolved


def _checked_path(raw: str, allowed_dirs: Sequence[Path] | None) -> Path:
    loc = ("dataset", "path")
    path = Path(raw).expanduser()
    if not path.is_absolute() and allowed_dirs:
        path = allowed_dirs[0] / path  # relative to the server's first dataset directory
    try:
        resolved = path.resolve(strict=False)
    except (OSError, RuntimeError, ValueError) as exc:
        raise SpecError(loc, f"dataset path {raw!r} cannot be resolved: {exc}") from None
    if allowed_dirs is not None:
        roots = [d.resolve() for d in allowed_dirs]
        if not any(resolved.is_relative_to(r) for r in roots):
            raise SpecError(loc, f"dataset path {raw!r} is outside the directories this server reads datasets "
                            f"from ({', '.join(map(str, roots)) or 'none'}); put the file there or send 'items'")
    if not is_dataset_path(resolved):
        raise SpecError(loc, f"dataset path {raw!r} must be a .jsonl, .json, .parquet or .arrow file, or a folder "
                        "written by save_to_disk")
    if not resolved.exists():
        raise SpecError(loc, f"dataset {raw!r} does not exist on the server")
    size = sum(f.stat().st_size for f in resolved.rglob("*") if f.is_file()) if resolved.is_dir() \
        else resolved.stat().st_size
    if size > MAX_FILE_BYTES:
        raise SpecError(loc, f"dataset {raw!r} is over {MAX_FILE_BYTES >> 20} MiB")
    return resolved


def tasks_to_json(tasks: Sequence[Task]) -> list[dict[str, object]]:
    return [{"id": t.id, "prompt": t.prompt, "answer": t.answer, "metadata": t.metadata,
             "messages": list(t.messages)} for t in tasks]


def tasks_from_json(data: Sequence[dict[str, object]]) -> list[Task]:
    return [Task(id=str(d["id"]), prompt=str(d["prompt"]),
                 answer=None if d.get("answer") is None else str(d["answer"]),
                 metadata=dict(d.get("metadata") or {}),  # type: ignore[call-overload]
                 messages=tuple(dict(m) for m in d.get("messages") or ()))  # type: ignore[attr-defined]
            for d in data]
