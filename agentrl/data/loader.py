"""Dataset files through Hugging Face ``datasets``: the one loader of training, held-out evaluation and the eval API.

Formats, by the path: ``.jsonl`` and ``.json`` (JSON lines, or one JSON list of objects), ``.parquet``, ``.arrow``
(an Arrow IPC file or stream), or a folder written by ``save_to_disk`` (of a ``DatasetDict``: its ``train``
split, or its only split). Files are read with ``datasets.load_dataset`` (cached as Arrow in the HF datasets
cache, nothing downloaded), folders with ``datasets.load_from_disk``.

A row becomes a :class:`agentrl.types.Task`:

- ``prompt_key`` names the prompt: a string, or a list of chat messages ``{role, content}`` (→ ``Task.messages``;
  ``Task.prompt`` is then the text of the last user message);
- ``answer_key`` names the reference answer, made a string by :func:`answer_text` (``None``: the dataset has
  no answers; every task's answer is None);
- a key is a column name or a dotted path into nested columns (``reward_model.ground_truth``);
- an ``id`` column, if any, gives the task id (else ``<file stem>-<row>``);
- every other column goes to ``Task.metadata`` as it is. A dotted key leaves its top-level column there (it may
  hold more, e.g. ``reward_model.style``, and keeps the raw answer).

So verl's RL parquet layout (``prompt`` as messages, ``reward_model.ground_truth``, ``data_source``,
``extra_info``) loads with ``answer_key="reward_model.ground_truth"``.

Every error is a :class:`DatasetError` (a ``ConfigError``) that names the file (and the row, counted from 0),
what was expected and what was found (columns, with a "did you mean" for a misspelt key). :func:`check_dataset` reads only the first row, so a
driver can check its data before it starts any server.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from agentrl.errors import ConfigError, closest
from agentrl.types import Task

#: file suffix → ``datasets`` builder
FORMATS: dict[str, str] = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}
FORMATS_TEXT = ".jsonl, .json, .parquet, .arrow, or a folder written by save_to_disk"


class DatasetError(ConfigError):
    """A dataset that cannot be used as configured. ``field`` names the setting at fault: ``path``,
    ``prompt_key``, ``answer_key`` (or whatever key name the caller passed, e.g. ``messages_key``)."""

    def __init__(self, message: str, *, field: str = "path") -> None:
        super().__init__(message)
        self.message = message
        self.field = field


def is_dataset_path(source: str | Path) -> bool:
    """Whether ``source`` names a dataset file or folder (by its suffix, or because it is an existing folder)."""
    p = Path(source)
    return p.suffix in FORMATS or p.is_dir()


# --- reading -------------------------------------------------------------------------------------------------------

def open_dataset(path: str | Path, *, streaming: bool = False) -> Any:
    """The rows of a dataset file or folder: a ``datasets.Dataset`` (or an ``IterableDataset`` with
    ``streaming``, which reads only what is iterated; folders are memory-mapped either way)."""
    import datasets

    p = Path(path)
    if not p.exists():
        raise DatasetError(f"dataset {p} does not exist (expected {FORMATS_TEXT})")
    if p.is_dir():
        return _from_disk(p)
    builder = FORMATS.get(p.suffix)
    if builder is None:
        raise DatasetError(f"dataset {p}: unknown format {p.suffix or '(no suffix)'!r}; expected {FORMATS_TEXT}")
    if p.stat().st_size == 0:
        raise DatasetError(f"dataset {p} holds no rows (the file is empty)")
    try:
        if streaming:
            with _streaming_without_torch():
                return datasets.load_dataset(builder, data_files=str(p), split="train", streaming=True)
        return datasets.load_dataset(builder, data_files=str(p), split="train")
    except Exception as exc:  # noqa: BLE001  (any parse failure of the user's file: say which file and why)
        if not streaming and _streams_no_rows(p, builder):  # e.g. a parquet file with a schema and no rows
            raise DatasetError(f"dataset {p} holds no rows") from None
        raise DatasetError(f"dataset {p} cannot be read as {builder}: {type(exc).__name__}: {exc}") from exc


_TORCH_SWITCH = threading.Lock()


@contextlib.contextmanager
def _streaming_without_torch() -> Iterator[None]:
    """HF datasets' ``IterableDataset`` imports torch where it is installed, to share its epoch counter with
    DataLoader workers, which agentrl never gives it: a check before a run (the controller's ``first_row``) then
    paid ~3 s and torch's ~280 MB of memory for the rest of the run. Off while a streaming dataset is made (a
    documented switch, ``datasets.config.TORCH_AVAILABLE``, as ``USE_TORCH=0`` sets it; put back after)."""
    import datasets

    with _TORCH_SWITCH:  # one switch at a time (the eval service reads datasets in threads): the flag comes back
        before = datasets.config.TORCH_AVAILABLE
        datasets.config.TORCH_AVAILABLE = False
        try:
            yield
        finally:
            datasets.config.TORCH_AVAILABLE = before


def _streams_no_rows(p: Path, builder: str) -> bool:
    import datasets

    try:
        with _streaming_without_torch():
            ds = datasets.load_dataset(builder, data_files=str(p), split="train", streaming=True)
        return next(iter(ds), None) is None
    except Exception:  # noqa: BLE001  (unreadable: the caller reports its own error)
        return False


def _from_disk(p: Path) -> Any:
    import datasets

    if not ((p / "state.json").exists() or (p / "dataset_dict.json").exists()):
        raise DatasetError(f"dataset {p} is a folder but not one written by save_to_disk (no state.json or "
                           f"dataset_dict.json in it); expected {FORMATS_TEXT}")
    try:
        ds = datasets.load_from_disk(str(p))
    except Exception as exc:  # noqa: BLE001
        raise DatasetError(f"dataset {p} cannot be loaded with load_from_disk: {type(exc).__name__}: {exc}") from exc
    if isinstance(ds, datasets.DatasetDict):
        splits = list(ds)
        if "train" in ds:
            return ds["train"]
        if len(splits) == 1:
            return ds[splits[0]]
        raise DatasetError(f"dataset {p} holds the splits {', '.join(splits)} and none is named 'train'; save the "
                           "split to use on its own (ds['<split>'].save_to_disk(...))")
    return ds


def first_row(path: str | Path) -> dict[str, Any]:
    """The first row of a dataset, read cheaply (streaming): for checks before a run starts."""
    ds = open_dataset(path, streaming=True)
    try:
        row = next(iter(ds), None)
    except Exception as exc:  # noqa: BLE001  (a streaming read parses lazily: its errors come here)
        raise DatasetError(f"dataset {path} cannot be read: {type(exc).__name__}: {exc}") from exc
    if row is None:
        raise DatasetError(f"dataset {path} holds no rows")
    return dict(row)


def iter_rows(path: str | Path, *, limit: int | None = None, max_rows: int | None = None) -> Iterator[dict[str, Any]]:
    """Every row of a dataset (the first ``limit`` ones if given). More than ``max_rows`` rows (after ``limit``)
    is an error; so is an empty dataset."""
    ds = open_dataset(path)
    n = len(ds) if limit is None else min(limit, len(ds))
    if n == 0:
        raise DatasetError(f"dataset {path} holds no rows")
    if max_rows is not None and n > max_rows:
        raise DatasetError(f"dataset {path} holds {n} rows, more than the {max_rows} allowed; split it or use a limit")
    for row in itertools.islice(ds, n):
        yield dict(row)


# --- keys ----------------------------------------------------------------------------------------------------------

_MISSING = object()


def get_key(row: Mapping[str, Any], key: str) -> Any:
    """``row[key]``, where ``key`` may be a dotted path into nested mappings (a column whose own name holds the
    dots wins). Returns a sentinel (see :func:`has_key`) when absent."""
    if key in row:
        return row[key]
    node: Any = row
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return _MISSING
        node = node[part]
    return node


def has_key(row: Mapping[str, Any], key: str) -> bool:
    return get_key(row, key) is not _MISSING


def column_paths(row: Mapping[str, Any], prefix: str = "", depth: int = 3) -> list[str]:
    """Column names and dotted paths into nested columns (to ``depth`` levels), in order."""
    out: list[str] = []
    for k, v in row.items():
        name = f"{prefix}{k}"
        out.append(name)
        if isinstance(v, Mapping) and depth > 1:
            out += column_paths(v, f"{name}.", depth - 1)
    return out


def missing_key_error(path: str | Path, row: Mapping[str, Any], key: str, field: str,
                      expected: str) -> DatasetError:
    """The error for a key a dataset lacks: names the file, the key, what it should hold, the columns found,
    and the closest column path when the key looks misspelt."""
    found = column_paths(row)
    close = closest(key, found)
    hint = f"; did you mean {field}={close!r}?" if close else f"; set {field} to the column that holds it"
    shown = ", ".join(found[:40]) + (", …" if len(found) > 40 else "")
    return DatasetError(f"dataset {path} has no column {key!r} ({field}: {expected}); columns found: "
                        f"{shown or 'none'}{hint}", field=field)


# --- values --------------------------------------------------------------------------------------------------------

def chat_messages(value: Any, where: str, *, field: str = "prompt_key") -> tuple[dict[str, Any], ...]:
    """A list of chat messages checked and copied: each a mapping with a string ``role`` and a string ``content``
    (``None`` allowed for assistant messages, which may carry ``tool_calls`` instead). Keys whose value is None
    are dropped (Arrow gives every message every key any message of the column has), except ``content``."""
    if not isinstance(value, list | tuple) or not value:
        raise DatasetError(f"{where}: expected a non-empty list of chat messages {{role, content}}, got "
                           f"{_short(value)}", field=field)
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise DatasetError(f"{where}: message {i} is not a {{role, content}} mapping: {_short(m)}", field=field)
        content = m.get("content")
        if not isinstance(content, str) and not (content is None and m["role"] == "assistant"):
            raise DatasetError(f"{where}: message {i} ({m['role']}) has no string content: {_short(m)}", field=field)
        out.append({k: v for k, v in m.items() if v is not None or k == "content"})
    return tuple(out)


def prompt_of(value: Any, where: str, *, field: str = "prompt_key") -> tuple[str, tuple[dict[str, Any], ...]]:
    """``(prompt text, messages)`` of a prompt value: a non-empty string (no messages), or chat messages with at
    least one user message (the text is that of the last one)."""
    if isinstance(value, str):
        if not value:
            raise DatasetError(f"{where}: the prompt is an empty string", field=field)
        return value, ()
    messages = chat_messages(value, where, field=field)
    users = [m["content"] for m in messages if m["role"] == "user"]
    if not users:
        raise DatasetError(f"{where}: the prompt's messages hold no user message", field=field)
    return str(users[-1]), messages


def answer_text(value: Any) -> str | None:
    """A reference answer as the string rewards compare with.

    ``None`` → None; a string → itself; a bool → ``"true"``/``"false"``; an int → its digits; a float →
    its digits when integral (``3.0`` → ``"3"``, as Arrow widens int columns with gaps), else its shortest
    round-trip form (``0.1``); a list of one element → that element's text (verl wraps single ground truths so);
    any other list or a mapping → its JSON text (a reward may ``json.loads`` it)."""
    if value is None or isinstance(value, str):
        return value
    if hasattr(value, "item") and not isinstance(value, list | tuple | dict):  # a numpy scalar
        value = value.item()
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return str(int(value)) if math.isfinite(value) and value.is_integer() else repr(value)
    if isinstance(value, list | tuple) and len(value) == 1:
        return answer_text(value[0])
    return json.dumps(value, ensure_ascii=False, default=str)


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "…"


# --- tasks ---------------------------------------------------------------------------------------------------------

def task_from_row(row: Mapping[str, Any], index: int, *, path: str | Path, prompt_key: str = "prompt",
                  answer_key: str | None = "answer", id_prefix: str | None = None) -> Task:
    """The task of one row (see the module docstring). Raises :class:`DatasetError` naming the file, row and key."""
    where = f"dataset {path}, row {index}"
    raw_prompt = get_key(row, prompt_key)
    if raw_prompt is _MISSING:
        raise missing_key_error(path, row, prompt_key, "prompt_key", "a string or a list of chat messages")
    if raw_prompt is None:
        raise DatasetError(f"{where}: the prompt ({prompt_key!r}) is null", field="prompt_key")
    prompt, messages = prompt_of(raw_prompt, f"{where}, {prompt_key!r}")
    answer: str | None = None
    if answer_key is not None:
        raw_answer = get_key(row, answer_key)
        if raw_answer is _MISSING:
            raise missing_key_error(path, row, answer_key, "answer_key",
                                    "the reference answer; null if the dataset has none")
        answer = answer_text(raw_answer)
    consumed = {"id", prompt_key, answer_key}
    rid = row.get("id")
    task_id = str(rid) if isinstance(rid, str | int) and not isinstance(rid, bool) else \
        f"{id_prefix if id_prefix is not None else Path(path).stem}-{index}"
    return Task(id=task_id, prompt=prompt, answer=answer, messages=messages,
                metadata={k: v for k, v in row.items() if k not in consumed})


def load_task_file(path: str | Path, *, prompt_key: str = "prompt", answer_key: str | None = "answer",
                   limit: int | None = None, max_rows: int | None = None) -> list[Task]:
    """Every row of a dataset file or folder as a task (the first ``limit`` rows if given)."""
    return [task_from_row(row, i, path=path, prompt_key=prompt_key, answer_key=answer_key)
            for i, row in enumerate(iter_rows(path, limit=limit, max_rows=max_rows))]


def check_dataset(path: str | Path, *, prompt_key: str = "prompt", answer_key: str | None = "answer") -> None:
    """Cheap check that ``path`` is a readable, non-empty dataset whose first row has the keys (and a prompt of
    the right shape). Raises :class:`DatasetError`."""
    task_from_row(first_row(path), 0, path=path, prompt_key=prompt_key, answer_key=answer_key)
