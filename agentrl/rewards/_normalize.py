"""Answer extraction and the textual normalisations math-verify lacks (pure string code, no recursion).

Extraction (:func:`extract_answer`, :func:`braces_ok`) is linear in the response, so it is safe on megabyte
input in the caller's process. Normalisation may be quadratic and runs only on answers already cut to the
checker's length cap.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_WRAPPERS = ("\\text", "\\textbf", "\\textrm", "\\mathrm", "\\mathbf", "\\mbox", "\\textit")
_DELETE = ("\\displaystyle", "\\!", "\\left.", "\\right.")
_SPACES = ("\\;", "\\:", "\\quad", "\\qquad", "~", "\\ ")
_DEGREE_SUFFIXES = (
    "^{\\circ}",
    "^\\circ",
    "°",
    "\\degree",
    "\\text{degrees}",
    "\\text{ degrees}",
    " degrees",
)
_NUMBER_WITH_SEPARATORS = re.compile(r"[+-]?\d{1,3}(?:(?:,|\{,\}|\\,| )\d{3})+(?:\.\d+)?")
_SEPARATOR = re.compile(r",|\{,\}|\\,| ")
_UNIT_WORDS = frozenset(
    [
        "cm",
        "mm",
        "km",
        "m",
        "meter",
        "meters",
        "metre",
        "metres",
        "inch",
        "inches",
        "in",
        "ft",
        "feet",
        "foot",
        "yard",
        "yards",
        "mile",
        "miles",
        "mph",
        "kg",
        "g",
        "gram",
        "grams",
        "mg",
        "lb",
        "lbs",
        "pound",
        "pounds",
        "ounce",
        "ounces",
        "oz",
        "s",
        "sec",
        "second",
        "seconds",
        "min",
        "minute",
        "minutes",
        "h",
        "hr",
        "hour",
        "hours",
        "day",
        "days",
        "week",
        "weeks",
        "month",
        "months",
        "year",
        "years",
        "dollar",
        "dollars",
        "cent",
        "cents",
        "unit",
        "units",
        "square",
        "cubic",
        "sq",
        "l",
        "liter",
        "liters",
        "litre",
        "litres",
        "ml",
        "degree",
        "degrees",
        "people",
        "students",
        "apples",
        "marbles",
        "cookies",
        "books",
        "times",
        "ways",
    ]
)
_TRAILING_TEXT = re.compile(
    r"^(?P<head>.*?[\d}.)])\s*\\(?:text|mbox|mathrm|textrm)\{(?P<unit>[^{}]{1,40})\}(?:\^\{?\d\}?)?$"
)
_TRAILING_WORDS = re.compile(
    r"^(?P<head>.*?[\d}.)])\s+(?P<unit>[A-Za-z]+(?:\s+[A-Za-z]+){0,2})(?:\^\{?\d\}?)?$"
)
_CHOICE = re.compile(r"^(?:\((?P<a>[A-J])\)|(?P<b>[A-J])(?:[.):]|\s|$))")
_TEXT_ANSWER = re.compile(r"^[A-Za-z][A-Za-z '\-]*$")
_MATH_WORDS = frozenset(
    ["sin", "cos", "tan", "cot", "sec", "csc", "log", "ln", "exp", "pi", "infty", "inf", "sqrt", "frac"]
)


def _balanced_end(text: str, open_pos: int) -> int | None:
    """Index just past the ``}`` that closes the ``{`` at ``open_pos`` (``\\{``, ``\\}`` do not count)."""
    depth = 0
    for match in re.finditer(r"\\.|[{}]", text[open_pos:], flags=re.DOTALL):
        token = match.group()
        if token == "{":
            depth += 1
        elif token == "}":
            depth -= 1
            if depth == 0:
                return open_pos + match.end()
    return None


def extract_boxed(text: str) -> tuple[bool, str | None]:
    """(found a box command, content of the LAST ``\\boxed``/``\\fbox``; None if it is unclosed)."""
    start = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
    if start < 0:
        return False, None
    cmd = next(c for c in _BOX_COMMANDS if text.startswith(c, start))
    pos = start + len(cmd)
    while pos < len(text) and text[pos] == " ":
        pos += 1
    if pos < len(text) and text[pos] == "{":
        end = _balanced_end(text, pos)
        return True, None if end is None else text[pos + 1 : end - 1].strip()
    # ``\boxed 5``: the argument is the next token
    match = re.match(r"[^\s$]+", text[pos : pos + 256])
    return True, match.group() if match else None


def extract_answer_tag(text: str) -> str | None:
    """Content of the last ``<answer>…</answer>``."""
    end = text.rfind("</answer>")
    if end < 0:
        return None
    start = text.rfind("<answer>", 0, end)
    return None if start < 0 else text[start + len("<answer>") : end].strip()


def extract_answer(text: str) -> str | None:
    """The LAST ``\\boxed{…}``/``\\fbox{…}`` (balanced braces); else the content of the last
    ``<answer>…</answer>``.

    None when there is neither, or when the last box is never closed (a truncated answer is not an answer).
    """
    found_box, boxed = extract_boxed(text)
    if found_box:
        return boxed
    return extract_answer_tag(text)


def braces_ok(text: str, max_depth: int) -> bool:
    """Braces and brackets balance (``{}`` exactly; ``()[]`` as a group, since intervals mix them) and nest at
    most ``max_depth`` deep."""
    curly = group = 0
    for match in re.finditer(r"\\[{}]|[{}()\[\]]", text):
        token = match.group()
        if token in ("{", "\\{"):
            curly += 1
        elif token in ("}", "\\}"):
            curly -= 1
        elif token in "([":
            group += 1
        else:
            group -= 1
        if curly < 0 or group < 0 or curly + group > max_depth:
            return False
    return curly == 0 and group == 0


def _unwrap(text: str) -> str:
    """Strip ``\\text{X}`` (and friends) around the whole answer, and surrounding ``$``, ``\\(…\\)``,
    ``\\[…\\]``."""
    changed = True
    while changed:
        changed = False
        text = text.strip()
        for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
            if len(text) > len(left) + len(right) and text.startswith(left) and text.endswith(right):
                text, changed = text[len(left) : -len(right)], True
        for cmd in _WRAPPERS:
            if text.startswith(cmd + "{") and _balanced_end(text, len(cmd)) == len(text):
                text, changed = text[len(cmd) + 1 : -1], True
    return text


def normalize(answer: str) -> str:
    """Spacing, wrappers, trailing punctuation, ``\\dfrac``, degrees, thousands separators, simple units."""
    text = _unwrap(answer)
    for token in _DELETE:
        text = text.replace(token, "")
    text = re.sub(r"\\(?:left|right)(?![A-Za-z])", "", text)
    for token in _SPACES:
        text = text.replace(token, " ")
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    text = re.sub(r"\s+", " ", text).strip().rstrip(".").strip()
    text = _unwrap(text)
    text = _strip_degrees(text)
    text = _strip_units(text)
    text = text.replace("\\$", "").replace("$", "").strip()
    if _NUMBER_WITH_SEPARATORS.fullmatch(text):
        text = _SEPARATOR.sub("", text)
    return text.replace("\\,", "").strip()


def _strip_degrees(text: str) -> str:
    for suffix in _DEGREE_SUFFIXES:
        if text.endswith(suffix) and len(text) > len(suffix):
            return text[: -len(suffix)].strip()
    return text


def _strip_units(text: str) -> str:
    match = _TRAILING_TEXT.match(text)
    if match and re.search(r"[A-Za-z]", match["unit"]):
        return match["head"].strip()
    match = _TRAILING_WORDS.match(text)
    if match and all(w.lower() in _UNIT_WORDS for w in match["unit"].split()):
        return match["head"].strip()
    return text


def choice_letter(answer: str) -> str | None:
    """``B``, ``(B)``, ``B)``, ``B.``, ``(B) 42`` → ``B`` (capital letters A–J only)."""
    plain = re.sub(r"\\(?:text|textbf|textrm|mathrm|mathbf|mbox)\{([^{}]*)\}", r"\1", answer)
    match = _CHOICE.match(plain.strip())
    return None if match is None else (match["a"] or match["b"])


def is_choice(reference: str) -> bool:
    """A reference that is nothing but a choice letter."""
    return re.fullmatch(r"\(?[A-J]\)?", reference.strip()) is not None


def is_text_wrapped(answer: str) -> bool:
    """The whole answer is inside ``\\text{…}``, ``\\textbf{…}`` or ``\\mbox{…}``."""
    text = answer.strip().strip("$").strip()
    for cmd in ("\\text{", "\\textbf{", "\\mbox{"):
        if text.startswith(cmd) and _balanced_end(text, len(cmd) - 1) == len(text):
            return True
    return False


def text_answer(answer: str, min_word: int = 3) -> str | None:
    """Casefolded words when the answer is plain words (``Monday``, ``even``), else None (it is maths)."""
    if not _TEXT_ANSWER.fullmatch(answer):
        return None
    words = answer.replace("-", " ").split()
    if not any(len(w) >= min_word and w.lower() not in _MATH_WORDS for w in words):
        return None
    return " ".join(words).casefold()


@dataclass(frozen=True, slots=True)
class Structure:
    """Top-level shape of an answer: ``ordered`` (tuple or interval, with its brackets),
    ``set`` (``\\{…\\}``), ``list`` (bare comma list, unordered like a set) or ``scalar``."""

    kind: str
    items: tuple[str, ...] = ()
    brackets: str = ""


def split_top_level(text: str) -> list[str]:
    """Split on commas outside any bracket."""
    parts, depth, start = [], 0, 0
    for match in re.finditer(r"\\[{}]|[{}()\[\],]", text):
        token = match.group()
        if token == ",":
            if depth == 0:
                parts.append(text[start : match.start()].strip())
                start = match.end()
        elif token in ("{", "\\{", "(", "["):
            depth += 1
        else:
            depth -= 1
    parts.append(text[start:].strip())
    return parts


def _encloses(text: str) -> bool:
    """The opening bracket at 0 is closed by the bracket at the very end (any bracket type counts)."""
    depth = 0
    for match in re.finditer(r"\\[{}]|[{}()\[\]]", text):
        depth += 1 if match.group() in ("{", "\\{", "(", "[") else -1
        if depth == 0:
            return match.end() == len(text)
    return False


def structure(answer: str) -> Structure:
    if answer.startswith("\\{") and answer.endswith("\\}") and _encloses(answer):
        inner = answer[2:-2].strip()
        return Structure("set", tuple(split_top_level(inner)) if inner else ())
    if len(answer) >= 2 and answer[0] in "([" and answer[-1] in ")]" and _encloses(answer):
        items = split_top_level(answer[1:-1])
        if len(items) >= 2:
            return Structure("ordered", tuple(items), answer[0] + answer[-1])
    items = split_top_level(answer)
    if len(items) >= 2:
        return Structure("list", tuple(items))
    return Structure("scalar", (answer,))
