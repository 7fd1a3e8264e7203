"""The end-of-run books and report, from the files a run leaves (no processes needed)."""

from __future__ import annotations

import json

from agentrl.data.arithmetic import FAMILIES, problems, template_of
from agentrl.launcher.config import RunConfig
from agentrl.launcher.report import summarize, write_report


def _run_dir(tmp_path):
    steps = [{"step": k, "weight_version": k, "reward_mean": 0.5 + 0.1 * k, "num_trajectories": 8,
              "dropped_stale": 1 if k == 2 else 0, "staleness_mean": 0.5, "staleness_max": 1, "tokens": 100,
              "time_s": 2.0} for k in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    heldout = problems("heldout", 8)
    for label, right in (("sft", {0, 1}), ("after", {0, 1, 2, 4, 5})):
        recs = [{"prompt": p.task.prompt, "correct": i in right} for i, p in enumerate(heldout)]
        (tmp_path / f"eval_{label}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return tmp_path


def test_books_balance_only_when_every_trajectory_is_accounted_for(tmp_path):
    run = _run_dir(tmp_path)
    evals = {"sft": {"accuracy": 0.25, "reward_mean": 0.3}, "after": {"accuracy": 0.625, "reward_mean": 0.7}}
    kw = {"evals": evals, "served_version": 3, "engine_url": "http://x", "trainer_restarts": 0, "wall_time_s": 1.0}
    ok = summarize(RunConfig(name="r"), run, rollout_stats={"trajectories_produced": 29, "engine_restarts": 1},
                   queue_left=4, **kw)
    assert ok["books_balanced"] and ok["trajectories_consumed"] == 24 and ok["trajectories_dropped_stale"] == 1
    assert ok["engine_restarts"] == 1 and ok["final_weight_version"] == 3
    assert ok["heldout_accuracy_after"] == 0.625 and ok["heldout_accuracy_sft"] == 0.25
    lost = summarize(RunConfig(name="r"), run, rollout_stats={"trajectories_produced": 30}, queue_left=4, **kw)
    assert not lost["books_balanced"]


def test_report_breaks_held_out_accuracy_down_by_wording(tmp_path):
    run = _run_dir(tmp_path)
    summary = summarize(RunConfig(name="r"), run, rollout_stats={"trajectories_produced": 29},
                        evals={"sft": {"accuracy": 0.25, "reward_mean": 0.3},
                               "after": {"accuracy": 0.625, "reward_mean": 0.7}},
                        served_version=3, engine_url="http://x", queue_left=4, trainer_restarts=0, wall_time_s=1.0)
    write_report(run, summary)
    report = (run / "report.md").read_text()
    assert "| after cold-start SFT | 0.250 |" in report and "| after RL | 0.625 |" in report
    first = FAMILIES["heldout"][0].text
    assert f"| {first} | 1/2 | 2/2 |" in report  # problems 0 and 4 are the first wording
    assert "| wording | SFT | RL |" in report
    assert "balanced: True" in report
    assert "peak memory" not in report  # a summary without a memory block (older runs) has no line for it
    summary["memory"] = {"peak_concurrent_gb": 7.25, "sum_of_peaks_gb": 9.5, "processes": 31, "total_ram_gb": 24.0,
                         "per_process": {"trainer-0": 5.75, "sglang": 2.5, "driver": 1.25}}
    write_report(run, summary)
    assert ("peak memory: 7.25 GB concurrent (sum of peaks 9.50 GB) over 31 processes seen in the run (short-lived ones included); trainer rank 0 5.75 GB; "
            "SGLang 2.50 GB") in (run / "report.md").read_text()


def test_template_of_finds_the_wording_and_nothing_else():
    p = problems("heldout", 1)[0]
    assert template_of(p.task.prompt, FAMILIES["heldout"]) is FAMILIES["heldout"][0]
    assert template_of("What is 2 + 2?", FAMILIES["heldout"]) is None


def test_rl_task_stream_is_seeded_and_uses_every_wording_once_per_round():
    from itertools import islice

    from agentrl.data.arithmetic import task_stream

    templates = FAMILIES["new"]
    tasks = list(islice(task_stream("new", seed=3), 3 * len(templates)))
    assert [t.prompt for t in tasks] == [t.prompt for t in islice(task_stream("new", seed=3), len(tasks))]
    rounds = [tasks[k:k + len(templates)] for k in range(0, len(tasks), len(templates))]
    for chunk in rounds:
        assert {template_of(t.prompt, templates) for t in chunk} == set(templates)
    orders = [[templates.index(template_of(t.prompt, templates)) for t in chunk] for chunk in rounds]
    assert len({tuple(o) for o in orders}) > 1  # shuffled afresh each round


def test_the_balanced_rl_family_draws_as_many_parenthesis_tasks_as_others_in_each_block():
    from collections import Counter
    from itertools import islice

    from agentrl.data.arithmetic import task_stream

    block = len(FAMILIES["new_balanced"])
    tasks = list(islice(task_stream("new_balanced", seed=1), 2 * block))
    for chunk in (tasks[:block], tasks[block:]):
        counts = Counter(template_of(t.prompt, FAMILIES["new"]) for t in chunk)
        assert set(counts) == set(FAMILIES["new"])
        assert {counts[t] for t in counts if "(" in t.expr} == {3} and {counts[t] for t in counts if "(" not in t.expr} == {2}
        assert sum("(" in t.metadata["expr"] for t in chunk) == block // 2


def test_the_contrast_family_adds_a_plain_multiply_wording_and_no_heldout_one():
    from collections import Counter
    from itertools import islice

    from agentrl.data.arithmetic import CONTRAST_TEMPLATES, task_stream

    wordings = FAMILIES["new"] + CONTRAST_TEMPLATES
    block = len(FAMILIES["new_contrast"])
    counts = Counter(template_of(t.prompt, wordings) for t in islice(task_stream("new_contrast", seed=2), block))
    assert counts[CONTRAST_TEMPLATES[0]] == 2 and set(counts) == set(wordings)
    multiply = [t for t in wordings if t.text.startswith("Multiply")]
    assert {"(" in t.expr for t in multiply} == {True, False}  # the contrast: not every "Multiply" takes parentheses
    # no training family holds a held-out wording, nor a prompt a held-out template would match
    for family in ("sft", "sft_paren", "rl", "new", "new_balanced", "new_contrast"):
        assert not set(FAMILIES[family]) & set(FAMILIES["heldout"])
        for p in problems(family, len(FAMILIES[family])):
            assert template_of(p.task.prompt, FAMILIES["heldout"]) is None


def test_the_wording_breakdown_has_a_column_per_evaluation_during_rl(tmp_path):
    run = _run_dir(tmp_path)
    heldout = problems("heldout", 8)
    # v7: a file without a record (left by an earlier process); v12: its evaluation failed in a resumed run
    for label, right in (("v10", {0}), ("v5", {4}), ("v2", set()), ("v7", {0, 4}), ("v12", {0, 4})):
        recs = [{"prompt": p.task.prompt, "correct": i in right} for i, p in enumerate(heldout)]
        (run / f"eval_{label}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    evals = {"sft": {"accuracy": 0.25, "reward_mean": 0.3}, "after": {"accuracy": 0.625, "reward_mean": 0.7},
             "v12": {"label": "v12", "version": 12, "failed": True, "error": "RuntimeError: gone"},
             **{f"v{v}": {"label": f"v{v}", "version": v, "accuracy": 0.5} for v in (10, 5, 2)}}  # in any order
    summary = summarize(RunConfig(name="r"), run, rollout_stats={"trajectories_produced": 29}, evals=evals,
                        served_version=3, engine_url="http://x", queue_left=4, trainer_restarts=0, wall_time_s=1.0)
    write_report(run, summary)
    report = (run / "report.md").read_text()
    assert "| wording | SFT | v2 | v5 | v10 | RL |" in report
    assert f"| {FAMILIES['heldout'][0].text} | 1/2 | 0/2 | 1/2 | 1/2 | 2/2 |" in report


def test_the_parenthesis_sft_family_adds_a_c_first_sum_phrase_and_doubles_the_parenthesis_wordings():
    import re
    from collections import Counter

    from agentrl.data.arithmetic import CFIRST_SUM_TEMPLATES

    counts = Counter(FAMILIES["sft_paren"])
    assert set(counts) == set(FAMILIES["sft"]) | set(CFIRST_SUM_TEMPLATES)
    assert all(n == (2 if "(" in t.expr else 1) for t, n in counts.items())
    phrase = problems("sft_paren", len(FAMILIES["sft_paren"]))[-1]  # the last entry: the phrase (weighted, in order)
    assert phrase.task.metadata["template"] == CFIRST_SUM_TEMPLATES[0].text
    c, a, b = (int(x) for x in re.findall(r"\d+", phrase.task.prompt))
    assert phrase.task.answer == str(c * (a + b))  # c named first, the sum after it


def test_the_books_break_the_rollout_pass_rate_down_by_training_wording(tmp_path):
    run = _run_dir(tmp_path)
    kw = {"evals": {}, "served_version": 3, "engine_url": "http://x", "queue_left": 0, "trainer_restarts": 0,
          "wall_time_s": 1.0}
    by_key = {"Multiply {c} by the sum of {a} and {b}.": [0, 48, -1], "What is {a} | {b}?": [16, 16, 0],
              "A club has {c} teams.": [6, 24, 7]}
    summary = summarize(RunConfig(name="r"), run, rollout_stats={"trajectories_produced": 24,
                                                                 "solved_by_key": by_key}, **kw)
    assert (summary["rollout_keys_seen"], summary["rollout_keys_never_solved"],
            summary["rollout_keys_always_solved"]) == (3, 1, 1)
    listed = summary["rollout_solve_by_key"]
    assert list(listed) == ["Multiply {c} by the sum of {a} and {b}.", "A club has {c} teams.", "What is {a} | {b}?"]
    assert listed["A club has {c} teams."] == {"solve_rate": 0.25, "episodes": 24, "first_solved_version": 7}
    assert listed["Multiply {c} by the sum of {a} and {b}."]["first_solved_version"] is None
    write_report(run, summary)
    report = (run / "report.md").read_text()
    assert "| Multiply {c} by the sum of {a} and {b}. | 48 | 0.00 | never |" in report
    assert "| A club has {c} teams. | 24 | 0.25 | v7 |" in report
    assert "| What is {a} \\| {b}? | 16 | 1.00 | v0 |" in report  # a table cell cannot hold a bare |

    # a dataset's many prompts: the counts only
    many = {f"prompt {i}": [i % 2, 8, 0 if i % 2 else -1] for i in range(100)}
    summary = summarize(RunConfig(name="r"), run, rollout_stats={"trajectories_produced": 24, "solved_by_key": many},
                        **kw)
    assert "rollout_solve_by_key" not in summary and summary["rollout_keys_never_solved"] == 50
    write_report(run, summary)
    assert "Training prompts: 100 seen, 50 never solved in any group, 0 always solved." in (run / "report.md").read_text()
    summary = summarize(RunConfig(name="r"), run, rollout_stats={"trajectories_produced": 24, "solved_by_key": many,
                                                                 "groups_untracked_key": 7}, **kw)
    assert summary["rollout_groups_untracked_key"] == 7
    write_report(run, summary)
    assert "(7 groups of prompts after the first 100 not counted)." in (run / "report.md").read_text()
