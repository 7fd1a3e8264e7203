"""Embedded run configurations: what `agentrl demo` runs without any file."""

from __future__ import annotations

from typing import Any

#: `agentrl demo --smoke`: the tiny random model, a short cold-start SFT so it writes <code> blocks, 2 RL steps.
SMOKE: dict[str, Any] = {
    "model": "tiny",
    "steps": 2,
    "sft": {"enabled": True, "family": "sft", "num_traces": 64, "steps": 80, "batch_size": 16, "lr": 1e-2},
    "rollout": {"n_samples": 2, "groups_per_step": 4, "max_staleness": 0, "max_new_tokens": 48, "max_turns": 3,
                "max_response_tokens": 160, "max_context_tokens": 512, "temperature": 1.0},
    "env": {"name": "retool", "options": {"code_timeout_s": 5.0, "format_weight": 0.5}},
    "trainer": {"optimizer": {"lr": 1e-4}, "micro_batch_tokens": 4096},
    "log_rollouts": "full",
}

#: `agentrl demo`: SmolLM2-135M-Instruct on CPU.
DEMO: dict[str, Any] = {
    "model": "smollm2-135m-instruct",
    "steps": 6,
    "sft": {"enabled": True, "family": "sft", "num_traces": 320, "steps": 20, "batch_size": 16, "lr": 1e-4},
    "rollout": {"n_samples": 4, "groups_per_step": 4, "max_staleness": 1, "max_new_tokens": 96, "max_turns": 3,
                "max_response_tokens": 256, "max_context_tokens": 768, "temperature": 1.0},
    "env": {"name": "retool", "options": {"code_timeout_s": 5.0}},
    "trainer": {"optimizer": {"lr": 2e-6}, "micro_batch_tokens": 4096},
}
