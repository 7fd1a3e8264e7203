"""Lean activations (agentrl.trainer.lean_activations) on the real tiny model: the same outputs and gradients as the
model's own forward, fewer bytes kept for the backward pass (by exactly the tensors it recomputes), the LoRA path,
and a norm that computes differently left as it is."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn
from trainer_helpers import random_batch

from agentrl.trainer import Trainer, lean_activations
from agentrl.trainer.model import activation_bytes_per_token, load_lm


@pytest.fixture(scope="module")
def tiny(tiny_model_path: Path):
    return load_lm(tiny_model_path)


def _loss_and_grads(lm: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    lm.zero_grad(set_to_none=True)
    logits = lm(input_ids=ids).logits.float()
    loss = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:])
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in lm.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_same_loss_and_gradients_as_the_models_own_forward(tiny, dtype: torch.dtype) -> None:
    plain = copy.deepcopy(tiny).to(dtype).train()
    lean = copy.deepcopy(tiny).to(dtype).train()
    cfg = tiny.config
    assert lean_activations.apply(lean) == {"mlp": cfg.num_hidden_layers, "norm": 2 * cfg.num_hidden_layers + 1}
    ids = torch.randint(0, cfg.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    loss_p, grads_p = _loss_and_grads(plain, ids)
    loss_l, grads_l = _loss_and_grads(lean, ids)
    assert torch.equal(loss_p, loss_l)  # the forward runs the same ops
    assert grads_p.keys() == grads_l.keys() and len(grads_p) == len(list(plain.parameters()))
    # recomputed element-wise parts: autograd over the same ops; the down projection's matmuls written out
    tol = {"rtol": 1e-5, "atol": 1e-7} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 1e-4}
    for name, g in grads_p.items():
        torch.testing.assert_close(grads_l[name], g, **tol, msg=name)


def test_the_backward_pass_keeps_exactly_the_recomputed_tensors_less(tiny) -> None:
    """fp32: each MLP keeps act(g) and act(g) * u less (two intermediate-wide tensors), each RMSNorm its normalised
    value (hidden-wide): the activation probe sees precisely that difference."""
    lean = copy.deepcopy(tiny).train()
    before = activation_bytes_per_token(lean)
    lean_activations.apply(lean)
    after = activation_bytes_per_token(lean)
    cfg = tiny.config
    layers, hidden, inter = cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size
    expected = 4 * (layers * (2 * inter + 2 * hidden) + hidden)
    assert before - after == pytest.approx(expected, rel=0.02), (before, after, expected)


def test_a_down_projection_that_is_not_a_plain_linear_recomputes_the_product_only(tiny) -> None:
    """LoRA wraps the linears: the down projection is then called as the module it is (its hooks run), the
    activation times up recomputed; loss and gradients as the plain model's."""
    plain = copy.deepcopy(tiny).train()
    lean = copy.deepcopy(tiny).train()
    lean_activations.apply(lean)
    calls = []
    for m in (plain, lean):
        for layer in m.model.layers:
            layer.mlp.down_proj.register_forward_hook(lambda *_, m=m: calls.append(m))
    ids = torch.randint(0, tiny.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1))
    loss_p, grads_p = _loss_and_grads(plain, ids)
    loss_l, grads_l = _loss_and_grads(lean, ids)
    assert sum(c is lean for c in calls) == tiny.config.num_hidden_layers  # the module ran, hooks and all
    assert torch.equal(loss_p, loss_l)
    for name, g in grads_p.items():
        torch.testing.assert_close(grads_l[name], g, rtol=1e-5, atol=1e-7, msg=name)


class _OnePlusNorm(nn.Module):
    """Gemma's form of RMSNorm (``1 + weight``): not Llama's, so it must keep its own forward."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n))
        self.variance_epsilon = 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


def test_a_norm_that_computes_differently_keeps_its_own_forward() -> None:
    _OnePlusNorm.__name__ = "GemmaLikeRMSNorm"
    model = nn.Sequential(_OnePlusNorm(8))
    assert lean_activations.apply(model) == {"mlp": 0, "norm": 0}
    assert "forward" not in model[0].__dict__


def test_a_trainer_step_is_the_same_with_and_without(tiny_config) -> None:
    batch = random_batch(3)
    got = {}
    for lean in (False, True):
        with Trainer(tiny_config(lr=1e-2, lean_activations=lean, micro_batch_tokens=40)) as tr:
            mlps = [m for m in tr._policy.modules() if type(m).__name__.endswith("MLP")]
            assert mlps and all(("forward" in m.__dict__) is lean for m in mlps)
            got[lean] = tr.rl_step(batch, current_version=0)
    assert got[True].loss == pytest.approx(got[False].loss, abs=1e-7)
    assert got[True].grad_norm == pytest.approx(got[False].grad_norm, rel=1e-5)
