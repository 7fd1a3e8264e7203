"""examples/code_rl_cpu.yaml: its four problems (Python and C++, in TACO and LiveCodeBench rows) scored by real
compile-and-test in the local sandbox, and the recipe trained for one RL step on the tiny model (the session's SGLang
server) with every answer constrained by a grammar to programs we know, so each trajectory's reward is known: a
problem's own solution scores 1, a compile error 0, another problem's solution less than 1."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from agentrl.data.loader import load_task_file
from agentrl.env.registry import EnvResources, default_registry
from agentrl.launcher.config import load_config
from agentrl.rewards import RewardInput
from agentrl.rewards._code_tests import find_program

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "examples" / "code_rl_cpu.yaml"

GOOD = {  # no double quotes or backslashes: each is also a literal of the grammar below
    "py-sum": "import sys\nprint(sum(map(int, sys.stdin.read().split())))",
    "py-reverse-words": "def reverse_words(s):\n    return ' '.join(s.split()[::-1])",
    "cpp-max": "#include <iostream>\nint main() { long n, x, m = -2000000000; std::cin >> n;"
               " for (long i = 0; i < n; i++) { std::cin >> x; if (x > m) m = x; } std::cout << m << std::endl; }",
    "cpp-product": "#include <iostream>\nint main() { long long a, b; std::cin >> a >> b;"
                   " std::cout << a * b << std::endl; }",
}
BROKEN = {"python": "def solve(:\n    pass", "cpp": "#include <iostream>\nint main() { std::cout << undeclared; }"}
FENCE = {"python": "python", "cpp": "cpp"}


def language(task_id: str) -> str:
    return "python" if task_id.startswith("py-") else "cpp"


def answer(lang: str, program: str) -> str:
    return f"```{FENCE[lang]}\n{program}\n```"


def grammar() -> str:
    """Answers of a Python fence then a C++ fence, each holding one of the known programs of its language (an
    EBNF string literal is a JSON string literal)."""
    def choices(lang: str) -> str:
        programs = [p for tid, p in GOOD.items() if language(tid) == lang] + [BROKEN[lang]]
        return " | ".join(json.dumps(p) for p in programs)

    return (f'root ::= "```python\\n" py "\\n```\\n```cpp\\n" cpp "\\n```"\n'
            f"py ::= {choices('python')}\ncpp ::= {choices('cpp')}\n")


async def test_the_recipes_problems_are_scored_by_real_compile_and_test() -> None:
    """The recipe's data, environment and sandbox as the run builds them: each row's prompt asks for its language,
    its own solution scores 1, a compile error (or a Python syntax error) 0, a solution of another problem < 1."""
    cfg = load_config(RECIPE)
    tasks = load_task_file(ROOT / cfg.data.train, prompt_key=cfg.data.prompt_key, answer_key=cfg.data.answer_key)
    assert sorted(t.id for t in tasks) == sorted(GOOD)
    assert {t.metadata["source"] for t in tasks} == {"taco", "livecodebench"}
    async with cfg.sandbox.build() as sandbox:
        for task in tasks:
            lang = language(task.id)
            env = default_registry.make_env(cfg.env.name, EnvResources(sandbox=sandbox), **cfg.env.options)
            messages = await env.reset(task)
            assert f"```{FENCE[lang]}" in messages[0]["content"], messages[0]
            good = await env.score(RewardInput(text=answer(lang, GOOD[task.id])))
            assert good.ok and good.score == 1.0 and good.details["language"] == lang, (task.id, good)
            broken = await env.score(RewardInput(text=answer(lang, BROKEN[lang])))
            assert broken.ok and broken.score == 0.0, (task.id, broken)
            if lang == "cpp":
                assert {t["status"] for t in broken.details["tests"]} == {"compile_error"}, broken
            other = next(p for tid, p in GOOD.items() if tid != task.id and language(tid) == lang)
            assert (await env.score(RewardInput(text=answer(lang, other)))).score < 1.0, task.id


@pytest.mark.slow
@pytest.mark.sglang
@pytest.mark.redis  # the run starts its embedded Redis
def test_one_rl_step_of_the_recipe_scores_real_programs(tmp_path: Path, shared_server: str) -> None:
    """`agentrl train examples/code_rl_cpu.yaml` for one step on the tiny model: the grammar makes every answer hold
    one known Python program and one known C++ program; each trajectory's reward is that of its problem's language's
    program, compiled and run on the problem's tests in the local sandbox."""
    overrides = [f"runs_dir={tmp_path}", "name=code", "model=tiny", "steps=1", f"engine.url={shared_server}",
                 "log_rollouts=full", "rollout.n_samples=2", "rollout.groups_per_step=4", "rollout.max_staleness=0",
                 "rollout.max_new_tokens=256", "rollout.max_response_tokens=256", "rollout.max_context_tokens=512",
                 f"rollout.ebnf={json.dumps(grammar())}", "trainer.micro_batch_tokens=2048",
                 "monitor.live=false", "monitor.prometheus_port=null", "monitor.tensorboard=false"]
    proc = subprocess.run([sys.executable, "-m", "agentrl.cli", "train", str(RECIPE), *overrides],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    run = tmp_path / "code"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["final_weight_version"] == 1 and summary["trajectories_consumed"] == 8 and summary["books_balanced"]
    rollouts = [json.loads(line) for line in (run / "rollouts.jsonl").read_text().splitlines()]
    seen: dict[str, list[float]] = {}
    for t in rollouts:
        task_id = t["prompt_id"].split("@")[0]
        lang = language(task_id)
        found = find_program(t["turns"][0][1], lang)
        assert found is not None and found[0] == lang, t["turns"][0][1]
        program = found[1].strip("\n")
        if program == GOOD[task_id]:
            assert t["reward"] == 1.0, (task_id, program)
        elif program == BROKEN[lang]:
            assert t["reward"] == 0.0, (task_id, program)
        else:  # another problem's solution
            assert program in GOOD.values() and t["reward"] < 1.0, (task_id, program, t["reward"])
        seen.setdefault(lang, []).append(t["reward"])
    assert set(seen) == {"python", "cpp"}, seen  # the first epoch holds all four problems
