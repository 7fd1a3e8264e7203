"""Evaluation datasets: inline items, registered datasets by name, or a ``.jsonl`` file.

Registered datasets are a plain ``dict[str, factory]``; a factory is called as ``factory(n, seed)`` and returns
tasks. Built in: the arithmetic word-problem families of :mod:`agentrl.data.arithmetic` as
``arithmetic:<family>`` (``arithmetic:heldout`` holds wordings never used for SFT).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

from agentrl.data import arithmetic
from agentrl.eval.base import SpecError
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
               allowed_dirs: Sequence[Path] | None = None) -> list[Task]:
    """The tasks of a dataset spec. ``allowed_dirs``: server-side files must lie under one of them, and a
    relative path is taken relative to the first (None: any path, relative to the working directory, for local
    runs). Raises :class:`SpecError` naming the field at fault."""
    if spec.items is not None:
        tasks = [Task(id=item.id or f"item-{i}", prompt=item.prompt, answer=item.answer,
                      metadata=dict(item.model_extra or {}))
                 for i, item in enumerate(spec.items)]
    elif spec.name is not None:
        registry = builtin_datasets() if datasets is None else datasets
        if spec.name not in registry:
            raise SpecError(("dataset", "name"), f"unknown dataset {spec.name!r}; registered datasets: "
                            f"{', '.join(sorted(registry))} (or give 'items' or a server-side 'path')")
        tasks = registry[spec.name](spec.n, spec.seed)
    else:
        assert spec.path is not None
        tasks = load_jsonl(_checked_path(spec.path, allowed_dirs))
    return tasks[: spec.limit] if spec.limit is not None else tasks


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
    if resolved.suffix != ".jsonl":
        raise SpecError(loc, f"dataset path {raw!r} must be a .jsonl file (one JSON object per line)")
    if not resolved.is_file():
        raise SpecError(loc, f"dataset file {raw!r} does not exist on the server")
    if resolved.stat().st_size > MAX_FILE_BYTES:
        raise SpecError(loc, f"dataset file {raw!r} is over {MAX_FILE_BYTES >> 20} MiB")
    return resolved


def load_jsonl(path: Path) -> list[Task]:
    """One JSON object per line with ``prompt`` (and usually ``answer``; ``id`` optional; other fields become
    metadata)."""
    loc = ("dataset", "path")
    tasks: list[Task] = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(loc, f"cannot read dataset file {path}: {exc}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            prompt = d["prompt"]
            if not isinstance(prompt, str) or not prompt:
                raise TypeError("'prompt' must be a non-empty string")
        except (ValueError, KeyError, TypeError) as exc:
            raise SpecError(loc, f"{path}:{n}: expected a JSON object with a 'prompt' string: {exc!r}") from None
        answer = d.get("answer")
        tasks.append(Task(id=str(d.get("id", f"{path.stem}-{n}")), prompt=prompt,
                          answer=None if answer is None else str(answer),
                          metadata={k: v for k, v in d.items() if k not in ("id", "prompt", "answer")}))
        if len(tasks) > MAX_ITEMS:
            raise SpecError(loc, f"{path} holds more than {MAX_ITEMS} items; split it or use 'limit'")
    if not tasks:
        raise SpecError(loc, f"dataset file {path} holds no items")
    return tasks


def tasks_to_json(tasks: Sequence[Task]) -> list[dict[str, object]]:
    return [{"id": t.id, "prompt": t.prompt, "answer": t.answer, "metadata": t.metadata} for t in tasks]


def tasks_from_json(data: Sequence[dict[str, object]]) -> list[Task]:
    return [Task(id=str(d["id"]), prompt=str(d["prompt"]),
                 answer=None if d.get("answer") is None else str(d["answer"]),
                 metadata=dict(d.get("metadata") or {}))  # type: ignore[call-overload]
            for d in data]
