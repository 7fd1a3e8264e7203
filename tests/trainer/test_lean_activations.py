"""Lean activations (agentrl.trainer.lean_activations) on the real tiny model: the same outputs and gradients as the
model's own forward, fewer bytes kept for the backward pass (by exactly the tensors it recomputes), the LoRA path,
and a norm that computes differently left as it is."""

from __future__ import annotations

import copy
import functools
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


def _rms_module(name: str, form: str) -> nn.Module:
    """An RMSNorm named ``name`` computing Llama's form, Gemma's ``1 + weight``, or Llama's with the weight's product
    taken in fp32 before the cast (the same in fp32, not in bf16)."""

    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        if form == "llama":
            return self.weight * h.to(x.dtype)
        if form == "one_plus":
            return (h * (1.0 + self.weight.float())).to(x.dtype)
        return (self.weight.float() * h).to(x.dtype)

    def init(self: nn.Module) -> None:
        nn.Module.__init__(self)
        self.weight = nn.Parameter(torch.ones(8))
        self.variance_epsilon = 1e-6

    return type(name, (nn.Module,), {"__init__": init, "forward": forward})()


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_patched_model_copies_and_pickles_with_its_lean_forward_bound_to_the_copy(tiny, how: str) -> None:
    """The lean forward and the function it recomputes belong to the module (partials of module functions): a deep copy or a pickled copy runs its own weights, the same outputs and gradients as the original,
    and changing the copy leaves the original alone."""
    import io
    import pickle

    lean = copy.deepcopy(tiny).train()
    lean_activations.apply(lean)
    if how == "deepcopy":
        twin = copy.deepcopy(lean)
    else:
        buf = io.BytesIO()
        pickle.dump(lean, buf)
        twin = pickle.loads(buf.getvalue())
    for layer in twin.model.layers:  # the copy still runs the lean forward, bound to its own modules
        for m in (layer.mlp, layer.input_layernorm):
            assert isinstance(m.forward, functools.partial) and m.forward.args[0] is m
    assert twin.model.layers[0].mlp.forward.func is lean_activations._mlp_forward
    assert twin.model.norm.forward.func is lean_activations._norm_forward
    assert twin.model.norm.__dict__["_lean_norm"].args == (tiny.config.rms_norm_eps,)
    ids = torch.randint(0, tiny.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(2))
    loss_a, grads_a = _loss_and_grads(lean, ids)
    loss_b, grads_b = _loss_and_grads(twin, ids)
    assert torch.equal(loss_a, loss_b) and grads_a.keys() == grads_b.keys()
    for name, g in grads_a.items():
        assert torch.equal(grads_b[name], g), name
    with torch.no_grad():
        for p in twin.model.layers[0].mlp.parameters():
            p.mul_(2.0)
    assert not torch.equal(_loss_and_grads(twin, ids)[0], loss_a)
    assert torch.equal(_loss_and_grads(lean, ids)[0], loss_a)


def test_only_norms_in_llamas_form_are_patched() -> None:
    model = nn.ModuleList([_rms_module("MyRMSNorm", "llama"), _rms_module("GemmaLikeRMSNorm", "one_plus"),
                           _rms_module("CastLastRMSNorm", "cast_last")])
    assert lean_activations.apply(model) == {"mlp": 0, "norm": 1}
    assert ["forward" in m.__dict__ for m in model] == [True, False, False]


class _MLP(nn.Module):
    def __init__(self, act: nn.Module | None = None, dropout: float = 0.0, tuple_out: bool = False) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 8)
        self.act_fn = act or nn.SiLU()
        self.dropout = nn.Dropout(dropout)
        self.tuple_out = tuple_out

    def forward(self, x: torch.Tensor):
        y = self.dropout(self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x)))
        return (y, None) if self.tuple_out else y


def test_mlps_that_compute_otherwise_keep_their_forward() -> None:
    """A dropout (the same in eval mode, not in training), an activation with parameters of its own (which the
    lean forward would not train), a forward returning a tuple (the check must not raise): kept; the plain one and a
    dropout of 0: patched."""
    mlps = nn.ModuleList([_MLP(), _MLP(dropout=0.0), _MLP(dropout=0.1), _MLP(act=nn.PReLU()), _MLP(tuple_out=True)])
    assert lean_activations.apply(mlps) == {"mlp": 2, "norm": 0}
    assert ["forward" in m.__dict__ for m in mlps] == [True, True, False, False, False]
    assert all(not m.training for m in mlps.eval()) and all(m.training for m in mlps.train())  # modes restored


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(5,), (2, 3)])
def test_the_down_projections_written_out_gradients_pass_gradcheck(bias: bool, shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(2)
    g, u = (torch.randn(*shape, 6, generator=gen, dtype=torch.float64) for _ in range(2))
    w = torch.randn(4, 6, generator=gen, dtype=torch.float64)
    b = torch.randn(4, generator=gen, dtype=torch.float64) if bias else None
    act = torch.nn.functional.silu
    for wants in [(True, True, True, True), (True, False, False, True), (False, True, True, False),
                  (False, False, True, True)]:
        args = [t.clone().requires_grad_(want) if t is not None else None for t, want in zip((g, u, w, b), wants)]
        assert torch.autograd.gradcheck(lambda *a: lean_activations._ActMulLinear.apply(*a, act), args)
    # a non-contiguous upstream gradient: the same gradients as autograd's own linear
    args = [t.clone().requires_grad_() if t is not None else None for t in (g, u, w, b)]
    ref = [t.clone().requires_grad_() if t is not None else None for t in (g, u, w, b)]
    grad = torch.randn(4, *shape, generator=gen, dtype=torch.float64).movedim(0, -1)
    assert not grad.is_contiguous()
    lean_activations._ActMulLinear.apply(*args, act).backward(grad)
    torch.nn.functional.linear(act(ref[0]) * ref[1], ref[2], ref[3]).backward(grad)
    for a, r in zip(args, ref):
        if a is not None:
            torch.testing.assert_close(a.grad, r.grad)


def test_recompute_passes_gradcheck() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, generator=gen, dtype=torch.float64, requires_grad=True)
    def fn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # element-wise, in the inputs' dtype
        return torch.nn.functional.silu(a) * b

    assert torch.autograd.gradcheck(lambda a, b: lean_activations._Recompute.apply(fn, a, b), (x, w))


# bf16 with attention's precision pinned: `auto` times both ways at each trainer's start, and may choose differently
@pytest.mark.parametrize("setting", [{}, {"dtype": "bf16", "attention_fp32_max_keys": 0},
                                     {"activation_checkpointing": True},
                                     {"lora": {"r": 4, "alpha": 12.0, "target_modules": "all-linear"}}])
def test_a_trainer_step_is_the_same_with_and_without(tiny_config, setting: dict) -> None:
    """Under FSDP2 as the trainer runs it: fp32, bf16 mixed precision, whole layers recomputed around the lean ops,
    and real peft LoRA on every linear (the down projection is peft's wrapper: the product-only path)."""
    batch = random_batch(3)
    got = {}
    for lean in (False, True):
        with Trainer(tiny_config(lr=1e-2, lean_activations=lean, micro_batch_tokens=40, **setting)) as tr:
            mlps = [m for m in tr._policy.modules() if type(m).__name__.endswith("MLP")]
            assert mlps and all(("forward" in m.__dict__) is lean for m in mlps)
            if "lora" in setting:
                assert all(type(m.down_proj).__module__.startswith("peft.") for m in mlps)
            got[lean] = tr.rl_step(batch, current_version=0)
    assert got[True].loss == got[False].loss  # the forward runs the same ops
    assert got[True].grad_norm == pytest.approx(got[False].grad_norm, rel=1e-5)
