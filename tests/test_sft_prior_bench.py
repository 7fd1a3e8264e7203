"""benchmarks/sft_prior.py: how it judges a sampled answer, its figures, and one real run on the tiny model."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import sft_prior  # noqa: E402


def test_only_plain_arithmetic_is_evaluated():
    assert sft_prior.arithmetic("(28) * (14 + 98)") == 3136
    assert sft_prior.arithmetic("-3 + 10 / 4") == -0.5
    for hostile in ("9**9**9**9", "__import__('os').system('true')", "len('ab')", "1 if 1 else 2", "a * b", "",
                    "1 / 0", "10**13", "99999999 * 99999999"):
        assert sft_prior.arithmetic(hostile) is None, hostile


def test_the_first_print_of_the_first_code_block_is_the_answer():
    text = "Let me compute this with Python.\n<code>\nprint(28 * (14 + 98))\n</code>\n<code>\nprint(1)\n</code>"
    assert sft_prior.first_answer(text) == "28 * (14 + 98)"
    assert sft_prior.is_right(text, "3136") and not sft_prior.is_right(text, "490")
    assert sft_prior.first_answer("print(2) outside a block") is None
    assert not sft_prior.is_right("<code>\nprint(28 * 14 + 98\n", "490")  # cut off: no closing parenthesis


def test_the_figures_separate_the_parenthesis_wordings_from_the_plain_ones():
    rates = {"p1": [0.0, 0.1], "p2": [0.5, 0.7], "q": [0.9, 0.8]}
    parens = {"p1": [0.2, 0.4], "p2": [1.0, 1.0], "q": [0.1, 0.3]}
    got = sft_prior.summarize(rates, parens, {"p1": True, "p2": True, "q": False})
    assert got == pytest.approx({"sft_prior_paren": 0.325, "sft_prior_paren_min": 0.05, "sft_prior_plain": 0.85,
                                 "plain_parens": 0.2})


@pytest.mark.slow
def test_a_real_probe_of_the_tiny_model(tmp_path):
    """The trainer's own SFT and a sampled first turn for every RL wording (the tiny random model: all wrong)."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "sft_prior.py"
    out = subprocess.run([sys.executable, str(script), "--quick"],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    fields = dict(kv.split("=", 1) for kv in lines[-1].split())
    assert fields["family"] == "new_contrast" and fields["seeds"] == "0" and fields["samples"] == "2"
    assert float(fields["sft_prior_paren"]) == 0.0 and "commit" in fields and "cpu" in fields
    assert sum(line.startswith(("( ", "  ")) for line in lines) == 11  # one line per RL wording
