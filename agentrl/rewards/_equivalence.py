"""Answer equivalence: our normalisations and structure rules in front of Hugging Face math-verify.

Order of checks for an extracted ``answer`` against a ``reference`` (the reference decides the kind):

1. guards: empty, longer than ``max_chars``, unbalanced or too deeply nested brackets → MALFORMED / TOO_LONG;
2. normalise both (spacing, wrappers, thousands separators, degrees, simple units) and compare strings;
3. multiple choice: a reference that is a lone letter ``A``–``J`` matches only the same letter;
4. plain words (``Monday``): casefolded string equality (math-verify would read them as products of symbols);
5. structure: an ordered reference (tuple or interval: ``(1,2)``, ``[0,1)``) needs the same brackets and the
   same items in order; a set ``\\{…\\}`` or bare comma list needs the same items in any order (a set and a
   bare list may match each other, a tuple and a set may not);
6. scalars: plain numbers compared here (exactly for rationals, to 6 decimals when one is written as a
   decimal, as math-verify does), anything else by math-verify (LaTeX parser, ``strict=True``).

math-verify's own signal timeouts are switched off (they break in threads and reset any outer alarm); the
whole check is bounded instead by :func:`soft_deadline` (interval-timer signal, main thread only) and, in the
checker pool, by killing the worker process.
"""

from __future__ import annotations

import contextlib
import enum
import re
import signal
import threading
from collections.abc import Iterator
from fractions import Fraction
from functools import lru_cache
from typing import Any

from agentrl.rewards import _normalize as norm

MAX_ANSWER_CHARS = 1000
MAX_DEPTH = 24
MAX_ITEMS = 32
FLOAT_DECIMALS = 6  # as math-verify's float_rounding


class Verdict(str, enum.Enum):
    """Outcome of one math check; only EQUAL scores."""

    EQUAL = "equal"
    NOT_EQUAL = "not_equal"
    NO_ANSWER = "no_answer"  # no \boxed{} nor <answer> in the response
    MALFORMED = "malformed"  # unclosed \boxed, unbalanced or absurdly nested brackets
    TOO_LONG = "too_long"  # the extracted answer is longer than the checker accepts
    TIMEOUT = "timeout"  # the check ran out of time (adversarial or pathological LaTeX)
    CHECKER_ERROR = "checker_error"  # the checker crashed on this answer (twice, on fresh workers)


class CheckTimeout(BaseException):
    """Raised by the soft deadline; a BaseException, so math-verify's ``except Exception`` cannot eat it."""


@contextlib.contextmanager
def soft_deadline(seconds: float, *, cpu: bool = False) -> Iterator[None]:
    """Raise :class:`CheckTimeout` after ``seconds`` of wall-clock time, or of this process's CPU time when
    ``cpu`` (SIGALRM / SIGPROF interval timers; a no-op outside the main thread; signals reach only it)."""
    if threading.current_thread() is not threading.main_thread() or seconds <= 0:
        yield
        return

    def on_timer(signum: int, frame: Any) -> None:
        raise CheckTimeout()

    timer, signum = (signal.ITIMER_PROF, signal.SIGPROF) if cpu else (signal.ITIMER_REAL, signal.SIGALRM)
    previous = signal.signal(signum, on_timer)
    signal.setitimer(timer, seconds)
    try:
        yield
    finally:
        signal.setitimer(timer, 0)
        signal.signal(signum, previous)


def guard(answer: str, max_chars: int = MAX_ANSWER_CHARS) -> Verdict | None:
    """Cheap linear checks done before any parsing; a verdict when the answer cannot be checked."""
    if not answer.strip():
        return Verdict.NO_ANSWER
    if len(answer) > max_chars:
        return Verdict.TOO_LONG
    if not norm.braces_ok(answer, MAX_DEPTH):
        return Verdict.MALFORMED
    return None


def no_answer_verdict(response_text: str) -> Verdict:
    """Why a response has no extractable answer: a box that never closes is MALFORMED, else NO_ANSWER."""
    return Verdict.MALFORMED if norm.extract_boxed(response_text)[0] else Verdict.NO_ANSWER


def check(answer: str, reference: str, *, max_chars: int = MAX_ANSWER_CHARS) -> Verdict:
    """Compare an extracted answer with a reference (no time bound here: see :func:`soft_deadline`)."""
    bad = guard(answer, max_chars)
    if bad is not None:
        return bad
    answer, reference_text = norm.normalize(answer), norm.normalize(reference)
    if norm.is_text_wrapped(reference):  # "\\text{no}": words, even short ones (math-verify reads n*o == o*n)
        ref_words = norm.text_answer(reference_text, min_word=1)
        if ref_words is not None:
            return Verdict.EQUAL if norm.text_answer(answer, min_word=1) == ref_words else Verdict.NOT_EQUAL
    return Verdict.EQUAL if _equal(answer, reference_text) else Verdict.NOT_EQUAL


def _equal(answer: str, reference: str) -> bool:
    if not answer or not reference:
        return False
    if answer == reference:
        return True
    if norm.is_choice(reference):
        return norm.choice_letter(answer) == norm.choice_letter(reference)
    ref_words = norm.text_answer(reference)
    if ref_words is not None:
        return norm.text_answer(answer) == ref_words
    return _structured_equal(answer, reference)


def _structured_equal(answer: str, reference: str) -> bool:
    ref, ans = norm.structure(reference), norm.structure(answer)
    if len(ref.items) > MAX_ITEMS or len(ans.items) > MAX_ITEMS:
        return False
    if ref.kind == "ordered":
        if ans.kind == "scalar":
            # e.g. "1 < x < 2" for "(1, 2)": math-verify relates inequalities to intervals
            return _scalar_equal(answer, reference)
        return (
            ans.kind == "ordered"
            and ans.brackets == ref.brackets
            and len(ans.items) == len(ref.items)
            and all(_item_equal(a, r) for a, r in zip(ans.items, ref.items))
        )
    if ref.kind in ("set", "list"):
        if ans.kind == "scalar" and len(ref.items) == 1:
            return _item_equal(answer, ref.items[0])
        return ans.kind in ("set", "list") and _same_multiset(ans.items, ref.items)
    if ans.kind != "scalar":
        if ans.kind == "set" and len(ans.items) == 1:
            return _item_equal(ans.items[0], reference)
        return False
    return _scalar_equal(answer, reference)


def _item_equal(answer: str, reference: str) -> bool:
    return _equal(norm.normalize(answer), norm.normalize(reference))


def _same_multiset(answers: tuple[str, ...], references: tuple[str, ...]) -> bool:
    if len(answers) != len(references):
        return False
    unmatched = list(answers)
    for ref in references:
        hit = next((i for i, a in enumerate(unmatched) if _item_equal(a, ref)), None)
        if hit is None:
            return False
        unmatched.pop(hit)
    return True


_FRAC = re.compile(r"(-?)\\frac(?:\{(-?\d{1,20})\}\{(\d{1,20})\}|(\d)(\d))")
_PLAIN = re.compile(r"[+-]?(?:\d{1,30}(?:\.\d{0,30})?|\.\d{1,30})(?:/\d{1,30})?")


def _as_number(text: str) -> tuple[Fraction, bool] | None:
    """(value, written as a decimal) for integers, decimals, ``a/b`` and ``\\frac{a}{b}``; else None."""
    try:
        if _PLAIN.fullmatch(text):
            return Fraction(text), "." in text
        match = _FRAC.fullmatch(text)
        if match:
            sign, num, den = match[1], match[2] or match[4], match[3] or match[5]
            return Fraction(int(sign + num), int(den)), False
    except (ValueError, ZeroDivisionError):
        return None
    return None


def _scalar_equal(answer: str, reference: str) -> bool:
    a, r = _as_number(answer), _as_number(reference)
    if a is not None and r is not None:
        # math-verify's rule: exact for rationals, rounded to 6 decimals if either is written as a decimal
        if a[1] or r[1]:
            return round(a[0], FLOAT_DECIMALS) == round(r[0], FLOAT_DECIMALS)
        return a[0] == r[0]
    return _math_verify_equal(answer, reference)


@lru_cache(maxsize=4096)
def _parse(text: str) -> tuple[Any, ...]:
    from math_verify import parse  # imported lazily: only checker processes pay for sympy

    return tuple(parse("\\boxed{" + text + "}", parsing_timeout=None))


def _math_verify_equal(answer: str, reference: str) -> bool:
    from math_verify import verify

    gold, target = _parse(reference), _parse(answer)
    if not gold or not target:
        return False
    return bool(
        verify(list(gold), list(target), float_rounding=FLOAT_DECIMALS, strict=True, timeout_seconds=None)
    )


def warm_up() -> None:
    """Import math-verify and sympy and exercise the parser once (a worker does this before it is ready)."""
    import logging

    for name in ("math_verify", "latex2sympy2_extended"):
        logging.getLogger(name).setLevel(logging.ERROR)
    check("\\frac{1}{2}", "0.5")
