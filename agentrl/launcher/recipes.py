"""Embedded run configurations: what `agentrl demo` runs without any file."""

from __future__ import annotations

from typing import Any

from agentrl.overrides import merge

#: `agentrl demo --smoke`: the tiny random model, a short cold-start SFT so it writes <code> blocks, 2 RL steps.
SMOKE: dict[str, Any] = {
    "model": "tiny",
    "steps": 2,
    "sft": {"enabled": True, "family": "sft", "num_traces": 64, "steps": 80, "batch_size": 16, "lr": 1e-2},
    "rollout": {"n_samples": 2, "groups_per_step": 4, "max_staleness": 0, "max_new_tokens": 48, "max_turns": 3,
                "max_response_tokens": 160, "max_context_tokens": 512, "temperature": 1.0},
    "env": {"name": "retool", "options": {"code_timeout_s": 5.0, "format_weight": 0.5}},
    # fp32 on every CPU: the tiny model is fast either way, and the smoke test compares engine and trainer logprobs
    "engine": {"dtype": "float32"},
    "trainer": {"dtype": "fp32", "optimizer": {"lr": 1e-4}, "micro_batch_tokens": 4096},
    "log_rollouts": "full",
}

#: `agentrl demo`: SmolLM2-135M-Instruct on a 2-core CPU (run times per CPU kind: docs/results.md): a short cold-start SFT on one family
#: of wordings (format, not saturation: a longer SFT leaves no sampling diversity for RL to work with), async RL
#: (η = 1, dynamic sampling) on other wordings, held-out accuracy on wordings neither saw. Precision is
#: ``auto`` on both sides (agentrl.hardware: bf16 on CPUs with AMX, where it is ~6× faster, fp32 on AVX2-only CPUs,
#: where bf16 is ~55× slower); rollout and trainer on their own core each.
#: 6 groups of 8 per step (48 trajectories): with 4 groups of 4 the held-out outcome after RL was a coin toss
#: (0.975, 0.45, 0.25 from 0.75 after SFT); a step's gradient was mostly noise, and the policy drifted toward
#: whatever operator that step's few groups rewarded.
DEMO: dict[str, Any] = {
    "model": "smollm2-135m-instruct",
    # 30 steps: on the AVX2 path (fp32) the RL wordings that need parentheses only took off after ~12 steps (pass
    # rate 0 -> 0.71 on "Multiply c by the sum of a and b" by v19) and held-out went 0.70 -> 0.75 in 20 steps (23 min)
    "steps": 30,
    "checkpoint_every": 5,  # 1.7 GB each (weights + Adam state): every 5th step, the last 2 kept
    # 4 steps: with 8 the RL start wrote parentheses in 0-2 % of its samples of the RL wordings that need them
    # (11-14 % with 4; seeds 1 and 2, T 1.3), and RL learns those wordings only from the samples that do.
    # sft_paren: the `sft` wordings plus a phrase naming c before "the sum of a and b", each parenthesis wording twice.
    # After `sft` the RL wordings that name c first were right in 0.7 % of samples (seeds 1, 2: a group of 8 holds a
    # right one 5 % of the time), RL found them by luck, and on the AMX Xeon seed 2 never did (0.65 -> 0.675). With
    # sft_paren 35 % (seed 2, benchmarks/sft_prior.py), and seeds 0-2 reached 0.9 held out in 589-638 s (AMX Xeon, bf16;
    # docs/results.md, 2026-12-02)
    "sft": {"enabled": True, "family": "sft_paren", "num_traces": 64, "steps": 4, "batch_size": 16, "lr": 1e-4},
    # held-out accuracy also at v5, v10, ..., v25 (the curve and time to accuracy 0.9 in summary.json and the report)
    # new_balanced: the parenthesis wordings are half the RL stream (new: 40 %). On the Xeon without AMX (fp32)
    # seed 2 with `new` lost the parentheses early (0.675 -> 0.675); with new_balanced seeds 0-2 all gained
    # (0.75 -> 1.0, 0.725 -> 0.975, 0.675 -> 0.95), 0.9 later in two of them (docs/results.md#the-demo).
    # new_contrast: new_balanced plus a plain wording that begins "Multiply a by b". On the AMX Xeon (bf16) seeds 1 and
    # 2 failed with new_balanced (0.80, 0.75: parentheses put into the held-out "Multiply a by b and then increase
    # the result by c" and the bus) and passed with it (0.975, 0.95), seed 0 too (1.0), 0.9 in 516-860 s
    "data": {"train": "new_contrast", "heldout": "heldout", "num_heldout": 40, "heldout_every": 5},
    "rollout": {"n_samples": 8, "groups_per_step": 6, "max_staleness": 1, "max_running_groups": 8,
                "max_new_tokens": 96, "max_turns": 3, "max_response_tokens": 256, "max_context_tokens": 768,
                # T = 1.3 (the trainer scores at the same temperature): after SFT the policy writes `a * b +- c`
                # for nearly every wording (entropy ~0.05/token), so at T = 1 the (a + b) * c wordings were solved in
                # 2-6 % of samples, their groups were mostly all wrong and RL rarely learned them (held-out
                # 0.75 -> 0.725, seed 0). At 1.3: seed 0 0.75 -> 0.85, seed 1 0.65 -> 0.975 (24 min).
                "temperature": 1.3, "drop_uniform_groups": True,
                # dynamic sampling: at most 1 group dropped per group queued. At 2 (the budget was always spent:
                # 239 dropped for 120 queued) the rollout side generated 3x the trained groups and every step of an
                # AVX512-BF16 EPYC run waited ~100 s for rollouts (45 min run). (skip_solved, tried on seed 1, is
                # off: the wordings it skipped were forgotten, 0.675 -> 0.70, and it was no faster)
                "max_dropped_per_queued": 1.0,
                # adaptive sampling: a group with no solved episode gets one more round of 8 (from the same budget).
                # Two failed Zen 4 runs (seed 0 at f3ef5f7, seed 2 at 9cc59fb) queued 51 groups with none solved,
                # all on the parenthesis wordings, and never learned "c times the sum of a and b" (a good run: 7).
                # With it seeds 0-2 ended at 0.975, 0.925, 0.95 (5 of the 13 Zen 4 runs before: below 0.9)
                "resample_unsolved": 1},
    "env": {"name": "retool", "options": {"code_timeout_s": 5.0, "format_weight": 0.1}},
    # SGLang's KV pool of 8,192 tokens, not the 16,384 default: it is resident from the start (0.75 GB in fp32 at
    # 16,384), and the demo's 64 episodes at once, each group's prompt cached once for its 8 samples, held at most
    # 1,848 tokens of it (an AVX2 EPYC run, seed 3, SGLang's decode log; nothing queued or retracted). Half the
    # pool: -0.37 GB in fp32 (-0.18 in bf16), which brings the fp32 demo under 8 GiB (docs/results.md#the-demo)
    "engine": {"max_total_tokens": 8192},
    # shared_prefix: each group's ~86-token prompt runs once for its 8 responses, not 8 times (an RL step of
    # ~6,900 tokens: 147 s -> 77 s in fp32 on one EPYC core, same loss and gradients).
    # Dr. GRPO advantages (r - group mean, no division by the group's std): with the format reward (0.1) a group
    # whose samples all fail and differ only in format (a SyntaxError scores 0.05, a wrong answer 0.1) got the same
    # advantage scale under GRPO as a group that found the answer, and 7 of its 8 wrong answers were reinforced. On
    # the AVX2 path (fp32) GRPO's entropy went 0.06 -> 0.69 in 4 steps and the policy wrote garbage tokens; with
    # dr_grpo it stayed 0.07-0.22 over 20 steps, <= 10 % malformed calls (docs/results.md, 2026-11-24).
    # KL to the SFT policy (k3, 0.05): dynamic sampling drops the groups of wordings SFT already solves, so nothing
    # else holds them while RL learns the parenthesis wordings. Without it (fresh clone, seed 0, AVX2 path) the
    # policy took the operand order of those wordings for every story within 8 steps ("Each of 16 students brings
    # 90 pencils, and the teacher adds 2 more" -> print(16 * 2 + 90); that wording's pass rate 0.79 -> 0.09).
    # It costs a reference forward (about a quarter of a trainer step).
    # micro_batch_tokens 1024 (one group's prompt and 8 responses a micro-batch): the demo's step (fp32, 48
    # trajectories) peaked at 12.0 GB with 4096 (all six groups' activations alive at once, 1.34 MB a token) and at
    # 5.7 GB with 1024, in the same CPU time (benchmarks/trainer_bench.py --shape demo; docs/results.md, issue 24);
    # activation_checkpointing auto then stays off (0.8 GB of activations, under its 2 GB budget). On an AMX Xeon in
    # bf16, 2048 made the step 1.22x faster for +2.0 GB of the trainer's peak: the demo would leave 8 GiB.
    # lr cosine to a tenth over the run: at a constant 3e-5 the policy swung late in the run between the SFT pattern
    # and parentheses everywhere (a fp32 Xeon without AMX, seed 0: .975 at v20, .75 at v25, 0.50 after RL); the
    # trained groups then are mostly the parenthesis wordings' (the others solved, dropped as uniform), so each full
    # step pushes parentheses everywhere. With the decay the same seed went 0.75 -> 0.975 (0.9 at 691 s) and seed 1
    # 0.725 -> 0.975 (0.9 at 730 s), curves that did not swing back (one run each; docs/results.md, 2026-11-28)
    "trainer": {"layout": "shared_prefix",
                "optimizer": {"lr": 3e-5, "grad_clip": 1.0, "schedule": "cosine", "min_lr_ratio": 0.1},
                "loss": {"advantage": "dr_grpo", "kl_coef": 0.05, "kl_estimator": "k3"}, "micro_batch_tokens": 1024},
    # SGLang also decodes on the trainer's core while the trainer waits for rollouts (both CPU kinds are rollout-bound
    # now: on the AVX2 EPYC the trainer waited 43 % of RL; decode there 1.18x faster with the core lent,
    # benchmarks/engine_borrow_bench.py)
    "resources": {"rollout_cores": [0], "trainer_cores": [1], "engine_borrows_idle_cores": "auto"},
}

#: `agentrl demo --lora`: the demo training LoRA adapters (r 16, alpha 32, every linear layer of the decoder) in
#: cold-start SFT and RL, with the rates LoRA needs. SFT: at full fine-tuning's 1e-4 its 4 steps taught the adapters
#: nothing (held-out 0.0); at 2e-3 for 4 steps the greedy answers carried junk after the code (0.10); 1e-3 for 8
#: steps gave 0.55-0.70. RL: 2e-4 (~7x full fine-tuning's 3e-5; the recipe's cosine decay applies). Activation
#: checkpointing stays `auto` (off for the demo's 1,024-token micro-batches: ~1 GB of activations); `true` saves
#: ~0.5-0.9 GB more of the trainer's peak for ~13 % more a step. On an AVX2 EPYC (seed 0): held-out 0.70 -> 0.925,
#: the trainer at 2.98 GB (full fine-tuning there 6.33), the whole demo 5.85 GiB of anonymous memory
#: (docs/results.md#lora-vs-full-fine-tuning-issue-24-item-5)
LORA: dict[str, Any] = {
    # the `sft` wordings: the LoRA recipe's rates were found with them. With sft_paren (AMX Xeon model 167, seeds
    # 0-1) the SFT start was 0.70-0.75 (0.125 with sft on a model-207 host's seed 0) but RL ended at 0.825 and 0.675:
    # not adopted (docs/results.md, LoRA, 2026-12-02)
    "sft": {"family": "sft", "steps": 8, "lr": 1e-3},
    "trainer": {"lora": {"r": 16, "alpha": 32.0}, "optimizer": {"lr": 2e-4}},
}
DEMO_LORA: dict[str, Any] = merge(DEMO, LORA)
