"""Verifiable arithmetic word problems for the CPU demo, in families of wordings.

- ``sft``: the wordings cold-start SFT traces are built from;
- ``rl``: a wider family the RL prompts come from (includes ``sft``'s and new ones);
- ``heldout``: wordings that never appear in SFT traces, for the held-out accuracy.

Each template pairs a wording with the Python expression that solves it, so a trace can show the code.
Everything is seeded: the same seed gives the same problems.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from dataclasses import dataclass

from agentrl.retool_format import format_interpreter
from agentrl.types import Task


@dataclass(frozen=True, slots=True)
class Template:
    text: str  # with {a}, {b}, {c}
    expr: str  # a Python expression over a, b, c


SFT_TEMPLATES = (
    Template("What is {a} * {b} + {c}?", "{a} * {b} + {c}"),
    Template("Compute {a} times {b}, then add {c}.", "{a} * {b} + {c}"),
    Template("A shop has {a} boxes with {b} apples each and {c} loose apples. How many apples in total?",
             "{a} * {b} + {c}"),
    Template("What is {a} * {b} - {c}?", "{a} * {b} - {c}"),
    Template("A farmer plants {a} rows of {b} trees, then {c} trees die. How many trees are left?",
             "{a} * {b} - {c}"),
    Template("What is ({a} + {b}) * {c}?", "({a} + {b}) * {c}"),
    Template("What is {c} * ({a} + {b})?", "{c} * ({a} + {b})"),
    # Word problems whose answer takes parentheses, one story and one phrase: with only the two symbolic ones above,
    # SFT taught "words -> a * b +- c" and the demo's RL start wrote a right answer to the RL set's parenthesis
    # wordings in 2-3 % of its samples at T 1.3 (seeds 0-2), too rare for RL to find reliably (1 of 3 seeds reached
    # 0.9 held out). With these two: 15 % (seed 1), held-out after SFT unchanged (0.75; docs/results.md, issue 24).
    Template("A zoo has {c} pens, each with {a} goats and {b} sheep. How many animals are in the zoo?",
             "{c} * ({a} + {b})"),
    Template("Compute the sum of {a} and {b}, then multiply it by {c}.", "({a} + {b}) * {c}"),
)

NEW_TEMPLATES = (
    Template("Each of {a} students brings {b} pencils, and the teacher adds {c} more. How many pencils are there?",
             "{a} * {b} + {c}"),
    Template("Find the value of {c} + {a} * {b}.", "{c} + {a} * {b}"),
    Template("A library gets {a} crates of {b} books and gives away {c} books. How many books does it gain?",
             "{a} * {b} - {c}"),
    Template("Add {a} and {b}, and multiply the sum by {c}. What do you get?", "({a} + {b}) * {c}"),
    Template("There are {c} bags with {a} red and {b} blue marbles in each. How many marbles are there?",
             "({a} + {b}) * {c}"),
    Template("Subtract {c} from the product of {a} and {b}.", "{a} * {b} - {c}"),
    Template("Multiply {c} by the sum of {a} and {b}.", "{c} * ({a} + {b})"),
    Template("A club has {c} teams, each with {a} players and {b} coaches. How many people are in the club?",
             "{c} * ({a} + {b})"),
    # Story wordings whose answer takes no parentheses, as many as the (a + b) * c ones: with only half of them,
    # RL learned to put parentheses into every story problem ("a trays of b, eats c" -> a * (b + c)).
    Template("A truck delivers {a} pallets of {b} bottles and {c} single bottles. How many bottles arrive?",
             "{a} * {b} + {c}"),
    Template("A school buys {a} packs of {b} pens and {c} pens break. How many pens still work?",
             "{a} * {b} - {c}"),
)

# A plain phrase wording that begins "Multiply a by b", the contrast to NEW_TEMPLATES' "Multiply c by the sum of a and
# b": without it every RL phrase wording that begins "Multiply" takes parentheses, and on the AMX Xeon (bf16) seed 2
# learned "Multiply ... -> parentheses" and wrote (a) * (b + c) for the held-out "Multiply a by b and then increase the
# result by c" (9/10 -> 2/10 from v15; docs/results.md, issue 24). Its operation (minus) and its "then take away"
# differ from the held-out wording's.
CONTRAST_TEMPLATES = (
    Template("Multiply {a} by {b}, then take {c} away.", "{a} * {b} - {c}"),
)

# A phrase wording that names c before "the sum of a and b", for SFT: after the demo's SFT (``sft``, 4 steps) the policy
# wrote a right answer to the RL wordings that name c first ("Multiply c by the sum of a and b", the club, the bags)
# in 0.7 % of its samples at T 1.3 (seeds 1 and 2 alike; 48 samples a wording), so RL found them only by luck: on the
# AMX Xeon seed 1 learnt them, seed 2 never did (held-out "c times the sum" 0/10). With it and the parenthesis wordings
# twice (``sft_paren``): "Multiply c by the sum" 0.79, the c-first wordings 0.35 (seed 2; docs/results.md, issue 24).
CFIRST_SUM_TEMPLATES = (
    Template("What is the product of {c} and the sum of {a} and {b}?", "{c} * ({a} + {b})"),
)

HELDOUT_TEMPLATES = (
    Template("A baker makes {a} trays of {b} cookies and eats {c} of them. How many cookies remain?",
             "{a} * {b} - {c}"),
    Template("Multiply {a} by {b} and then increase the result by {c}.", "{a} * {b} + {c}"),
    Template("A bus carries {a} passengers on each of {b} trips, plus {c} on a final trip. "
             "How many passengers in all?", "{a} * {b} + {c}"),
    Template("What number is {c} times the sum of {a} and {b}?", "({a} + {b}) * {c}"),
)


def _weighted(templates: tuple[Template, ...], *, paren: int, plain: int) -> tuple[Template, ...]:
    """Each wording whose answer takes parentheses ``paren`` times, each other one ``plain`` times (a stream draws
    each entry once per block of ``len(result)`` tasks)."""
    return tuple(t for t in templates for _ in range(paren if "(" in t.expr else plain))


FAMILIES: dict[str, tuple[Template, ...]] = {
    "sft": SFT_TEMPLATES,
    # ``sft`` plus the c-first sum phrase, each wording whose answer takes parentheses twice (5 x 2, 5 x 1 a block)
    "sft_paren": _weighted(SFT_TEMPLATES + CFIRST_SUM_TEMPLATES, paren=2, plain=1),
    "rl": SFT_TEMPLATES + NEW_TEMPLATES,
    "new": NEW_TEMPLATES,
    # ``new`` with as many parenthesis tasks as others (4 wordings x 3, 6 x 2 in each block of 24), for RL
    "new_balanced": _weighted(NEW_TEMPLATES, paren=3, plain=2),
    # ``new_balanced`` with the contrast wording (4 x 3 parenthesis tasks, 7 x 2 others in each block of 26)
    "new_contrast": _weighted(NEW_TEMPLATES + CONTRAST_TEMPLATES, paren=3, plain=2),
    "heldout": HELDOUT_TEMPLATES,
}


@dataclass(frozen=True, slots=True)
class Problem:
    task: Task
    expr: str  # the concrete Python expression, e.g. "17 * 23 + 5"


def make_problem(template: Template, rng: random.Random, *, index: int, family: str) -> Problem:
    a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(1, 99)
    expr = template.expr.format(a=a, b=b, c=c)
    answer = eval(expr, {"__builtins__": {}})  # our own template arithmetic, never model text
    return Problem(Task(id=f"{family}-{index}", prompt=template.text.format(a=a, b=b, c=c), answer=str(answer),
                        metadata={"family": family, "expr": expr, "template": template.text}), expr)


def template_of(prompt: str, templates: tuple[Template, ...]) -> Template | None:
    """The template a prompt was made from (None if none matches)."""
    for t in templates:
        pattern = re.escape(t.text)
        for name in ("a", "b", "c"):
            pattern = pattern.replace(re.escape("{" + name + "}"), r"\d+")
        if re.fullmatch(pattern, prompt):
            return t
    return None


def _family(family: str) -> tuple[Template, ...]:
    if family not in FAMILIES:
        raise ValueError(f"unknown problem family {family!r}; expected one of {sorted(FAMILIES)}")
    return FAMILIES[family]


def problems(family: str, n: int, *, seed: int = 0) -> list[Problem]:
    """``n`` problems of a family, deterministic in ``seed``."""
    rng = random.Random(f"{family}:{seed}")
    templates = _family(family)
    return [make_problem(templates[i % len(templates)], rng, index=i, family=family) for i in range(n)]


def task_stream(family: str, *, seed: int = 0) -> Iterator[Task]:
    """An endless, seeded stream of tasks of a family (for RL prompts), stratified: every run of
    ``len(templates)`` tasks uses each wording once, in a fresh random order. An RL step's few groups then come
    from different wordings, not by chance from three of one kind (e.g. all "minus" stories, which teaches the
    policy "minus" rather than reading the wording)."""
    rng = random.Random(f"stream:{family}:{seed}")
    templates = list(_family(family))
    i = 0
    while True:
        rng.shuffle(templates)
        for template in templates:
            yield make_problem(template, rng, index=i, family=family).task
            i += 1


def retool_trace_parts(problem: Problem, interpreter_output: str | None = None) -> list[tuple[str, bool]]:
    """A ReTool-style solution as (text, is_model) parts: model text, interpreter observation, model text.

    The observation text is exactly what the ReTool environment appends at rollout time, and the parts are
    tokenised separately, so SFT and RL see identical token boundaries.
    """
    answer = problem.task.answer
    output = interpreter_output if interpreter_output is not None else str(answer)
    return [
        (f"Let me compute this with Python.\n<code>\nprint({problem.expr})\n</code>", True),
        (format_interpreter(output), False),
        (f"The answer is \\boxed{{{answer}}}.", True),
    ]
