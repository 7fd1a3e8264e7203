"""Reward throughput: math checks through the MathVerifier pool, code tests through the local sandbox.

Math: a mix of typical answers (integers, fractions vs decimals, radicals, polynomials, tuples, sets, units),
each varied so caches do not make it free; half equal, half not. Code: one stdin/stdout test per run of a
small correct program. Each is timed after an untimed warm-up (one check; two tests), as rates: there is no floor
to compare with here (the in-process math rate is printed for reference: it has no hard time bound, which is what
the pool adds). Prints a table, then the last line ``math_checks_per_s=… code_tests_per_s=… cpu=… cores=…
commit=… math-verify=…`` (benchmarks/_common.py).

Usage: .venv/bin/python benchmarks/reward_bench.py [--math-checks 400] [--code-tests 64] [--workers 2] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

from _common import environment, last_line  # this folder's

from agentrl.rewards import CodeTestsReward, MathVerifier, RewardInput, Verdict, check_answer
from agentrl.sandbox.base import Limits
from agentrl.types import Task


def math_cases(n: int, seed: int = 0) -> list[tuple[str, str, bool]]:
    rng = random.Random(seed)
    makers = [
        lambda a, b: (rf"\boxed{{{a * b}}}", str(a * b)),
        lambda a, b: (rf"\boxed{{\frac{{{a}}}{{{2 * b}}}}}", str(a / (2 * b))),
        lambda a, b: (rf"\boxed{{{a}\sqrt{{{b * b * 2}}}}}", rf"{a * b}\sqrt{{2}}"),
        lambda a, b: (rf"\boxed{{(x+{a})(x+{b})}}", f"x^2+{a + b}x+{a * b}"),
        lambda a, b: (rf"\boxed{{({a}, {b})}}", f"({a},{b})"),
        lambda a, b: (rf"\boxed{{\{{{a}, {b}\}}}}", rf"\{{{b}, {a}\}}"),
        lambda a, b: (rf"\boxed{{{a * 1000:,} \text{{ cm}}}}", str(a * 1000)),
    ]
    cases = []
    for i in range(n):
        a, b = rng.randint(1, 99), rng.randint(1, 99)
        equal = i % 2 == 0
        response, _ = makers[i % len(makers)](a, b)
        _, reference = makers[i % len(makers)](a if equal else a + 1, b)
        cases.append((f"Let me think. {response}", reference, equal))
    return cases


async def bench_math(n: int, workers: int) -> tuple[float, float, int]:
    cases = math_cases(n)
    async with MathVerifier(workers=workers, max_pending=4 * workers) as pool:
        await pool.verify(r"\boxed{1}", "1")
        start = time.perf_counter()
        verdicts = await asyncio.gather(*(pool.verify(r, ref) for r, ref, _ in cases))
        elapsed = time.perf_counter() - start
    wrong = sum((v is Verdict.EQUAL) != eq for v, (_, _, eq) in zip(verdicts, cases))
    start = time.perf_counter()
    for response, reference, _ in cases[: n // 4]:
        check_answer(response, reference)
    in_process = (n // 4) / (time.perf_counter() - start)
    return n / elapsed, in_process, wrong


async def bench_code(n: int, concurrency: int) -> tuple[float, int] | None:
    try:
        from agentrl.sandbox.local import LocalSandbox
    except ImportError as exc:
        print(f"(code benchmark skipped: {exc})")
        return None
    tests = [{"stdin": f"{i} {i + 1}\n", "expected_stdout": f"{2 * i + 1}\n"} for i in range(n)]
    task = Task(id="add", prompt="", metadata={"tests": tests})
    response = RewardInput(text="```python\na, b = map(int, input().split())\nprint(a + b)\n```")
    async with LocalSandbox(max_concurrency=concurrency) as sandbox:
        reward = CodeTestsReward(sandbox, limits=Limits(time_s=5.0), max_concurrency=concurrency)
        await reward(Task(id="warm", prompt="", metadata={"tests": tests[:2]}), response)
        start = time.perf_counter()
        result = await reward(task, response)
        elapsed = time.perf_counter() - start
    return n / elapsed, int(result.details.get("passed", 0))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--math-checks", type=int, default=400)
    parser.add_argument("--code-tests", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--code-concurrency", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="a check that the script runs: 40 checks, 8 tests")
    args = parser.parse_args()
    if args.quick:
        args.math_checks, args.code_tests = 40, 8
    env = environment(packages=("math-verify", "sympy"))

    math_rate, in_process_rate, wrong = asyncio.run(bench_math(args.math_checks, args.workers))
    code = asyncio.run(bench_code(args.code_tests, args.code_concurrency))
    print(f"{'what':44} {'rate':>12}  notes")
    print(
        f"{'math checks, pool of ' + str(args.workers) + ' workers':44} {math_rate:10.1f}/s  "
        f"{args.math_checks} checks, {wrong} disagree with the expected verdict"
    )
    print(f"{'math checks, in-process (reference)':44} {in_process_rate:10.1f}/s  no hard time bound")
    if code is not None:
        print(
            f"{'code tests, local sandbox':44} {code[0]:10.1f}/s  "
            f"{code[1]}/{args.code_tests} passed, concurrency {args.code_concurrency}"
        )
    print(last_line({"math_checks_per_s": math_rate, "code_tests_per_s": code[0] if code is not None else float("nan"),
                     "math_in_process_per_s": in_process_rate, "math_wrong_verdicts": wrong,
                     "workers": args.workers, "code_concurrency": args.code_concurrency}, env))


if __name__ == "__main__":
    main()
