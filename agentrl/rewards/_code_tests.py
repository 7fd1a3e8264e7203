"""What the code reward reads: test cases in the public datasets' formats, the program in a response, and the
rules that compare a program's output with the expected one. No sandbox here (see ``code.py``).

Test formats (:func:`parse_tests`; a JSON string of any of them is decoded first):

- agentrl's own: ``[{"stdin": ..., "expected_stdout": ...}, {"assertion": "assert f(1) == 2"}, ...]`` (also the
  keys ``input``/``output``/``stdout``/``expected_output``/``assert``/``code``), ``["assert ...", ...]``,
  ``{"asserts": [...]}``;
- APPS / TACO / verl's code parquet (``reward_model.ground_truth``): ``{"inputs": [...], "outputs": [...]}``,
  stdin/stdout cases; with ``"fn_name"``: function-call cases (each input a list of arguments, each output the
  return value, or a one-element list holding it, as APPS's checker accepts either);
- LiveCodeBench: ``{"public_test_cases": ..., "private_test_cases": ..., "metadata": {"func_name": ...}}``, each
  a list (or its JSON) of ``{"input", "output", "testtype": "stdin" | "functional"}``; the private cases as
  LiveCodeBench ships them (base64 of zlib of a pickled JSON string: unpickled with no class allowed, so only
  plain strings can come out); functional cases call ``func_name`` (a top-level function, or a method of
  ``Solution()``) with one JSON argument per input line and compare the JSON return value.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import math
import pickle
import zlib
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from agentrl.errors import ConfigError

CompareMode = Literal["exact", "whitespace", "float"]

#: fence info strings → sandbox language
FENCE_TAGS: dict[str, str] = {
    **dict.fromkeys(("python", "py", "python3", "py3"), "python"),
    **dict.fromkeys(("cpp", "c++", "cc", "cxx"), "cpp"),
    "c": "c",
    "java": "java",
    **dict.fromkeys(("go", "golang"), "go"),
    **dict.fromkeys(("rust", "rs"), "rust"),
    **dict.fromkeys(("javascript", "js", "node", "nodejs"), "nodejs"),
    **dict.fromkeys(("typescript", "ts"), "typescript"),
    **dict.fromkeys(("bash", "sh", "shell"), "bash"),
}


def _fences(text: str) -> list[tuple[str, str]]:
    """(info tag, body) of every complete ``` fence, in order. Linear in ``len(text)`` (``str.find`` only)."""
    blocks: list[tuple[str, str]] = []
    pos = 0
    while (start := text.find("```", pos)) >= 0:
        line_end = text.find("\n", start)
        end = -1 if line_end < 0 else text.find("```", line_end + 1)
        if end < 0:
            break
        info = text[start + 3 : line_end].split()
        blocks.append((info[0].lower() if info else "", text[line_end + 1 : end]))
        pos = end + 3
    return blocks


def find_program(text: str, language: str | None = "python") -> tuple[str, str] | None:
    """(language, code): the last fence tagged as ``language`` (any known language when None), else the last
    untagged fence (as ``language``, or python when None); None when there is no non-empty one."""
    blocks = _fences(text)
    for tag, body in reversed(blocks):
        lang = FENCE_TAGS.get(tag)
        if lang is not None and (language is None or lang == language) and body.strip():
            return lang, body
    for tag, body in reversed(blocks):
        if tag == "" and body.strip():
            return language or "python", body
    return None


def extract_program(text: str, language: str = "python") -> str | None:
    """The last fenced block of ``language`` (python: ``python``/``py``/``python3``), else the last untagged one."""
    found = find_program(text, language)
    return None if found is None else found[1]


class TestCase(BaseModel):
    """One test: ``stdin`` + ``expected_stdout``; an ``assertion`` (Python statements); or a call of
    ``fn_name`` with ``args`` that must return ``returns``."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    __test__ = False  # not a pytest test class

    stdin: str = ""
    expected_stdout: str | None = None
    assertion: str | None = None
    fn_name: str | None = None
    args: tuple[Any, ...] = ()
    returns: Any = None

    @model_validator(mode="after")
    def _one_kind(self) -> TestCase:
        kinds = (self.expected_stdout is not None) + (self.assertion is not None) + (self.fn_name is not None)
        if kinds != 1:
            raise ValueError("a test needs exactly one of expected_stdout, assertion and fn_name")
        return self

    @property
    def kind(self) -> Literal["stdio", "assert", "call"]:
        return "stdio" if self.expected_stdout is not None else "assert" if self.assertion is not None else "call"


_ALIASES = {"input": "stdin", "output": "expected_stdout", "stdout": "expected_stdout",
            "expected_output": "expected_stdout", "assert": "assertion", "code": "assertion"}
_LCB_KEYS = ("public_test_cases", "private_test_cases")


class _NoClasses(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"the test cases may hold only plain data, found {module}.{name}")


def _lcb_cases(value: Any) -> list[Any]:
    if isinstance(value, str):
        text = value.strip()
        if not text:
            return []
        if text[0] != "[":  # LiveCodeBench's private cases: base64(zlib(pickle(json string)))
            try:
                text = _NoClasses(io.BytesIO(zlib.decompress(base64.b64decode(text)))).load()
            except (binascii.Error, zlib.error, pickle.UnpicklingError, EOFError) as exc:
                raise ValueError(f"cannot decode LiveCodeBench test cases: {exc}") from exc
        value = json.loads(text)
    if not isinstance(value, list):
        raise ValueError(f"LiveCodeBench test cases must be a list, got {type(value).__name__}")
    return value


def _from_lcb(row: dict[str, Any]) -> list[TestCase]:
    meta = row.get("metadata") or {}
    if isinstance(meta, str):
        meta = json.loads(meta) if meta.strip() else {}
    fn_name = meta.get("func_name") if isinstance(meta, dict) else None
    out: list[TestCase] = []
    for key in _LCB_KEYS:
        for case in _lcb_cases(row.get(key) or []):
            if case.get("testtype", "stdin") == "functional":
                if not fn_name:
                    raise ValueError("functional LiveCodeBench cases need metadata.func_name")
                args = tuple(json.loads(line) for line in str(case["input"]).split("\n") if line.strip())
                out.append(TestCase(fn_name=fn_name, args=args, returns=json.loads(case["output"])))
            else:
                out.append(TestCase(stdin=case["input"], expected_stdout=case["output"]))
    return out


def _from_io(raw: dict[str, Any]) -> list[TestCase]:
    inputs, outputs = raw["inputs"], raw.get("outputs", ())
    if len(inputs) != len(outputs):
        raise ValueError("inputs and outputs differ in length")
    fn_name = raw.get("fn_name")
    if fn_name:
        return [TestCase(fn_name=fn_name, args=tuple(i) if isinstance(i, list) else (i,), returns=o)
                for i, o in zip(inputs, outputs)]
    return [TestCase(stdin=_text(i), expected_stdout=_text(o)) for i, o in zip(inputs, outputs)]


def _text(value: Any) -> str:
    """APPS/TACO stdio cases are strings, sometimes lists of lines."""
    return "\n".join(map(str, value)) if isinstance(value, list) else str(value)


def parse_tests(raw: Any) -> tuple[TestCase, ...]:
    """Test cases from a task's metadata, in any format of the module docstring (or its JSON string)."""
    try:
        if isinstance(raw, str | bytes):
            raw = json.loads(raw)
        if isinstance(raw, dict) and any(k in raw for k in _LCB_KEYS):
            raw = _from_lcb(raw)
        elif isinstance(raw, dict) and "inputs" in raw:
            raw = _from_io(raw)
        elif isinstance(raw, dict) and "asserts" in raw:
            raw = list(raw["asserts"])
        if not isinstance(raw, list) or not raw:
            raise ValueError(f"expected a non-empty list of tests, got {type(raw).__name__}")
        return tuple(t if isinstance(t, TestCase) else TestCase(assertion=t) if isinstance(t, str)
                     else TestCase(**{_ALIASES.get(k, k): v for k, v in t.items()}) for t in raw)
    except (ValidationError, ValueError, TypeError, AttributeError, KeyError) as exc:
        raise ConfigError(
            f"bad code tests ({exc}); expected a list of {{stdin, expected_stdout}} / {{assertion}} objects, "
            "a list of assert strings, {inputs, outputs[, fn_name]} (APPS/TACO/verl), or LiveCodeBench's "
            "public_test_cases/private_test_cases (as objects or their JSON string)"
        ) from exc


def outputs_match(got: str, expected: str, rel_tol: float = 1e-6, mode: CompareMode = "float") -> bool:
    """Whether a program's stdout is the expected one:

    - ``exact``: equal, but for trailing newlines;
    - ``whitespace``: the same whitespace-separated tokens;
    - ``float``: lines equal up to trailing spaces, else the same tokens with numbers (where the expected token
      has ``.``, ``e`` or ``E``) within ``rel_tol`` (relative, and absolute below 1).
    """
    if mode == "exact":
        return got.rstrip("\n") == expected.rstrip("\n")
    got_tokens, expected_tokens = got.split(), expected.split()
    if mode == "whitespace":
        return got_tokens == expected_tokens

    def lines(s: str) -> list[str]:
        return [line.rstrip() for line in s.strip().splitlines()]

    if lines(got) == lines(expected):
        return True
    return len(got_tokens) == len(expected_tokens) and all(
        _tokens_match(g, e, rel_tol) for g, e in zip(got_tokens, expected_tokens))


def _tokens_match(got: str, expected: str, rel_tol: float) -> bool:
    if got == expected:
        return True
    if not any(c in expected for c in ".eE"):
        return False
    try:
        g, e = float(got), float(expected)
    except ValueError:
        return False
    return math.isfinite(g) and abs(g - e) <= rel_tol * max(1.0, abs(e))


def returns_match(got: Any, expected: Any, rel_tol: float = 1e-6) -> bool:
    """A function's JSON return value against the expected one (APPS's rule: also the first element of a
    one-element expected list); floats within ``rel_tol``."""
    if _json_equal(got, expected, rel_tol):
        return True
    return isinstance(expected, list) and len(expected) == 1 and _json_equal(got, expected[0], rel_tol)


def _json_equal(a: Any, b: Any, tol: float) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        if isinstance(a, bool) or isinstance(b, bool) or not all(isinstance(x, int | float) for x in (a, b)):
            return False
        return abs(a - b) <= tol * max(1.0, abs(b))
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_json_equal(x, y, tol) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_json_equal(a[k], b[k], tol) for k in a)
    return type(a) is type(b) and a == b
