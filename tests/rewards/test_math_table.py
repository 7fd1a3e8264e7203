"""The math equivalence table (our own cases, equal and not equal), checked in-process and through the real
MathVerifier process pool; both must agree with the table."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from agentrl.rewards import MathVerifier, Verdict, check_answer, is_equivalent

T, F = True, False

FRACTIONS_DECIMALS = [
    (r"\boxed{\frac{1}{2}}", "0.5", T),
    (r"\boxed{0.5}", r"\frac12", T),
    (r"\boxed{\dfrac{3}{4}}", "0.75", T),
    (r"\boxed{2/4}", r"\frac{1}{2}", T),
    (r"\boxed{0.33}", r"\frac{1}{3}", F),
    (r"\boxed{\frac{2}{3}}", r"\frac{3}{2}", F),
    (r"\boxed{-\frac{1}{2}}", "-0.5", T),
    (r"\boxed{1.50}", r"\frac{3}{2}", T),
    (r"\boxed{0.125}", r"\frac{1}{8}", T),
    (r"\boxed{7}", "7.0", T),
    (r"\boxed{-7}", "7", F),
    (r"\boxed{10^{3}}", "1000", T),
]
RADICALS = [
    (r"\boxed{2\sqrt{2}}", r"\sqrt{8}", T),
    (r"\boxed{\sqrt{12}}", r"2\sqrt{3}", T),
    (r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{1}{\sqrt{2}}", T),
    (r"\boxed{3\sqrt{2}}", r"2\sqrt{3}", F),
    (r"\boxed{\sqrt[3]{8}}", "2", T),
    (r"\boxed{\sqrt{2}}", "1.414", F),
]
POLYNOMIALS = [
    (r"\boxed{x^2+2x+1}", "(x+1)^2", T),
    (r"\boxed{(x-1)(x+1)}", "x^2-1", T),
    (r"\boxed{x^2+1}", "x^2-1", F),
    (r"\boxed{2x+3}", "3+2x", T),
    (r"\boxed{x^3 - 3x^2 + 3x - 1}", "(x-1)^3", T),
    (r"\boxed{y^2+1}", "x^2+1", F),
]
SETS = [
    (r"\boxed{\{1, 2, 3\}}", r"\{3, 2, 1\}", T),
    (r"\boxed{\{1, 2\}}", r"\{1, 2, 3\}", F),
    (r"\boxed{1, 2}", "2, 1", T),
    (r"\boxed{\{1,2\}}", "1, 2", T),
    (r"\boxed{\left\{\frac{1}{2}, 2\right\}}", r"\{2, 0.5\}", T),
    (r"\boxed{x=1, x=2}", "1, 2", T),
    (r"\boxed{\{1, 4\}}", r"\{1, 2\}", F),
]
INTERVALS = [
    (r"\boxed{[0, 1)}", "[0,1)", T),
    (r"\boxed{(0, 1]}", "[0,1)", F),
    (r"\boxed{(-\infty, 3]}", r"(-\infty,3]", T),
    (r"\boxed{(-\infty, 0) \cup (1, \infty)}", r"(-\infty,0)\cup(1,\infty)", T),
    (r"\boxed{(-\infty, 0) \cup (2, \infty)}", r"(-\infty,0)\cup(1,\infty)", F),
    (r"\boxed{[2, 5]}", "[2,6]", F),
    (r"\boxed{\left[ \frac{1}{2}, 3 \right)}", "[0.5, 3)", T),
]
TUPLES = [
    (r"\boxed{(1, 2)}", "(1,2)", T),
    (r"\boxed{(2, 1)}", "(1,2)", F),
    (r"\boxed{(1, 2, 3)}", "(1,2)", F),
    (r"\boxed{(\frac{1}{2}, -3)}", "(0.5, -3)", T),
    (r"\boxed{\{1, 2\}}", "(1,2)", F),
    (r"\boxed{(3, 1)}", "(5, 2)", F),
    (r"\boxed{1, 2}", "(1,2)", F),
]
UNITS = [
    (r"\boxed{1,000}", "1000", T),
    (r"\boxed{1{,}000{,}000}", "1000000", T),
    (r"\boxed{12\,345}", "12345", T),
    (r"\boxed{1,001}", "1000", F),
    (r"\boxed{30^\circ}", "30", T),
    (r"\boxed{45^{\circ}}", "45", T),
    (r"\boxed{30^\circ}", "60", F),
    (r"\boxed{5\text{ cm}}", "5", T),
    (r"\boxed{12 \text{ dollars}}", "12", T),
    (r"\boxed{\$42}", "42", T),
    ("So she has <answer>7 apples</answer>", "7", T),
    (r"\boxed{6 \text{ cm}^2}", r"6", T),
    (r"\boxed{5 cm}", "6", F),
    (r"\boxed{50\%}", "50", T),
]
CHOICES = [
    (r"\boxed{B}", "B", T),
    (r"\boxed{(C)}", "C", T),
    (r"\boxed{\text{(D)}}", "D", T),
    (r"\boxed{A}", "B", F),
    (r"\boxed{\textbf{(E)}\ 42}", "E", T),
    ("<answer>(A)</answer>", "(A)", T),
    (r"\boxed{b}", "B", F),
]
EXTRACTION = [
    (r"First \boxed{3}, then correcting myself: \boxed{4}", "4", T),
    (r"\boxed{4} ... on second thought \boxed{3}", "4", F),
    (r"\fbox{10}", "10", T),
    ("<answer>1</answer> no wait <answer>2</answer>", "2", T),
    (r"\boxed{2} and also <answer>3</answer>", "2", T),
    (r"\boxed{x = 5}", "5", T),
    (r"\boxed{\text{Monday}}", "Monday", T),
    (r"\boxed{yadnoM}", r"\text{Monday}", F),
    (r"\boxed{\infty}", r"\infty", T),
    (r"\boxed{2\pi}", r"\pi", F),
]
TEXT = [
    (r"\boxed{\text{on}}", r"\text{no}", F),  # math-verify alone reads both as the product n*o
    (r"\boxed{No}", r"\text{no}", T),
    (r"\boxed{\text{even}}", "even", T),
    (r"\boxed{xy}", "yx", T),  # unwrapped letters stay algebra
]
NO_ANSWER = [
    ("The answer is 42.", "42", F),
    ("", "1", F),
    (r"\boxed{}", "0", F),
    ("<answer></answer>", "0", F),
    ("<answer>5", "5", F),
]
MALFORMED = [
    (r"\boxed{\frac{1}{2}", r"\frac12", F),
    (r"<answer>\frac{4}{2</answer>", "2", F),
    (r"\boxed{)(}", "0", F),
    (r"\boxed{\sqrt{}}", "0", F),
    (r"\boxed{1 +* 2}", "3", F),
    (r"\boxed{\frac{1}{2}}}", r"\frac12", T),  # the box closed; a stray brace after it is not part of it
]

ALL = (
    FRACTIONS_DECIMALS
    + RADICALS
    + POLYNOMIALS
    + SETS
    + INTERVALS
    + TUPLES
    + UNITS
    + CHOICES
    + EXTRACTION
    + TEXT
    + NO_ANSWER
    + MALFORMED
)


def _id(case: tuple[str, str, bool]) -> str:
    response, reference, expected = case
    return f"{response[:40]}|{reference[:20]}|{'eq' if expected else 'ne'}"


def test_the_checker_scores_the_table_large_and_balanced_and_says_why() -> None:
    """Counted on what the checker answers, not on what the table expects: at least 25 cases scored and 25 not,
    every response without an answer refused as NO_ANSWER and the unclosed ones as MALFORMED (never merely
    NOT_EQUAL: the reason reaches the metrics)."""
    verdicts = Counter(check_answer(response, reference) for response, reference, _ in ALL)
    assert len(ALL) >= 60
    assert verdicts[Verdict.EQUAL] >= 25 and verdicts.total() - verdicts[Verdict.EQUAL] >= 25, verdicts
    assert [check_answer(response, reference) for response, reference, _ in NO_ANSWER] == [Verdict.NO_ANSWER] * 5
    assert [check_answer(response, reference) for response, reference, _ in MALFORMED[:3]] == [Verdict.MALFORMED] * 3


@pytest.mark.parametrize("case", ALL, ids=[_id(c) for c in ALL])
def test_in_process(case: tuple[str, str, bool]) -> None:
    response, reference, expected = case
    assert is_equivalent(response, reference) is expected


async def test_through_the_pool(verifier: MathVerifier) -> None:
    verdicts = await asyncio.gather(*(verifier.verify(response, reference) for response, reference, _ in ALL))
    wrong = [(case, v) for case, v in zip(ALL, verdicts) if (v is Verdict.EQUAL) != case[2]]
    assert wrong == []


@pytest.mark.parametrize(
    ("response", "verdict"),
    [
        ("The answer is 42.", Verdict.NO_ANSWER),
        (r"\boxed{}", Verdict.NO_ANSWER),
        (r"so \boxed{\frac{1}{2}", Verdict.MALFORMED),
        (r"<answer>\frac{4}{2</answer>", Verdict.MALFORMED),
        (r"\boxed{" + "1" * 5000 + "}", Verdict.TOO_LONG),
        (r"\boxed{3}", Verdict.NOT_EQUAL),
        (r"\boxed{2}", Verdict.EQUAL),
    ],
)
async def test_verdicts_say_why(verifier: MathVerifier, response: str, verdict: Verdict) -> None:
    assert check_answer(response, "2") is verdict
    assert await verifier.verify(response, "2") is verdict
