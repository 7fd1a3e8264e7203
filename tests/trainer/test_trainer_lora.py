"""LoRA (``trainer.lora``) on the real tiny model: only the adapters train, the published weights are the merged
``W + B A alpha / r`` under the base model's names, the reference is the base model, checkpoints hold the adapters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from pydantic import ValidationError
from safetensors.torch import load_file
from trainer_helpers import hf_logprobs, random_batch
from transformers import AutoModelForCausalLM

from agentrl.errors import ConfigError, TrainerError
from agentrl.trainer import LoraConfig, Trace, Trainer, TrainerSettings
from agentrl.trainer.lora import merge_lora

LORA = {"r": 4, "alpha": 12.0}  # scaling 3: a wrong scaling would show


def _adapters(tr: Trainer) -> dict[str, torch.Tensor]:
    """The trainer's LoRA parameters (world size 1: the local shard is the whole tensor), by module prefix."""
    return {name.removeprefix("lm."): p.detach().full_tensor().clone() if hasattr(p, "full_tensor") else p.detach()
            for name, p in tr._policy.named_parameters() if ".lora_" in name}


@pytest.mark.parametrize("bad", [{"r": 0}, {"alpha": 0}, {"dropout": 1.0}, {"dropout": -0.1}, {"target_modules": []},
                                 {"target_modules": ["q_proj", "q_proj"]}, {"target_modules": "q_proj"},
                                 {"rank": 8}])
def test_bad_lora_settings_are_refused(bad: dict) -> None:
    with pytest.raises(ValidationError):
        TrainerSettings.model_validate({"lora": bad})


def test_lora_defaults_and_override_shape() -> None:
    s = TrainerSettings.model_validate({"lora": {"r": 8}})  # what `trainer.lora.r=8` on the command line gives
    assert s.lora == LoraConfig(r=8, alpha=32.0, dropout=0.0, target_modules="all-linear")
    assert s.lora.scaling == 4.0 and TrainerSettings().lora is None
    assert TrainerSettings.model_validate({"lora": {"target_modules": ["q_proj", "v_proj"]}}).lora.target_modules == (
        "q_proj", "v_proj")


def test_unknown_target_module_lists_what_exists(tiny_config) -> None:
    with pytest.raises(ConfigError) as err:
        Trainer(tiny_config(lora={"target_modules": ["q_proj", "qkv"]}))
    msg = str(err.value)
    assert "['qkv']" in msg and "'q_proj'" in msg and "'down_proj'" in msg and "'lm_head'" not in msg


def test_only_adapters_train_and_the_base_stays_frozen(tiny_config, hf_tiny) -> None:
    with Trainer(tiny_config(lr=1e-2, lora={**LORA, "target_modules": ["q_proj", "v_proj"]})) as tr:
        trainable = {n for n, p in tr._policy.named_parameters() if p.requires_grad}
        in_optimizer = {id(p) for g in tr._optimizer.param_groups for p in g["params"]}
        assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
        assert {n.split(".")[-4] for n in trainable} == {"q_proj", "v_proj"}
        assert in_optimizer == {id(p) for p in tr._policy.parameters() if p.requires_grad}
        before = {n: p.detach().clone() for n, p in tr._policy.named_parameters() if not p.requires_grad}
        for v in range(2):
            tr.rl_step(random_batch(v), current_version=v)
        for n, p in tr._policy.named_parameters():
            if not p.requires_grad:
                assert torch.equal(p.detach(), before[n]), n
        assert any(a.abs().sum() > 0 for n, a in _adapters(tr).items() if ".lora_B." in n), "B left its zeros"


def test_published_weights_are_base_plus_scaled_b_a(tiny_config, tiny_model_path: Path, tmp_path: Path) -> None:
    """export_hf (disk) and full_state_dict (distributed sync) give W + B A alpha / r under the base model's names,
    equal to the formula on the base checkpoint's W and the trainer's A and B; HF loads them and scores like the
    LoRA model; the training model is unchanged by publishing."""
    batch = random_batch(2, n=6)
    out = tmp_path / "v2"
    with Trainer(tiny_config(lr=1e-2, lora=LORA)) as tr:
        for v in range(2):
            tr.rl_step(batch, current_version=v)
        mine = tr.logprobs(batch)
        tr.export_hf(out)
        sd = tr.full_state_dict()
        adapters = _adapters(tr)
        assert torch.equal(torch.cat(tr.logprobs(batch)), torch.cat(mine))  # not merged in place
    base = load_file(str(tiny_model_path / "model.safetensors"))
    published = load_file(str(out / "model.safetensors"))
    assert set(published) == set(sd) == set(base)  # base names: no base_layer., no lora_ tensors
    merged = 0
    for key, w in base.items():
        prefix = key.removesuffix(".weight")
        a = adapters.get(f"{prefix}.lora_A.default.weight")
        expected = w if a is None else w + adapters[f"{prefix}.lora_B.default.weight"] @ a * (12.0 / 4)
        merged += a is not None
        torch.testing.assert_close(published[key], expected, rtol=0, atol=1e-6)
        torch.testing.assert_close(sd[key], expected, rtol=0, atol=1e-6)
    assert merged == 7 * 2  # all-linear: q k v o gate up down in each of the tiny model's 2 layers
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    for t, lp in zip(batch, mine):
        torch.testing.assert_close(hf_logprobs(model, t.token_ids, t.loss_mask), lp, atol=2e-5, rtol=0)


def test_merge_lora_formula_on_a_hand_made_state_dict() -> None:
    w, bias = torch.randn(6, 5), torch.randn(6)
    a, b = torch.randn(2, 5), torch.randn(6, 2)
    sd = {"x.base_layer.weight": w, "x.base_layer.bias": bias, "x.lora_A.default.weight": a,
          "x.lora_B.default.weight": b, "norm.weight": torch.ones(5)}
    out = merge_lora(sd, 0.5)
    assert set(out) == {"x.weight", "x.bias", "norm.weight"}
    torch.testing.assert_close(out["x.weight"], w + 0.5 * b @ a)
    assert out["x.bias"] is bias and sd["x.base_layer.weight"] is w


def test_reference_is_the_base_model_without_a_second_copy(tiny_config, hf_tiny) -> None:
    batch = random_batch(4, n=6)
    with Trainer(tiny_config(lr=1e-2, lora=LORA, loss={"kl_coef": 0.1})) as tr:
        assert tr.has_reference and tr._ref is None
        first = tr.rl_step(batch, current_version=0)
        for v in range(1, 3):
            last = tr.rl_step(batch, current_version=v)
        with tr._policy.adapters_disabled():
            base = tr.logprobs(batch)
        trained = tr.logprobs(batch)
    assert first.kl == pytest.approx(0.0, abs=1e-9) and last.kl > 1e-6
    for t, lp in zip(batch, base):
        torch.testing.assert_close(lp, hf_logprobs(hf_tiny, t.token_ids, t.loss_mask), atol=2e-5, rtol=0)
    assert any(not torch.allclose(lp, lt, atol=1e-4) for lp, lt in zip(base, trained))


def test_checkpoint_holds_adapters_and_their_optimizer_state_and_resumes(tiny_config, tmp_path: Path) -> None:
    ckpt = tmp_path / "step_2"
    with Trainer(tiny_config(lr=1e-2, lora=LORA)) as tr:
        for v in range(2):
            tr.rl_step(random_batch(v), current_version=v)
        tr.save_checkpoint(ckpt)
        saved = _adapters(tr)
        expected = tr.logprobs(random_batch(9))
        after = tr.rl_step(random_batch(5), current_version=2)
    keys = set(dcp.FileSystemReader(str(ckpt / "state")).read_metadata().state_dict_metadata)
    model_keys = {k.removeprefix("model.") for k in keys if k.startswith("model.")}
    assert model_keys == {f"lm.{k}" for k in saved}, "the frozen base is not in the checkpoint"
    assert any(k.startswith("optim.state.") and k.endswith("exp_avg") for k in keys)
    assert json.loads((ckpt / "trainer_state.json").read_text())["lora"] == {
        "r": 4, "alpha": 12.0, "target_modules": "all-linear"}
    with Trainer(tiny_config(lr=1e-2, lora=LORA)) as tr:
        tr.load_checkpoint(ckpt)
        assert (tr.step, tr.weight_version) == (2, 2)
        for k, v in _adapters(tr).items():
            assert torch.equal(v, saved[k]), k
        for x, y in zip(expected, tr.logprobs(random_batch(9))):
            torch.testing.assert_close(x, y, rtol=0, atol=0)
        again = tr.rl_step(random_batch(5), current_version=2)  # optimiser moments restored: the same update
    assert again.loss == pytest.approx(after.loss, abs=1e-7) and again.grad_norm == pytest.approx(after.grad_norm)
    with Trainer(tiny_config(lr=1e-2)) as full, pytest.raises(TrainerError, match="LoRA adapters"):
        full.load_checkpoint(ckpt)
    with Trainer(tiny_config(lr=1e-2, lora={"r": 8})) as other, pytest.raises(TrainerError, match="trainer.lora"):
        other.load_checkpoint(ckpt)


def test_sft_with_lora_lowers_the_loss_and_exports_merged_weights(tiny_config, tmp_path: Path) -> None:
    trajs = random_batch(11, n=6)
    traces = [Trace(t.token_ids, t.loss_mask) for t in trajs]
    with Trainer(tiny_config(lr=1e-2, lora=LORA, micro_batch_tokens=64)) as tr:
        losses = [tr.sft_step(traces).loss for _ in range(6)]
        tr.export_hf(tmp_path / "v0")
        mine = tr.logprobs(traces)
    assert losses[-1] < losses[0] - 0.2, losses
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "v0"), dtype=torch.float32).eval()
    for t, lp in zip(traces, mine):
        torch.testing.assert_close(hf_logprobs(model, t.token_ids, t.loss_mask), lp, atol=2e-5, rtol=0)


def test_merge_lora_consumes_its_input_and_casts_when_asked() -> None:
    w, a, b = torch.randn(6, 5, dtype=torch.bfloat16), torch.randn(2, 5), torch.randn(6, 2)
    sd = {"x.base_layer.weight": w, "x.lora_A.default.weight": a, "x.lora_B.default.weight": b,
          "norm.weight": torch.ones(5), "step": torch.tensor(3)}
    out = merge_lora(sd, 0.5, torch.float16, consume=True)
    assert sd == {}, "each entry leaves the input as it is merged"
    assert out["x.weight"].dtype == out["norm.weight"].dtype == torch.float16 and out["step"].dtype == torch.int64
    torch.testing.assert_close(out["x.weight"], (w.float() + 0.5 * b @ a).half())


def test_lora_in_bf16_keeps_a_bf16_base_and_fp32_adapters(tiny_config, tiny_model_path: Path, tmp_path: Path) -> None:
    """Computing in bf16, the frozen base needs no fp32 copy (half its RAM): only the adapters (what the optimiser
    updates) stay fp32. It trains (also when a reference pass with the adapters off comes first), the base does not
    move, and the published weights are the bf16 base + B A s."""
    batch = random_batch(3, n=6)
    # with a KL term the first forward is the reference pass (adapters off): FSDP2 fixes its dtypes there
    with Trainer(tiny_config(lr=1e-2, lora=LORA, dtype="bf16", loss={"kl_coef": 0.05})) as tr:
        dtypes = {n: p.dtype for n, p in tr._policy.named_parameters()}
        assert {d for n, d in dtypes.items() if ".lora_" in n} == {torch.float32}
        assert {d for n, d in dtypes.items() if ".lora_" not in n} == {torch.bfloat16}
        before = {n: p.detach().clone() for n, p in tr._policy.named_parameters() if not p.requires_grad}
        losses = [tr.rl_step(batch, current_version=v).loss for v in range(3)]
        for n, p in tr._policy.named_parameters():
            if not p.requires_grad:
                assert torch.equal(p.detach(), before[n]), n
        adapters = _adapters(tr)
        sd = tr.full_state_dict(torch.bfloat16)
        tr.export_hf(tmp_path / "v3", torch.bfloat16)
    assert all(torch.isfinite(torch.tensor(x)) for x in losses)
    assert any(a.abs().sum() > 0 for n, a in adapters.items() if ".lora_B." in n), "B left its zeros"
    base = load_file(str(tiny_model_path / "model.safetensors"))
    published = load_file(str(tmp_path / "v3" / "model.safetensors"))
    assert set(published) == set(sd) == set(base)
    for key, w in base.items():
        prefix = key.removesuffix(".weight")
        a = adapters.get(f"{prefix}.lora_A.default.weight")
        w16 = w.to(torch.bfloat16).float()  # the base as the trainer holds it
        expected = (w16 if a is None else w16 + adapters[f"{prefix}.lora_B.default.weight"] @ a * (12.0 / 4))
        assert published[key].dtype == sd[key].dtype == torch.bfloat16, key
        torch.testing.assert_close(published[key], expected.to(torch.bfloat16), rtol=0, atol=0)
        torch.testing.assert_close(sd[key], expected.to(torch.bfloat16), rtol=0, atol=0)
