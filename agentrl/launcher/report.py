"""The end of a run: ``summary.json`` (the books), ``report.md`` and ``report.png`` (reward, accuracy, staleness)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from agentrl.launcher.config import RunConfig
from agentrl.launcher.heldout_curve import TARGET_ACCURACY, curve_figures, is_mid_run
from agentrl.launcher.memory import report_line

logger = logging.getLogger(__name__)


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarize(cfg: RunConfig, run_dir: Path, *, rollout_stats: dict[str, Any], evals: dict[str, Any],
              served_version: int, engine_url: str, queue_left: int, trainer_restarts: int,
              wall_time_s: float, resumed_from_step: int | None = None, carried_in: int = 0) -> dict[str, Any]:
    """The run's books. Balance: produced + carried in = consumed + dropped (stale, invalid) + left in the queue,
    where a resumed run counts from its checkpoint: ``carried_in`` trajectories waited in the queue (produced
    before the resume) and only the steps after ``resumed_from_step`` consumed from it."""
    records = read_metrics(run_dir)
    rewards = [r.get("reward_mean") for r in records]
    since = [r for r in records if int(r.get("step", 0)) > (resumed_from_step or 0)]
    consumed = sum(int(r.get("num_trajectories", 0)) for r in since)
    stale = sum(int(r.get("dropped_stale", 0)) for r in since)
    invalid = sum(int(r.get("dropped_invalid", 0)) for r in since)
    produced = int(rollout_stats.get("trajectories_produced", 0))
    summary: dict[str, Any] = {
        "run": cfg.name,
        "engine": "sglang",
        "engine_url": engine_url,
        "model": cfg.model,
        "steps": len(records),
        "final_weight_version": records[-1]["weight_version"] if records else 0,
        "served_weight_version": served_version,
        "trajectories_produced": produced,
        "trajectories_consumed": consumed,
        "trajectories_dropped_stale": stale,
        "trajectories_dropped_invalid": invalid,
        "trajectories_left_in_queue": queue_left,
        "books_balanced": produced + carried_in == consumed + stale + invalid + queue_left,
        "resumed_from_step": resumed_from_step,
        "trajectories_carried_in": carried_in,
        "groups_failed": rollout_stats.get("groups_failed", 0),
        "groups_filtered": rollout_stats.get("groups_filtered", 0),
        "groups_uniform_queued": rollout_stats.get("groups_uniform_queued", 0),  # dropping budget spent
        # adaptive sampling: extra rounds for unsolved groups, and the groups a later round solved
        "resample_rounds": rollout_stats.get("resample_rounds", 0),
        "groups_rescued": rollout_stats.get("groups_rescued", 0),
        "groups_resample_denied": rollout_stats.get("groups_resample_denied", 0),  # the budget was spent
        "tasks_skipped_solved": rollout_stats.get("tasks_skipped_solved", 0),
        "episodes_restarted": rollout_stats.get("episodes_restarted", 0),  # work thrown away to keep within η
        "trainer_restarts": trainer_restarts,
        "engine_restarts": rollout_stats.get("engine_restarts", 0),
        "wall_time_s": round(wall_time_s, 2),
        "reward_first": rewards[0] if rewards else None,
        "reward_last": rewards[-1] if rewards else None,
        "staleness_mean": (sum(r.get("staleness_mean", 0.0) for r in records) / len(records)) if records else 0.0,
        "staleness_max": max((int(r.get("staleness_max", 0)) for r in records), default=0),
        "reload_s_mean": rollout_stats.get("reload_s_mean"),
        "rollout_model_tokens": rollout_stats.get("model_tokens", 0),
        # pass rate of every finished rollout group (also those dynamic sampling dropped), per weight version
        "rollout_solve_rate_by_version": {str(v): round(s / n, 4) for v, (s, n)
                                          in sorted(rollout_stats.get("solved_by_version", {}).items()) if n},
    }
    summary.update(_by_key(rollout_stats.get("solved_by_key") or {}, rollout_stats.get("groups_untracked_key", 0)))
    for label in ("before", "sft", "after"):
        if label in evals:
            summary[f"heldout_accuracy_{label}"] = evals[label]["accuracy"]
            summary[f"heldout_reward_{label}"] = evals[label]["reward_mean"]
    summary.update(curve_figures(evals))  # heldout_curve, time_to_heldout_0.9_s / _rl_s
    return summary


#: a run with at most this many task keys (the demo's 11 wordings, a small dataset) lists each in summary.json and the
#: report; with more (a dataset's prompts) only the counts are kept
KEYS_LISTED = 64


def _by_key(solved_by_key: dict[str, list[int]], untracked_groups: int = 0) -> dict[str, Any]:
    """Every finished group's outcome by task key (``curriculum.task_key``: a generated problem's wording, else the
    prompt): how many keys RL saw, never solved, always solved; each key's pass rate and the first weight version
    that solved it when there are few keys. The rollout side tracks its first ``KEYS_TRACKED`` keys
    (agentrl.async_rollout.scheduler); groups of later ones are ``rollout_groups_untracked_key``."""
    if not solved_by_key:
        return {}
    out: dict[str, Any] = {
        "rollout_keys_seen": len(solved_by_key), "rollout_groups_untracked_key": untracked_groups,
        "rollout_keys_never_solved": sum(1 for s, _, _ in solved_by_key.values() if s == 0),
        "rollout_keys_always_solved": sum(1 for s, n, _ in solved_by_key.values() if n and s == n)}
    if len(solved_by_key) <= KEYS_LISTED:
        out["rollout_solve_by_key"] = {
            key: {"solve_rate": round(s / n, 4) if n else 0.0, "episodes": n,
                  "first_solved_version": first if first >= 0 else None}
            for key, (s, n, first) in sorted(solved_by_key.items(), key=lambda kv: (kv[1][0] / max(kv[1][1], 1), kv[0]))}
    return out


def _by_key_lines(summary: dict[str, Any]) -> list[str]:
    by_key = summary.get("rollout_solve_by_key")
    if not by_key:
        if "rollout_keys_seen" not in summary:
            return []
        untracked = summary.get("rollout_groups_untracked_key", 0)
        return [f"Training prompts: {summary['rollout_keys_seen']} seen, {summary['rollout_keys_never_solved']} never "
                f"solved in any group, {summary['rollout_keys_always_solved']} always solved"
                + (f" ({untracked} groups of prompts after the first {summary['rollout_keys_seen']} not counted)."
                   if untracked else "."), ""]
    lines = ["### Rollout pass rate by training wording (prompt)", "",
             "Every finished group, dropped ones included; a wording never solved, or first solved late, is one "
             "RL found no signal for.", "", "| wording | episodes | solved | first solved at |", "|---|---|---|---|"]
    for key, k in by_key.items():
        first = k["first_solved_version"]
        text = " ".join(key.split()).replace("|", "\\|")
        lines.append(f"| {text[:117] + '...' if len(text) > 120 else text} | {k['episodes']} | {k['solve_rate']:.2f} | "
                     f"{'never' if first is None else f'v{first}'} |")
    return [*lines, ""]


def write_report(run_dir: Path, summary: dict[str, Any]) -> None:
    records = read_metrics(run_dir)
    plot = _plot(run_dir, records, summary)
    lines = [f"# Run `{summary['run']}`", "",
             (f"Model `{summary['model']}`, engine {summary['engine']}, {summary['steps']} RL steps, "
             f"final weight version {summary['final_weight_version']}, wall time {summary['wall_time_s']:.0f} s."), ""]
    if any(k.startswith("heldout_accuracy") for k in summary):
        lines += ["## Held-out accuracy (wordings never seen in SFT)", "", "| policy | accuracy | reward |",
                  "|---|---|---|"]
        for label, name in (("before", "base model"), ("sft", "after cold-start SFT"), ("after", "after RL")):
            if f"heldout_accuracy_{label}" in summary:
                lines.append(f"| {name} | {summary[f'heldout_accuracy_{label}']:.3f} | "
                             f"{summary[f'heldout_reward_{label}']:.3f} |")
        lines.append("")
    lines += _curve_lines(summary)
    lines += _per_wording(run_dir, summary)
    solve = summary.get("rollout_solve_rate_by_version") or {}
    if solve:
        lines += ["Rollout pass rate by weight version, over every finished group (the trained groups are mixed by "
                  "construction when dynamic sampling is on): "
                  + ", ".join(f"v{v} {rate:.2f}" for v, rate in solve.items())
                  + f"; prompts skipped as mastered: {summary.get('tasks_skipped_solved', 0)}.", ""]
    lines += _by_key_lines(summary)
    lines += ["## Training", "", "| step | version | reward | staleness mean/max | trajectories | tokens | time s |",
              "|---|---|---|---|---|---|---|"]
    for r in records:
        lines.append(f"| {r['step']} | {r['weight_version']} | {r.get('reward_mean', 0):.3f} | "
                     f"{r.get('staleness_mean', 0):.2f}/{r.get('staleness_max', 0)} | {r.get('num_trajectories')} | "
                     f"{r.get('tokens')} | {r.get('time_s', 0):.1f} |")
    lines += ["", "## Books", "",
              (f"produced {summary['trajectories_produced']} = consumed {summary['trajectories_consumed']} + "
              f"dropped stale {summary['trajectories_dropped_stale']} + dropped invalid "
              f"{summary['trajectories_dropped_invalid']} + left in queue {summary['trajectories_left_in_queue']}"
              f" → balanced: {summary['books_balanced']}; trainer restarts: {summary['trainer_restarts']}, "
              f"SGLang server restarts: {summary.get('engine_restarts', 0)}"), ""]
    if summary.get("memory"):
        lines += [report_line(summary["memory"]), ""]
    if plot:
        lines += [f"![reward, accuracy and staleness]({plot.name})", ""]
    (run_dir / "report.md").write_text("\n".join(lines))


def _curve_lines(summary: dict[str, Any]) -> list[str]:
    """Time to the target held-out accuracy, and the curve when it was evaluated during RL (data.heldout_every)."""
    curve = summary.get("heldout_curve") or []
    if len(curve) < 2:
        return []
    target = TARGET_ACCURACY
    run_s, rl_s = summary.get(f"time_to_heldout_{target}_s"), summary.get(f"time_to_heldout_{target}_rl_s")
    reached = (f"{run_s:.0f} s after the run started, {rl_s:.0f} s into RL" if run_s is not None and rl_s is not None
               else "never reached")
    lines = [f"Time to held-out accuracy {target} (the first evaluation after SFT that reached it, at its start): "
             f"{reached}.", "", "| policy | version | accuracy | reward | t RL s | t run s |", "|---|---|---|---|---|---|"]
    for p in curve:
        lines.append(f"| {p['label']} | {version_span(p)} | {p['accuracy']:.3f} | {p.get('reward_mean') or 0:.3f} | "
                     f"{_seconds(p.get('t_rl_s'))} | {_seconds(p.get('t_run_s'))} |")
    if summary.get("heldout_evals_failed"):
        lines += ["", f"{summary['heldout_evals_failed']} evaluation(s) during RL failed (evals.json)."]
    return [*lines, ""]


def version_span(point: dict[str, Any]) -> str:
    """The weight version(s) an evaluation ran on: ``10`` or, where new weights were loaded during it, ``10-12``."""
    start, end = point.get("version"), point.get("version_end")
    return f"{start}" if end is None or end == start else f"{start}-{end}"


def _seconds(value: float | None) -> str:
    return "" if value is None else f"{value:.0f}"


def _per_wording(run_dir: Path, summary: dict[str, Any]) -> list[str]:
    """Held-out accuracy per problem wording (the demo's arithmetic templates), for each evaluated policy: the base
    model, SFT, the curve's evaluations during RL by version (``eval_v<N>.jsonl``; their versions may span a few,
    see the curve above) and RL's end."""
    from agentrl.data.arithmetic import FAMILIES, template_of

    # the evaluations during RL as the curve has them (by version; failed ones and a resumed run's discarded ones not)
    mid = [p["label"] for p in summary.get("heldout_curve") or [] if is_mid_run(p["label"])]
    labels = [(k, n) for k, n in (("before", "base"), ("sft", "SFT"), *((k, k) for k in mid), ("after", "RL"))
              if (run_dir / f"eval_{k}.jsonl").exists()]
    counts: dict[str, dict[str, list[int]]] = {}
    for label, _ in labels:
        for line in (run_dir / f"eval_{label}.jsonl").read_text().splitlines():
            rec = json.loads(line)
            template = template_of(rec.get("prompt", ""), FAMILIES["heldout"])
            if template is None:
                return []  # not the arithmetic held-out set: nothing to break down
            right = counts.setdefault(template.text, {}).setdefault(label, [0, 0])
            right[0] += bool(rec.get("correct"))
            right[1] += 1
    if not counts:
        return []
    lines = ["### Per held-out wording", "", "| wording | " + " | ".join(n for _, n in labels) + " |",
             "|---|" + "---|" * len(labels)]
    for text, by in counts.items():
        cells = [f"{by[k][0]}/{by[k][1]}" if k in by else "" for k, _ in labels]
        lines.append(f"| {text} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def _plot(run_dir: Path, records: list[dict[str, Any]], summary: dict[str, Any]) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: no plot in the report")
        return None
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    steps = [r["step"] for r in records]
    axes[0].plot(steps, [r.get("reward_mean", 0) for r in records], marker="o", label="reward")
    solve = summary.get("rollout_solve_rate_by_version") or {}
    if solve:  # version v is the policy after step v, so it sits at x = v
        axes[0].plot([int(v) for v in solve], list(solve.values()), marker=".", label="pass rate, all groups")
    curve = [p for p in summary.get("heldout_curve") or [] if p.get("version") is not None]
    if len(curve) > 2:  # evaluated during RL too (data.heldout_every)
        axes[0].plot([p["version"] for p in curve], [p["accuracy"] for p in curve], marker="s", color="#2a2",
                     label="held-out accuracy (greedy)")
    if solve or len(curve) > 2:
        axes[0].legend()
    axes[0].set(title="reward (trained groups)", xlabel="step")
    labels = [("before", "base"), ("sft", "SFT"), ("after", "RL")]
    acc = [(name, summary[f"heldout_accuracy_{k}"]) for k, name in labels if f"heldout_accuracy_{k}" in summary]
    if acc:
        axes[1].bar([a for a, _ in acc], [b for _, b in acc], color=["#999", "#69c", "#2a2"][: len(acc)])
        axes[1].set_ylim(0, 1)
    axes[1].set(title="held-out accuracy")
    axes[2].plot(steps, [r.get("staleness_mean", 0) for r in records], marker="o", label="mean")
    axes[2].plot(steps, [r.get("staleness_max", 0) for r in records], marker="x", label="max")
    axes[2].set(title="staleness (versions)", xlabel="step")
    axes[2].legend()
    fig.tight_layout()
    out = run_dir / "report.png"
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out
