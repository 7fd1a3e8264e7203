import dataclasses
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from agentrl.async_rollout import EpisodeBudget, RolloutConfig
from agentrl.engine import PoolConfig, SamplingParams, SGLangServerConfig, Timeouts
from agentrl.errors import ConfigError
from agentrl.gateway import GatewayConfig
from agentrl.launcher import recipes
from agentrl.launcher.config import EngineSection, GatewaySection, RolloutSection, load_config, save_config
from agentrl.rewards import RewardsConfig
from agentrl.sandbox import SandboxConfig
from agentrl.trainer import LoraConfig, LossConfig, OptimizerConfig, TrainerSettings

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("recipe", [recipes.SMOKE, recipes.DEMO, recipes.DEMO_LORA])
def test_embedded_recipes_validate(recipe):
    cfg = load_config(None, ["name=x"], base=recipe)
    assert cfg.name == "x" and cfg.steps >= 1


def test_the_lora_demo_is_the_demo_with_adapters_and_lora_s_rates():
    demo, lora = load_config(None, base=recipes.DEMO), load_config(None, base=recipes.DEMO_LORA)
    assert demo.trainer.lora is None and recipes.DEMO["trainer"]["optimizer"]["lr"] == 3e-5  # DEMO left as it was
    assert (lora.trainer.lora.r, lora.trainer.lora.alpha, lora.trainer.lora.target_modules) == (16, 32.0, "all-linear")
    assert lora.trainer.optimizer.lr == 2e-4 and (lora.sft.steps, lora.sft.lr) == (8, 1e-3)
    # everything else is the demo's: the schedule, the loss, the rollout, the data
    assert lora.trainer.optimizer.schedule == "cosine" and lora.trainer.optimizer.min_lr_ratio == 0.1
    assert lora.trainer.loss == demo.trainer.loss and lora.rollout == demo.rollout and lora.data == demo.data
    assert lora.sft.num_traces == demo.sft.num_traces and lora.model == demo.model
    # the user's overrides still win
    assert load_config(None, ["trainer.lora.r=8"], base=recipes.DEMO_LORA).trainer.lora.r == 8


def test_agentrl_demo_lora_runs_the_lora_recipe_and_refuses_smoke(monkeypatch):
    from typer.testing import CliRunner

    from agentrl import cli

    calls = []
    monkeypatch.setattr(cli, "_run", lambda path, overrides, base, prefix, **kw: calls.append((base, prefix, overrides)))
    assert CliRunner().invoke(cli.app, ["demo", "--lora", "seed=1"]).exit_code == 0
    assert calls == [(recipes.DEMO_LORA, "demo-lora", ["seed=1"])]
    assert CliRunner().invoke(cli.app, ["demo"]).exit_code == 0 and calls[-1][:2] == (recipes.DEMO, "demo")
    refused = CliRunner().invoke(cli.app, ["demo", "--smoke", "--lora"])
    assert refused.exit_code == 2 and "do not go together" in refused.output  # (typer may colour the flags)
    assert len(calls) == 2


def test_example_configs_validate():
    paths = [p for p in sorted((ROOT / "examples").glob("*.yaml")) if not p.name.startswith("eval_")]
    assert paths
    for path in paths:  # training recipes (eval_*.yaml are evaluation specs)
        load_config(path)


@pytest.mark.parametrize("name", ["code_rl_cpu", "code_rl_gpu"])
def test_code_rl_recipes_load_and_their_environment_builds(name):
    """The code-RL recipes (the GPU one is not run here): the config loads, the code_tests environment takes its
    options, the sandbox section builds (nothing starts until first use)."""
    from agentrl.env.registry import EnvResources, default_registry

    cfg = load_config(ROOT / "examples" / f"{name}.yaml")
    assert cfg.env.name == "code_tests" and cfg.data.answer_key is None and cfg.rollout.budget.max_turns == 1
    env = default_registry.make_env(cfg.env.name, EnvResources(sandbox=object()), **cfg.env.options)
    assert env.reward.tests_of  # built: every option was a constructor argument
    if name == "code_rl_cpu":
        assert (ROOT / cfg.data.train).is_file() and cfg.sandbox.backend == "local"
    else:  # sandbox servers on CPU hosts, not the GPU node's own
        assert cfg.sandbox.backend == "remote" and cfg.sandbox.url


def test_bad_configs_say_what_is_wrong(tmp_path):
    with pytest.raises(ConfigError, match="n_samples"):
        load_config(None, ["rollout.n_samples=0"])
    with pytest.raises(ConfigError, match="bogus"):
        load_config(None, ["bogus=1"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="trainer"):
        load_config(None, ["trainer.loss.correction=magic"])
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(tmp_path / "list.yaml")


def test_trainer_scores_tokens_at_the_rollout_temperature():
    assert load_config(None, []).trainer.loss.temperature == 1.0  # T = 1: nothing to say
    cfg = load_config(None, ["rollout.temperature=1.3", "trainer.loss.kl_coef=0.1"])
    assert cfg.trainer.loss.kl_coef == 0.1 and cfg.trainer.loss.temperature == 1.3
    assert load_config(None, ["rollout.temperature=0.7", "trainer.loss.temperature=0.7"]).trainer.loss.temperature == 0.7
    greedy = load_config(None, ["rollout.temperature=0"]).trainer.loss
    assert greedy.temperature == 1.0 and "temperature" not in greedy.model_fields_set  # greedy: left alone
    with pytest.raises(ConfigError, match="rollout.temperature 0.7"):
        load_config(None, ["rollout.temperature=0.7", "trainer.loss.temperature=1.0"])
    with pytest.raises(ConfigError, match="top level"):
        load_config(None, ["trainer.model=tiny"])


def test_a_cosine_schedule_spans_the_run_unless_told_otherwise():
    """Without total_steps, cosine decays over the run's optimiser updates: steps x mini_batches."""
    opt = load_config(None, ["steps=12", "trainer.optimizer.schedule=cosine"]).trainer.optimizer
    assert opt.total_steps == 12
    cfg = load_config(None, ["steps=12", "trainer.mini_batches=3", "trainer.optimizer.schedule=cosine"])
    assert cfg.trainer.optimizer.total_steps == 36
    demo = load_config(None, ["trainer.optimizer.schedule=cosine", "steps=20"], base=recipes.DEMO)
    assert demo.trainer.optimizer.total_steps == 20 and demo.trainer.optimizer.lr == recipes.DEMO["trainer"]["optimizer"]["lr"]
    kept = load_config(None, ["steps=12", "trainer.optimizer.schedule=cosine", "trainer.optimizer.total_steps=5"])
    assert kept.trainer.optimizer.total_steps == 5  # given: kept
    assert load_config(None, ["steps=12"]).trainer.optimizer.total_steps is None  # constant: nothing to fill
    with pytest.raises(ConfigError, match="steps"):  # a malformed steps is refused by its own check
        load_config(None, ["steps=many", "trainer.optimizer.schedule=cosine"])


def test_the_saved_config_reads_back_as_the_same_run(tmp_path):
    cfg = load_config(None, ["rollout.temperature=1.3", "rollout.group_retries=5", "engine.dtype=float32",
                             "trainer.layout=padded"])
    save_config(cfg, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == cfg
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert saved["rollout"]["group_retries"] == 5 and "scheduler" not in saved["rollout"]  # flat, as written
    assert "model_path" not in saved["engine"]  # the run's `model`


def test_misspelt_keys_get_the_closest_known_one():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["rollout.n_sample=3", "trainer.optimzer.lr=1", "monitor.wandb.projct=x", "steps=0"])
    text = str(info.value)
    assert "rollout.n_sample: unknown key (did you mean 'rollout.n_samples'?)" in text
    assert "trainer.optimzer: unknown key (did you mean 'trainer.optimizer'?)" in text
    assert "monitor.wandb.projct: unknown key (did you mean 'monitor.wandb.project'?)" in text
    assert "steps: Input should be greater than or equal to 1 (got 0)" in text


#: a valid value other than the default, where "default + 1" (ints), "not default" (bools) or "default / 2"
#: (floats) would not do
OTHER = {"update_mode": "drain", "pause_mode": "abort", "max_dropped_per_queued": 1.5, "seed": 7, "stop": ["</x>"],
         "stop_token_ids": [5], "regex": "[0-9]+", "ebnf": 'root ::= "a"', "backend": "docker",
         "url": "http://127.0.0.1:9", "options": {"pool_size": 2}, "host": "127.0.0.2", "device": "cuda",
         "dtype": "float32", "context_length": 512, "base_gpu_id": 1, "mem_fraction_static": 0.5,
         "python": "/usr/bin/python3", "extra_args": ["--x"], "env": {"A": "1"}, "log_level": "info", "detokenizer": "process",
         "urls_file": "/srv/sandbox_servers.txt", "mmap_threshold_kb": 1024, "attention_fp32_max_keys": 256,
         "fleet": {"health_interval_s": 1.0, "health_timeout_s": 2.0, "failures_to_down": 3}}


def _other(name: str, default: object) -> object:
    if name in OTHER:
        return OTHER[name]
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 1
    assert isinstance(default, float), f"pick a value for {name} in OTHER"
    return default / 2


def _yaml(value: object) -> str:
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("\n...")


def _field_defaults(owner: type) -> dict[str, object]:
    defaults = owner()
    names = list(owner.model_fields) if hasattr(owner, "model_fields") else [f.name for f in dataclasses.fields(owner)]
    return {name: getattr(defaults, name) for name in names}


@pytest.mark.parametrize("section", [RolloutSection, EngineSection, GatewaySection])
def test_a_composed_sections_keys_have_one_owner_each(section):
    """Flat keys route to the first part that has them: two parts (or a part and the section) sharing a name would
    make one of them unreachable."""
    keys = section.yaml_keys()
    assert len(keys) == len(set(keys)), sorted(k for k in keys if keys.count(k) > 1)


def test_every_gateway_setting_is_a_gateway_key_or_has_its_owner_in_the_run():
    """The gateway's settings: `gateway:` keys, except the three the run takes from their owners (the model, the
    agent environment's tool parser, the episode budget's resumes; see tests/launcher/test_rollout_process.py)."""
    keys = GatewaySection.yaml_keys()
    assert set(keys) | GatewaySection.HIDDEN == set(GatewayConfig.model_fields)
    assert GatewaySection.HIDDEN == {"model_name", "tool_parser", "max_resumes"}
    for name, default in _field_defaults(GatewayConfig).items():
        if name in keys:
            value = _other(name, default)
            assert getattr(load_config(None, [f"gateway.{name}={_yaml(value)}"]).gateway.config, name) == value, name


@pytest.mark.parametrize(("section", "owner", "held"), [
    ("sandbox", SandboxConfig, lambda cfg: cfg.sandbox),
    ("rewards", RewardsConfig, lambda cfg: cfg.rewards),
])
def test_every_field_of_a_component_config_is_a_key_of_its_section(section, owner, held):
    """Each field of the component's own model is a YAML key, and setting it reaches the object the component is
    built from."""
    for name, default in _field_defaults(owner).items():
        value = _other(name, default)
        got = getattr(held(load_config(None, [f"{section}.{name}={_yaml(value)}"])), name)
        assert (got.model_dump() if isinstance(got, BaseModel) else got) == value, name  # a nested model: its keys


@pytest.mark.parametrize(("owner", "part"), [(RolloutConfig, "scheduler"), (SamplingParams, "sampling"),
                                             (EpisodeBudget, "budget")])
def test_every_rollout_knob_is_set_from_yaml(owner, part):
    """Every field of the scheduler's config, the sampling parameters and the episode budget is a `rollout:` key,
    and setting it reaches the very object that component receives."""
    defaults = owner()
    for f in dataclasses.fields(owner):
        value = _other(f.name, getattr(defaults, f.name))
        cfg = load_config(None, [f"rollout.{f.name}={yaml.safe_dump(value, default_flow_style=True).strip()}"])
        got = getattr(getattr(cfg.rollout, part), f.name)
        assert (list(got) if isinstance(got, tuple) else got) == value, f.name


@pytest.mark.parametrize(("owner", "part"), [(SGLangServerConfig, "server"), (PoolConfig, "pool"),
                                             (Timeouts, "timeouts")])
def test_every_engine_knob_is_set_from_yaml(owner, part):
    """Every field of the servers' settings (but model_path, the run's `model`), the pool's and the clients'
    deadlines is an `engine:` key, and setting it reaches the object the rollout process hands on."""
    assert EngineSection.HIDDEN == {"model_path"}
    for name, default in _field_defaults(owner).items():
        if name in EngineSection.HIDDEN:
            continue
        value = _other(name, default)
        got = getattr(getattr(load_config(None, [f"engine.{name}={_yaml(value)}"]).engine, part), name)
        assert got == value, name


#: values other than the default for the trainer's keys where _other's rule does not apply
TRAINER_OTHER = {"ref_model": "/models/ref", "malloc": "jemalloc", "layout": "padded", "dtype": "bf16", "activation_checkpointing": "auto",
                 "device": "cpu", "num_threads": 2, "logits_chunk_tokens": 256, "betas": [0.8, 0.9],
                 "schedule": "cosine", "total_steps": 10, "grad_clip": 0.5, "advantage": "rloo",
                 "loss_agg": "seq_mean_token_mean", "token_sum_norm": None, "correction": "tis", "proximal": "current",
                 "decoupled_weight_cap": 3.0, "kl_estimator": "k1", "max_staleness": 2, "stale_policy": "downweight",
                 "dropout": 0.05, "target_modules": ["q_proj", "v_proj"], "keep_gathered": True,
                 "pad_to_multiple_of": 16}


@pytest.mark.parametrize("part", ["", "optimizer.", "loss.", "lora."])
def test_every_trainer_knob_is_set_from_yaml(part):
    """Every field of the trainer's settings (and of its optimizer, loss and lora sections) is a `trainer:` key, and
    setting it reaches the TrainerConfig the trainer ranks are built from."""
    owner = {"": TrainerSettings, "optimizer.": OptimizerConfig, "loss.": LossConfig, "lora.": LoraConfig}[part]
    # cosine needs total_steps; the trainer's temperature must be the rollout's
    extra = {"optimizer.": ["trainer.optimizer.total_steps=10"], "loss.": ["rollout.temperature=0.5"]}.get(part, [])
    for name, default in _field_defaults(owner).items():
        if isinstance(default, OptimizerConfig | LossConfig) or (part, name) in {("loss.", "token_sum_norm"),
                                                                                  ("", "lora")}:
            continue  # sections (their own fields are checked) / valid only with loss_agg seq_mean_token_sum
        value = TRAINER_OTHER[name] if name in TRAINER_OTHER else _other(name, default)
        cfg = load_config(None, [f"trainer.{part}{name}={_yaml(value)}", *extra]).trainer.for_model("m")
        got = getattr(getattr(cfg, part.rstrip(".")) if part else cfg, name)
        assert (list(got) if isinstance(got, tuple) else got) == value, name
