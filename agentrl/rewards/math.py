"""Verified math answers: extract the final answer from a response and check it against the reference.

- :func:`extract_answer`: the LAST ``\\boxed{…}`` / ``\\fbox{…}`` with balanced braces, else the content of
  the last ``<answer>…</answer>``.
- :func:`is_equivalent`: in-process check (math-verify's LaTeX parser plus our rules for thousands separators,
  degrees, simple units, choice letters, sets, intervals and ordered tuples; see ``_equivalence``). Bounded by
  a SIGALRM soft deadline when called from the main thread only.
- :class:`MathReward`: the reward function; it checks through a :class:`MathVerifier` process pool, where
  every check is bounded in time even on adversarial input, and the event loop never blocks.
"""

from __future__ import annotations

from typing import Self

from agentrl.errors import ConfigError, InfrastructureError
from agentrl.rewards import _equivalence as eq
from agentrl.rewards._normalize import extract_answer
from agentrl.rewards.base import RewardInput, RewardResult
from agentrl.rewards.verifier import MathVerifier
from agentrl.types import Task

Verdict = eq.Verdict

__all__ = ["MathReward", "Verdict", "check_answer", "extract_answer", "is_equivalent"]


def check_answer(response_text: str, reference: str, *, timeout_s: float = 5.0) -> Verdict:
    """Verdict for a whole model response against a reference, computed in this process.

    Time bound: a SIGALRM deadline of ``timeout_s`` when called from the main thread; none elsewhere (and none
    for code stuck in C). Where a hard bound matters (training, evaluation), use :class:`MathVerifier`.
    """
    answer = extract_answer(response_text)
    if answer is None:
        return eq.no_answer_verdict(response_text)
    try:
        with eq.soft_deadline(timeout_s):
            return eq.check(answer, reference)
    except eq.CheckTimeout:
        return Verdict.TIMEOUT
    except (RecursionError, MemoryError):
        return Verdict.MALFORMED


def is_equivalent(response_text: str, reference: str, *, timeout_s: float = 5.0) -> bool:
    """True iff the final answer in ``response_text`` equals ``reference`` (see :func:`check_answer`)."""
    return check_answer(response_text, reference, timeout_s=timeout_s) is Verdict.EQUAL


class MathReward:
    """1.0 if the response's final answer equals ``task.answer``, else 0.0; INFRA_ERROR if the checker failed.

    ``verifier`` is shared and owned by the caller; without one, the reward starts its own (closed by
    ``aclose``). ``details``: ``verdict`` and the extracted ``answer`` (cut to 200 characters).
    """

    def __init__(self, verifier: MathVerifier | None = None, **verifier_options: object) -> None:
        if verifier is not None and verifier_options:
            raise ConfigError("pass either a MathVerifier or options to build one, not both")
        self._owned = verifier is None
        self._verifier = verifier or MathVerifier(**verifier_options)  # type: ignore[arg-type]

    async def __call__(self, task: Task, response: RewardInput, /) -> RewardResult:
        if task.answer is None:
            raise ConfigError(f"task {task.id!r} has no reference answer; the math reward needs Task.answer")
        answer = extract_answer(response.text)
        try:
            if answer is None:
                verdict = eq.no_answer_verdict(response.text)
            else:
                verdict = await self._verifier.check(answer, task.answer)
        except InfrastructureError as exc:
            return RewardResult.infra_error(str(exc))
        return RewardResult.scored(
            1.0 if verdict is Verdict.EQUAL else 0.0,
            verdict=verdict.value,
            answer=None if answer is None else answer[:200],
        )

    async def aclose(self) -> None:
        if self._owned:
            await self._verifier.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
