"""The RL start's exploration prior: how often the policy after cold-start SFT answers each RL wording right.

RL learns a wording only from groups in which some sample solved it. A wording the SFT policy answers right in under
1 % of its samples gives the demo's groups of 8 almost never a signal, and whether RL learns it then rests on luck:
on the AMX Xeon, seeds 1 and 2 of the demo both started at 0.7 % on the RL wordings that name c before the sum
("Multiply c by the sum of a and b", the club, the bags); RL found them in seed 1 and never in seed 2 (held-out "c
times the sum of a and b" 0/10 after 30 steps; docs/results.md). A demo run takes 20-70 minutes; this probe takes a
few per seed, so an SFT recipe can be compared on several seeds before any RL run.

Per seed (``--seeds``), in this process: the demo's SFT traces and its SFT (``run_sft``, the trainer's own code,
FSDP2 over gloo at world size 1) from the recipe (``--lora``: the LoRA recipe) with the overrides given (``key=value``,
e.g. ``sft.family=sft_paren``), then ``--samples`` samples of each wording of ``data.train`` at the recipe's rollout
temperature, its first turn cut at ``</code>``. Sampling runs in Hugging Face transformers (the same softmax at the
same temperature as SGLang's; the probe is a distribution, not the engine) in the dtype ``auto`` resolves to here
(bf16 where AMX makes it fast, else fp32). An answer is right when the first ``print(...)`` of the code evaluates,
as plain arithmetic (numbers, + - * /, parentheses: nothing else is evaluated), to the task's answer.

Prints one line per wording (right rate per seed, share of samples with parentheses), then the last line:
``sft_prior_paren=…`` (mean right rate of the wordings whose answer takes parentheses, over seeds and wordings),
``sft_prior_paren_min=…`` (the lowest of those wordings' rates, each averaged over the seeds: the wording RL is
likeliest to miss), ``sft_prior_plain=…``, ``plain_parens=…`` (share of the plain wordings' samples that wrote
parentheses: a prior that puts them everywhere is no better), ``sft_s=…`` (mean SFT time), ``seeds=…``
``samples=…`` ``family=…`` ``sft_family=…`` ``temperature=…`` and the footer (benchmarks/_common.py). ``--quick``
checks that it runs (the tiny random model: every answer wrong).
"""

from __future__ import annotations

import argparse
import ast
import operator
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _common import environment, last_line  # this folder's

QUICK = ["model=tiny", "sft.steps=1", "rollout.max_new_tokens=8", "trainer.dtype=fp32"]
_OPS: dict[type, Any] = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
                         ast.Div: operator.truediv}
_MAX = 10**12  # operands and results beyond this are not an answer to a two-digit word problem


def arithmetic(expr: str) -> float | None:
    """The value of ``expr`` if it is plain arithmetic (numbers, + - * /, unary minus, parentheses), else None.
    Our own tiny evaluator rather than ``eval``: the text is the model's, and even a restricted ``eval`` runs
    ``9**9**9`` for ever."""
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except (SyntaxError, ValueError):
        return None

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            out = _OPS[type(node.op)](value(node.left), value(node.right))
            if abs(out) > _MAX:
                raise ValueError("too large")
            return out
        raise ValueError(f"not arithmetic: {type(node).__name__}")

    try:
        return value(tree.body)
    except (ValueError, ZeroDivisionError):
        return None


def first_answer(text: str) -> str | None:
    """The argument of the first ``print(...)`` in the first ``<code>`` block (to the line's last parenthesis)."""
    code = text.split("<code>", 1)[1] if "<code>" in text else ""
    m = re.search(r"print\((.*)\)", code.split("</code>", 1)[0])
    return m.group(1) if m else None


def is_right(text: str, answer: str) -> bool:
    expr = first_answer(text)
    got = arithmetic(expr) if expr is not None else None
    return got is not None and abs(got - float(answer)) < 1e-6


def summarize(rates: dict[str, list[float]], parens: dict[str, list[float]], needs_parens: dict[str, bool]
              ) -> dict[str, float]:
    """The last line's figures from per-wording, per-seed right rates and parenthesis shares."""
    paren = [statistics.fmean(r) for w, r in rates.items() if needs_parens[w]]
    plain = [statistics.fmean(r) for w, r in rates.items() if not needs_parens[w]]
    plain_parens = [statistics.fmean(p) for w, p in parens.items() if not needs_parens[w]]
    return {"sft_prior_paren": statistics.fmean(paren) if paren else float("nan"),
            "sft_prior_paren_min": min(paren) if paren else float("nan"),
            "sft_prior_plain": statistics.fmean(plain) if plain else float("nan"),
            "plain_parens": statistics.fmean(plain_parens) if plain_parens else float("nan")}


def probe(seed: int, overrides: Sequence[str], *, lora: bool, samples: int, work: Path) -> tuple[dict[str, Any], float]:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from agentrl.data import arithmetic as problems_mod
    from agentrl.env.retool import SYSTEM_PROMPT
    from agentrl.hardware import resolve_dtype
    from agentrl.launcher import recipes
    from agentrl.launcher.config import load_config
    from agentrl.launcher.resources import sft_traces_file
    from agentrl.launcher.trainer_process import run_sft
    from agentrl.models import resolve_model
    from agentrl.tokenizer import ChatTokenizer

    cfg = load_config(None, [f"seed={seed}", *overrides], recipes.DEMO_LORA if lora else recipes.DEMO)
    if cfg.data.train not in problems_mod.FAMILIES:
        raise SystemExit(f"data.train={cfg.data.train!r}: the probe samples a generated family's wordings "
                         f"({sorted(problems_mod.FAMILIES)})")
    base = resolve_model(cfg.model)
    tok = ChatTokenizer.from_pretrained(base)
    run_dir = work / f"seed{seed}"
    run_dir.mkdir(parents=True)
    start = time.perf_counter()
    sft_traces_file(cfg, tok, run_dir / "sft_traces.jsonl")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        v0 = run_sft(cfg, run_dir, base)
    finally:
        dist.destroy_process_group()
    sft_s = time.perf_counter() - start
    dtype = torch.bfloat16 if resolve_dtype("auto", "cpu").dtype == "bf16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(v0, dtype=dtype).eval()
    torch.manual_seed(seed)
    system = cfg.env.options.get("system_prompt", SYSTEM_PROMPT)
    wordings = dict.fromkeys(problems_mod.FAMILIES[cfg.data.train])  # each once, in the family's order
    pool = problems_mod.problems(cfg.data.train, len(problems_mod.FAMILIES[cfg.data.train]) * 4, seed=10_000 + seed)
    out: dict[str, Any] = {}
    pad = tok.hf.pad_token_id if tok.hf.pad_token_id is not None else tok.hf.eos_token_id
    for wording in wordings:
        mine = [p for p in pool if p.task.metadata["template"] == wording.text]
        batch = [mine[k % len(mine)] for k in range(samples)]
        prompts = [tok.encode_prompt([{"role": "system", "content": system}, {"role": "user", "content": p.task.prompt}])
                   for p in batch]
        width = max(map(len, prompts))  # left-padded: generation continues every row from the same column
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        sampling = cfg.rollout.sampling
        with torch.no_grad():
            gen = model.generate(input_ids=ids, attention_mask=mask, do_sample=True,
                                 temperature=sampling.temperature, top_p=sampling.top_p,
                                 top_k=sampling.top_k if sampling.top_k > 0 else 0,
                                 max_new_tokens=sampling.max_new_tokens, stop_strings=["</code>"],
                                 tokenizer=tok.hf, pad_token_id=pad)
        texts = [tok.decode(row[width:].tolist()) for row in gen]
        answers = [first_answer(t) or "" for t in texts]
        out[wording.text] = {"right": sum(is_right(t, p.task.answer) for t, p in zip(texts, batch)) / samples,
                             "parens": sum("(" in a for a in answers) / samples, "needs_parens": "(" in wording.expr}
    return out, sft_s


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default 0,1,2)")
    ap.add_argument("--samples", type=int, default=48, help="samples per wording and seed (default 48)")
    ap.add_argument("--lora", action="store_true", help="the demo's LoRA recipe")
    ap.add_argument("--quick", action="store_true", help="check that it runs: the tiny model, one SFT step, "
                    "seed 0, 2 samples of 8 tokens (no figure to quote)")
    ap.add_argument("overrides", nargs="*", help="key=value overrides of the demo recipe")
    args = ap.parse_args(argv)
    if args.quick:
        args.seeds, args.samples = "0", 2
        args.overrides = [*QUICK, *args.overrides]
    from agentrl.launcher import recipes
    from agentrl.launcher.config import load_config

    seeds = [int(s) for s in args.seeds.split(",")]
    cfg = load_config(None, args.overrides, recipes.DEMO_LORA if args.lora else recipes.DEMO)  # bad keys: before SFT
    env = environment(dtype="auto", packages=("torch", "transformers"))
    rates: dict[str, list[float]] = {}
    parens: dict[str, list[float]] = {}
    needs: dict[str, bool] = {}
    sft_times = []
    with tempfile.TemporaryDirectory(prefix="sft_prior_") as work:
        for seed in seeds:
            per, sft_s = probe(seed, args.overrides, lora=args.lora, samples=args.samples, work=Path(work))
            sft_times.append(sft_s)
            for w, r in per.items():
                rates.setdefault(w, []).append(r["right"])
                parens.setdefault(w, []).append(r["parens"])
                needs[w] = r["needs_parens"]
            print(f"seed {seed}: SFT {sft_s:.0f} s", flush=True)
    for w in rates:
        print(f"{'(' if needs[w] else ' '} {w[:60]:60s} right {' '.join(f'{r:.2f}' for r in rates[w])} "
              f"parens {statistics.fmean(parens[w]):.2f}")
    figures = {**summarize(rates, parens, needs), "sft_s": statistics.fmean(sft_times),
               "seeds": "+".join(map(str, seeds)), "samples": args.samples, "family": cfg.data.train,
               "sft_family": cfg.sft.family, "temperature": cfg.rollout.sampling.temperature}
    print(last_line(figures, env))


if __name__ == "__main__":
    sys.exit(main())
