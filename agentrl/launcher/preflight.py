"""Checks that run before anything starts (Ray, Redis, SGLang, SFT): a run that cannot work fails in seconds,
saying what was expected, instead of after minutes of start-up.

Checked: the user's imports load; the environment is registered and its options bind to its constructor (with
"did you mean" for misspelt option names); the model resolves to a local folder; every dataset the run reads
exists and holds the keys it needs; the configured experiment trackers can be imported.
"""

from __future__ import annotations

import inspect
import logging
from pathlib import Path
from typing import Any

from agentrl import heap
from agentrl.env import default_registry
from agentrl.env.registry import load_imports
from agentrl.errors import ConfigError, closest
from agentrl.launcher.config import RunConfig
from agentrl.launcher.resources import check_data
from agentrl.launcher.trackers import check_trackers
from agentrl.models import resolve_model

logger = logging.getLogger(__name__)


def did_you_mean(word: str, choices: list[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest choice, or an empty string."""
    close = closest(word, choices)
    return f" (did you mean {close!r}?)" if close else ""


def check_env_options(name: str, options: dict[str, Any]) -> None:
    """The env is registered and ``factory(resources, **options)`` binds: unknown or missing options are named."""
    spec = default_registry.get_env(name)
    try:
        sig = inspect.signature(spec.factory)
    except (TypeError, ValueError):  # a builtin or C factory: nothing to check before calling it
        return
    params = list(sig.parameters.values())
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return
    accepted = [p.name for p in params[1:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    unknown = [k for k in options if k not in accepted]
    if unknown:
        hints = "; ".join(f"{k!r}{did_you_mean(k, accepted)}" for k in unknown)
        raise ConfigError(f"env.options for environment {name!r}: unknown option {hints}; it accepts: "
                          f"{', '.join(accepted) or 'no options'}")
    try:
        sig.bind(None, **options)
    except TypeError as exc:
        raise ConfigError(f"env.options for environment {name!r} do not fit its constructor: {exc}") from None


def check_run(cfg: RunConfig) -> Path:
    """Everything checkable before a server starts; returns the resolved model folder."""
    load_imports(cfg.imports)
    check_env_options(cfg.env.name, dict(cfg.env.options))
    check_data(cfg)
    _check_sft_family(cfg)
    check_trackers(cfg.monitor.wandb, cfg.monitor.trackio)
    _check_malloc(cfg)
    return resolve_model(cfg.model)  # last: the first use of a bundled model builds it (seconds)


def _check_malloc(cfg: RunConfig) -> None:
    """Ray mode: an explicit jemalloc must be preloadable (``auto`` falls back to glibc, logged at the ranks' start).
    Debug mode runs the trainer in this process, whose allocator was set when it started: say which it is."""
    malloc = cfg.trainer.malloc
    if cfg.resources.ray:
        if malloc == "jemalloc":
            try:
                heap.preload_env(malloc)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
    elif heap.jemalloc_loaded():
        if malloc == "auto":
            logger.info("trainer.malloc auto: jemalloc (this process was started with it preloaded)")
    elif malloc == "jemalloc":
        logger.warning("trainer.malloc=jemalloc: debug mode (ray: false) runs the trainer in this process, which "
                       "started on glibc's allocator: the setting does not apply (start the process with the "
                       "library in LD_PRELOAD to have it)")
    elif malloc == "auto":
        logger.info("trainer.malloc auto: glibc (%s)",
                    heap.choose(malloc, cfg.trainer.mmap_threshold_kb, separate_process=False)[1])


def _check_sft_family(cfg: RunConfig) -> None:
    """Without ``sft.data`` the SFT traces are generated from the ``sft.family`` problem family."""
    from agentrl.data import arithmetic

    families = sorted(arithmetic.FAMILIES)
    if cfg.sft.enabled and cfg.sft.steps > 0 and cfg.sft.data is None and cfg.sft.family not in families:
        raise ConfigError(f"sft.family: unknown problem family {cfg.sft.family!r}"
                          f"{did_you_mean(cfg.sft.family, families)}; known: {', '.join(families)} (or set sft.data "
                          "to a dataset of conversations)")
