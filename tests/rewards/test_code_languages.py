"""Compile-and-test rewards in every sandbox language and in the public datasets' test formats, on the real local
sandbox: known-good solutions score 1, known-bad ones score what they earn, the program is compiled once per
response, an unreachable sandbox is an infrastructure error (no score)."""

from __future__ import annotations

import base64
import json
import math
import pickle
import shutil
import zlib
from typing import Any

import pytest

from agentrl.errors import ConfigError
from agentrl.rewards import CodeTestsReward, RewardInput, RewardStatus, outputs_match, parse_tests, returns_match
from agentrl.sandbox.base import Limits, RunRequest, RunResult
from agentrl.sandbox.languages import LANGUAGE_TABLE
from agentrl.sandbox.remote import RemoteSandbox
from agentrl.types import Task

LIMITS = Limits(time_s=3.0, compile_time_s=60.0)


def installed(language: str) -> object:
    lang = LANGUAGE_TABLE[language]
    missing = [t for t in lang.tools if shutil.which(t, path="/usr/bin:/bin") is None]
    why = f"{language}: `{missing[0]}` is not installed (Debian package {lang.package})" if missing else ""
    return pytest.param(language, marks=pytest.mark.skipif(bool(missing), reason=why))


# sum of two integers per line pair: "a b" -> a + b; the bad one subtracts when b is negative
SUM = {
    "python": ("a, b = map(int, input().split())\nprint(a + b)",
               "a, b = map(int, input().split())\nprint(a + b if b >= 0 else a - b)"),
    "cpp": ("#include <iostream>\nint main() { long a, b; std::cin >> a >> b; std::cout << a + b << std::endl; }",
            "#include <iostream>\nint main() { long a, b; std::cin >> a >> b; std::cout << (b >= 0 ? a + b : a - b); }"),
    "c": ('#include <stdio.h>\nint main(void) { long a, b; scanf("%ld %ld", &a, &b); printf("%ld\\n", a + b); }',
          '#include <stdio.h>\nint main(void) { long a, b; scanf("%ld %ld", &a, &b); printf("%ld\\n", b >= 0 ? a + b : a - b); }'),
    "java": ("import java.util.*;\npublic class Main { public static void main(String[] x) { Scanner s = new Scanner(System.in);"
             " long a = s.nextLong(), b = s.nextLong(); System.out.println(a + b); } }",
             "import java.util.*;\npublic class Main { public static void main(String[] x) { Scanner s = new Scanner(System.in);"
             " long a = s.nextLong(), b = s.nextLong(); System.out.println(b >= 0 ? a + b : a - b); } }"),
    "go": ('package main\nimport "fmt"\nfunc main() { var a, b int64; fmt.Scan(&a, &b); fmt.Println(a + b) }',
           'package main\nimport "fmt"\nfunc main() { var a, b int64; fmt.Scan(&a, &b); if b < 0 { b = -b }; fmt.Println(a + b) }'),
    "rust": ("use std::io::Read;\nfn main() { let mut s = String::new(); std::io::stdin().read_to_string(&mut s).unwrap();"
             " let v: Vec<i64> = s.split_whitespace().map(|t| t.parse().unwrap()).collect(); println!(\"{}\", v[0] + v[1]); }",
             "use std::io::Read;\nfn main() { let mut s = String::new(); std::io::stdin().read_to_string(&mut s).unwrap();"
             " let v: Vec<i64> = s.split_whitespace().map(|t| t.parse().unwrap()).collect(); println!(\"{}\", v[0] + v[1].abs()); }"),
    "nodejs": ("const [a, b] = require('fs').readFileSync(0, 'utf8').trim().split(/\\s+/).map(Number); console.log(a + b);",
               "const [a, b] = require('fs').readFileSync(0, 'utf8').trim().split(/\\s+/).map(Number); console.log(a + Math.abs(b));"),
    "typescript": ("const [a, b]: number[] = require('fs').readFileSync(0, 'utf8').trim().split(/\\s+/).map(Number);\n"
                   "console.log(a + b);",
                   "const [a, b]: number[] = require('fs').readFileSync(0, 'utf8').trim().split(/\\s+/).map(Number);\n"
                   "console.log(a + Math.abs(b));"),
}
CASES = {"inputs": ["2 3\n", "10 -4\n", "0 0\n", "7 8\n"], "outputs": ["5\n", "6\n", "0\n", "15\n"]}
FENCE = {"python": "python", "cpp": "cpp", "c": "c", "java": "java", "go": "go", "rust": "rust", "nodejs": "javascript",
         "typescript": "typescript"}


class Counting:
    """The real sandbox, counting requests (to see that a program is compiled once, not once per test)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.requests = inner, []

    async def run(self, request: RunRequest) -> RunResult:
        self.requests.append(request)
        return await self.inner.run(request)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def answer(language: str, code: str) -> RewardInput:
    return RewardInput(text=f"My solution:\n```{FENCE[language]}\n{code}\n```\n")


def task(metadata: dict[str, Any]) -> Task:
    return Task(id="t", prompt="?", metadata=metadata)


@pytest.mark.parametrize("language", [installed(name) for name in SUM])
async def test_stdio_tests_in_every_language(local_sandbox: object, language: str) -> None:
    """verl's code parquet: the tests are reward_model.ground_truth, a JSON string; the language is told by the
    answer's fence. Good scores 1, bad 3/4; one sandbox request (one compile) per answer."""
    sandbox = Counting(local_sandbox)
    reward = CodeTestsReward(sandbox, limits=LIMITS)  # type: ignore[arg-type]
    row = task({"reward_model": {"ground_truth": json.dumps(CASES), "style": "rule"}})
    good, bad = SUM[language]
    right = await reward(row, answer(language, good))
    assert (right.status, right.score, right.details["language"]) == (RewardStatus.OK, 1.0, language), right
    wrong = await reward(row, answer(language, bad))
    assert wrong.ok and wrong.score == pytest.approx(0.75), wrong
    assert [t["status"] for t in wrong.details["tests"]] == ["passed", "wrong_answer", "passed", "passed"]
    assert [len(r.cases) for r in sandbox.requests] == [4, 4]


@pytest.mark.parametrize("language", [installed("cpp"), installed("java")])
async def test_a_program_that_does_not_compile_scores_zero(local_sandbox: object, language: str) -> None:
    reward = CodeTestsReward(local_sandbox, limits=LIMITS, language=language)  # type: ignore[arg-type]
    result = await reward(task({"tests": CASES}), answer(language, "this is not a program"))
    assert result.ok and result.score == 0.0, result
    assert {t["status"] for t in result.details["tests"]} == {"compile_error"}
    assert result.details["tests"][0]["message"]  # the compiler's diagnostics


async def test_per_test_and_total_time_limits(local_sandbox: object) -> None:
    slow_on_zero = ("#include <iostream>\n#include <chrono>\n#include <thread>\nint main() { long a, b; std::cin >> a >> b;"
                    " if (a == 0) std::this_thread::sleep_for(std::chrono::seconds(30));"
                    " std::cout << a + b << std::endl; }")
    per_test = CodeTestsReward(local_sandbox, limits=Limits(time_s=1.0, compile_time_s=60))  # type: ignore[arg-type]
    result = await per_test(task({"tests": CASES}), answer("cpp", slow_on_zero))
    assert [t["status"] for t in result.details["tests"]] == ["passed", "passed", "time_limit_exceeded", "passed"]
    total = CodeTestsReward(local_sandbox, limits=Limits(time_s=5.0, compile_time_s=60),  # type: ignore[arg-type]
                            total_time_s=1.0)  # the third test's sleep uses up the total: the fourth never runs
    result = await total(task({"tests": CASES}), answer("cpp", slow_on_zero))
    statuses = [t["status"] for t in result.details["tests"]]
    assert statuses[:3] == ["passed", "passed", "time_limit_exceeded"] and statuses[3] == "time_limit_exceeded"
    assert "total time limit" in result.details["tests"][3]["message"]


async def test_taco_function_call_tests(local_sandbox: object) -> None:
    """TACO/APPS call-based rows: fn_name, inputs as argument lists, outputs as the value or a list holding it."""
    tests = json.dumps({"fn_name": "pairs", "inputs": [[[1, 2, 3], 4], [[5], 5], [[], 0]],
                        "outputs": [[[[1, 3]]], [[]], []]})
    reward = CodeTestsReward(local_sandbox, limits=LIMITS)  # type: ignore[arg-type]
    good = ("def pairs(xs, t):\n    return [(a, b) for i, a in enumerate(xs) for b in xs[i + 1:] if a + b == t]\n"
            "if __name__ == '__main__':\n    print(pairs([1], 1))")
    right = await reward(task({"tests": tests}), answer("python", good))
    assert right.ok and right.score == 1.0, right
    bad = "def pairs(xs, t):\n    return [[xs[0], xs[-1]]] if xs else []"
    wrong = await reward(task({"tests": tests}), answer("python", bad))
    assert [t["status"] for t in wrong.details["tests"]] == ["passed", "wrong_answer", "passed"], wrong
    missing = await reward(task({"tests": tests}), answer("python", "def other(): pass"))
    assert missing.ok and missing.score == 0.0 and "no function 'pairs'" in missing.details["tests"][0]["message"]
    in_cpp = await reward(task({"tests": tests}), answer("cpp", "int main() {}"))
    assert in_cpp.ok and in_cpp.score == 0.0, in_cpp  # call tests need Python: the model's mistake, not ours


def lcb_private(cases: list[dict[str, str]]) -> str:
    """LiveCodeBench's private_test_cases encoding."""
    return base64.b64encode(zlib.compress(pickle.dumps(json.dumps(cases)))).decode()


async def test_livecodebench_stdin_rows(local_sandbox: object) -> None:
    row = {"public_test_cases": json.dumps([{"input": "2 3\n", "output": "5\n", "testtype": "stdin"}]),
           "private_test_cases": lcb_private([{"input": "10 -4\n", "output": "6\n", "testtype": "stdin"},
                                              {"input": "7 8\n", "output": "15\n", "testtype": "stdin"}]),
           "metadata": "{}"}
    reward = CodeTestsReward(local_sandbox, limits=LIMITS)  # type: ignore[arg-type]
    right = await reward(task(row), answer("cpp", SUM["cpp"][0]))
    assert right.ok and (right.score, right.details["total"]) == (1.0, 3), right
    wrong = await reward(task(row), answer("cpp", SUM["cpp"][1]))
    assert wrong.ok and wrong.score == pytest.approx(2 / 3), wrong


async def test_livecodebench_functional_rows(local_sandbox: object) -> None:
    row = {"public_test_cases": json.dumps([{"input": "[2, 7, 11, 15]\n9", "output": "[0, 1]", "testtype": "functional"},
                                            {"input": "[3, 3]\n6", "output": "[0, 1]", "testtype": "functional"}]),
           "private_test_cases": lcb_private([{"input": "[1, 5, 2]\n7", "output": "[1, 2]", "testtype": "functional"}]),
           "metadata": json.dumps({"func_name": "twoSum"})}
    good = ("from typing import List\nclass Solution:\n    def twoSum(self, nums: List[int], target: int) -> List[int]:\n"
            "        seen = {}\n        for i, x in enumerate(nums):\n            if target - x in seen:\n"
            "                return [seen[target - x], i]\n            seen[x] = i\n")
    bad = "class Solution:\n    def twoSum(self, nums, target):\n        return [0, 1]\n"
    reward = CodeTestsReward(local_sandbox, limits=LIMITS)  # type: ignore[arg-type]
    right = await reward(task(row), answer("python", good))
    assert right.ok and right.score == 1.0, right
    wrong = await reward(task(row), answer("python", bad))
    assert [t["status"] for t in wrong.details["tests"]] == ["passed", "passed", "wrong_answer"], wrong


def test_livecodebench_private_cases_cannot_smuggle_objects() -> None:
    class Evil:
        def __reduce__(self) -> tuple[Any, ...]:
            return (print, ("pwned",))

    row = {"private_test_cases": base64.b64encode(zlib.compress(pickle.dumps(Evil()))).decode()}
    with pytest.raises(ConfigError, match="only plain data"):
        parse_tests(row)


async def test_unreachable_sandbox_is_an_infrastructure_error() -> None:
    async with RemoteSandbox("http://127.0.0.1:9", retries=1, backoff_s=0.01) as remote:
        reward = CodeTestsReward(remote, limits=LIMITS)
        result = await reward(task({"tests": CASES}), answer("cpp", SUM["cpp"][0]))
    assert result.status is RewardStatus.INFRA_ERROR and math.isnan(result.score), result
    assert "cannot connect" in result.details["error"]


async def test_a_missing_toolchain_is_an_infrastructure_error(local_sandbox: object,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from agentrl.sandbox import languages

    table = dict(languages.LANGUAGE_TABLE)
    table["rust"] = languages.Language("rust", "rustc", "main.rs", ("./main",), ("rustc-not-here",),
                                       tools=("rustc-not-here",))
    monkeypatch.setattr("agentrl.sandbox._wire.LANGUAGE_TABLE", table)
    monkeypatch.setattr("agentrl.sandbox._core.LANGUAGE_TABLE", table)
    reward = CodeTestsReward(local_sandbox, limits=LIMITS)  # type: ignore[arg-type]
    result = await reward(task({"tests": CASES}), answer("rust", SUM["rust"][0]))
    assert result.status is RewardStatus.INFRA_ERROR and "rustc" in result.details["error"], result


def test_bad_language_and_options_are_config_errors(local_sandbox: object) -> None:
    with pytest.raises(ConfigError, match="cobol"):
        CodeTestsReward(local_sandbox, language="cobol")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="compare"):
        CodeTestsReward(local_sandbox, compare="fuzzy")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="no metadata"):
        CodeTestsReward(local_sandbox).tests_of(task({}))  # type: ignore[arg-type]


@pytest.mark.parametrize(("got", "expected", "mode", "match"), [
    ("5\n", "5", "exact", True),
    ("5 \n", "5", "exact", False),
    ("1  2\n3", "1 2 3", "exact", False),
    ("1  2\n3", "1 2 3", "whitespace", True),
    ("0.3333333", "0.333333", "whitespace", False),
    ("0.3333333", "0.333333", "float", True),
    ("0.34", "0.333333", "float", False),
    ("1 2\n", "1 2 3", "float", False),
    ("nan", "1.0", "float", False),
])
def test_comparison_modes(got: str, expected: str, mode: str, match: bool) -> None:
    assert outputs_match(got, expected, 1e-6, mode) is match  # type: ignore[arg-type]


@pytest.mark.parametrize(("got", "expected", "match"), [
    ([0, 1], [0, 1], True), ([0, 1], [[0, 1]], True), (3, [3], True), (0.1 + 0.2, 0.3, True),
    (1, True, False), ([1, 2], [2, 1], False), ({"a": 1}, {"a": 1}, True), (None, [], False),
])
def test_return_values_compare_as_json(got: object, expected: object, match: bool) -> None:
    assert returns_match(got, expected) is match


def test_a_dataset_mixing_formats_finds_each_rows_tests(local_sandbox: object) -> None:
    """A jsonl mixing TACO and LiveCodeBench rows has every column in every row, null where a row has none: a null
    column counts as absent (TACO's `input_output` by tests_key, then LiveCodeBench's columns, then verl's)."""
    lcb = {"public_test_cases": json.dumps([{"input": "2 3\n", "output": "5\n", "testtype": "stdin"}]),
           "private_test_cases": None, "metadata": "{}"}
    taco = {"input_output": json.dumps(CASES)}
    verl = {"reward_model": {"ground_truth": json.dumps(CASES)}}
    nulls = dict.fromkeys(["input_output", "public_test_cases", "private_test_cases", "metadata", "reward_model"])
    reward = CodeTestsReward(local_sandbox, tests_key="input_output")  # type: ignore[arg-type]
    assert len(reward.tests_of(task({**nulls, **taco}))) == 4
    assert reward.tests_of(task({**nulls, **lcb})) == parse_tests(lcb)
    assert len(reward.tests_of(task({**nulls, **verl}))) == 4
    with pytest.raises(ConfigError, match="no metadata\\['input_output'\\]"):
        reward.tests_of(task(nulls))
