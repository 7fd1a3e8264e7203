"""Leaner activations for the backward pass: the MLP and the RMSNorms keep fewer tensors, at the cost of a few
element-wise ops recomputed in the backward pass (``trainer.lean_activations``, on by default).

What autograd keeps by itself for one decoder layer of a Llama-style model, per token (``I`` the MLP's width, ``H``
the hidden size; SmolLM2-135M: 1,536 and 576):

- the gated MLP ``down(act(gate(x)) * up(x))``: ``x``, ``g = gate(x)`` (the activation's input), ``act(g)`` and
  ``u = up(x)`` (the product's inputs), ``h = act(g) * u`` (the down projection's input): four ``I``-wide tensors.
  :class:`_ActMulLinear` runs the product and the down projection as one op that keeps ``g`` and ``u`` only and
  recomputes ``act(g)`` and ``h`` in its backward pass (two element-wise ops over ``I``: next to nothing beside the
  layer's matmuls): two of the four. Where the down projection is not a plain ``nn.Linear`` (a LoRA layer),
  only the product is recomputed (:class:`_Recompute`): one of the four.
- each RMSNorm (two a layer): its fp32 input (in bf16 an fp32 copy of it) and the normalised value before the
  weight; with :class:`_Recompute` only its input, in its own dtype: ``H`` floats less a norm (``2H`` bytes of
  ``6H`` in bf16).

For SmolLM2-135M in fp32 the decoder then keeps 0.83 MB a token instead of 1.34 (-38 %; measured by
:func:`agentrl.trainer.model.activation_bytes_per_token`, which sees these ops' saved tensors as any other's).

Why written here and not taken from a library: Liger-Kernel's fused SwiGLU and RMSNorm do this for GPUs in Triton,
which does not run on a CPU; PyTorch's own ``torch.utils.checkpoint`` around the element-wise part would recompute
the down projection's matmul too (a third of the MLP's FLOPs) and keeps its inputs outside autograd's saved-tensor
hooks, where the activation probe cannot count them.

Exactness: the forward pass runs the very ops of the module it replaces (each module is checked against its own
forward on a random input, in eval and training mode, before it is patched; one that computes otherwise, such as
Gemma's ``1 + weight`` norm, an MLP with a dropout or an activation with parameters, keeps its own). The recomputed parts' gradients come from autograd over the same ops, so they are the same
bits; the down projection's two matmuls are written out (``grad_h = grad_y W``, ``grad_W = grad_y^T h``) and equal
autograd's to float rounding (tests/trainer/test_lean_activations.py). Passes without gradients (reference,
scoring) run the module's plain code.
"""

from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable
from torch.nn.modules import module as nn_module

logger = logging.getLogger(__name__)


class _Recompute(torch.autograd.Function):
    """``fn(*args)`` keeping only ``args`` for the backward pass, which runs ``fn`` again under autograd: for
    element-wise ``fn`` whose intermediates cost more memory than their recomputation costs time."""

    @staticmethod
    def forward(ctx: Any, fn: Callable[..., Tensor], *args: Tensor | None) -> Tensor:
        ctx.fn = fn
        ctx.save_for_backward(*args)
        return fn(*args)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        wants = ctx.needs_input_grad[1:]
        args = [None if a is None else a.detach().requires_grad_(w) for a, w in zip(ctx.saved_tensors, wants)]
        with torch.enable_grad():
            out = ctx.fn(*args)
        leaves = [a for a in args if a is not None and a.requires_grad]
        grads = iter(torch.autograd.grad(out, leaves, grad) if leaves else ())
        return (None, *(next(grads) if a is not None and a.requires_grad else None for a in args))


class _ActMulLinear(torch.autograd.Function):
    """``F.linear(act(g) * u, weight, bias)`` keeping ``g``, ``u`` and the weight: ``act(g)`` and the product are
    recomputed in the backward pass, the linear's gradients written out."""

    @staticmethod
    def forward(ctx: Any, g: Tensor, u: Tensor, weight: Tensor, bias: Tensor | None,
                act: Callable[[Tensor], Tensor]) -> Tensor:
        ctx.act = act
        ctx.has_bias = bias is not None
        ctx.save_for_backward(g, u, weight)
        return F.linear(act(g) * u, weight, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_y: Tensor) -> tuple[Tensor | None, ...]:
        g, u, weight = ctx.saved_tensors
        need_g, need_u, need_w, need_b = ctx.needs_input_grad[:4]
        g_ = g.detach().requires_grad_(need_g)
        u_ = u.detach().requires_grad_(need_u)
        with torch.enable_grad():
            h = ctx.act(g_) * u_
        flat = grad_y.reshape(-1, grad_y.shape[-1])
        grad_w = flat.t().mm(h.detach().reshape(-1, h.shape[-1])) if need_w else None
        grad_b = flat.sum(0) if need_b and ctx.has_bias else None
        grad_g = grad_u = None
        if need_g or need_u:
            grad_h = grad_y.matmul(weight)
            leaves = [t for t in (g_, u_) if t.requires_grad]
            got = iter(torch.autograd.grad(h, leaves, grad_h))
            grad_g = next(got) if need_g else None
            grad_u = next(got) if need_u else None
        return grad_g, grad_u, grad_w, grad_b, None


def _act_mul(act: Callable[[Tensor], Tensor], g: Tensor, u: Tensor) -> Tensor:
    return act(g) * u


def _plain_linear(m: nn.Module) -> bool:
    """A plain ``nn.Linear`` with no hooks (its own or global): one whose call is exactly ``F.linear``."""
    return type(m) is nn.Linear and not (
        m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
        or nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks
        or nn_module._global_backward_hooks or nn_module._global_backward_pre_hooks)


def _mlp_forward(self: Any, x: Tensor) -> Tensor:
    g = self.gate_proj(x)
    u = self.up_proj(x)
    if not torch.is_grad_enabled():
        return self.down_proj(self.act_fn(g) * u)
    down = self.down_proj
    if _plain_linear(down):
        return _ActMulLinear.apply(g, u, down.weight, down.bias, self.act_fn)
    return down(_Recompute.apply(functools.partial(_act_mul, self.act_fn), g, u))


def _rms(eps: float, x: Tensor, weight: Tensor) -> Tensor:
    """Llama's RMSNorm as a function (the ops of ``LlamaRMSNorm.forward``, in its order)."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def _norm_eps(m: nn.Module) -> float | None:
    eps = getattr(m, "variance_epsilon", getattr(m, "eps", None))
    return float(eps) if isinstance(eps, float) else None


def _norm_forward(self: Any, x: Tensor) -> Tensor:
    fn = self.__dict__["_lean_norm"]
    if not torch.is_grad_enabled():
        return fn(x, self.weight)
    return _Recompute.apply(fn, x, self.weight)


def _is_gated_mlp(m: nn.Module) -> bool:
    """gate, up and down projections and an activation, every parameter in the three (an activation with parameters
    of its own, such as xIELU's, would get no gradient through the lean forward)."""
    parts = ("gate_proj", "up_proj", "down_proj")
    return (all(isinstance(getattr(m, a, None), nn.Module) for a in parts) and callable(getattr(m, "act_fn", None))
            and all(name.split(".", 1)[0] in parts for name, _ in m.named_parameters()))


def _is_rms_norm(m: nn.Module) -> bool:
    w = getattr(m, "weight", None)
    return (type(m).__name__.endswith("RMSNorm") and isinstance(w, nn.Parameter) and w.dim() == 1
            and _norm_eps(m) is not None and [n for n, _ in m.named_parameters()] == ["weight"])


def _same_forward(m: nn.Module, lean: Callable[[Any, Tensor], Tensor], width: int, dtypes: tuple[torch.dtype, ...]
                  ) -> bool:
    """The lean forward gives the module's own outputs, bit for bit, on a random input in each of ``dtypes``, with
    and without gradients, in eval and in training mode (the same random state for both calls: a dropout the lean
    forward would skip shows). ``m`` is checked as it is, its mode restored after."""
    training = m.training
    gen = torch.Generator().manual_seed(0)
    try:
        for dtype in dtypes:
            x = torch.randn(2, 3, width, generator=gen).to(dtype)
            for mode in (False, True):
                m.train(mode)
                for grad in (False, True):
                    with torch.set_grad_enabled(grad), torch.random.fork_rng(devices=[]):
                        torch.manual_seed(1)
                        own = type(m).forward(m, x)
                        torch.manual_seed(1)
                        got = lean(m, x)
                    if not (isinstance(own, Tensor) and isinstance(got, Tensor) and torch.equal(own, got)):
                        return False
        return True
    finally:
        m.train(training)


def _check(m: nn.Module, kind: str, lean: Callable[[Any, Tensor], Tensor]) -> bool:
    """Whether ``m`` computes what its lean forward computes: :func:`_same_forward` on the module itself for an MLP
    (in its parameters' dtype, its weights as loaded: no copy of a large module), on a copy with random weights for a norm (a norm's
    weight may be all ones, which would hide a ``1 + weight`` form; the copy is one vector) in fp32 and bf16 (where
    the order of the cast and the weight's product shows). Anything the check raises (a forward that returns a
    tuple or wants more arguments) means no."""
    try:
        if kind == "mlp":
            gate = m.gate_proj
            width = getattr(gate, "in_features", None)
            dtype = next(m.parameters()).dtype
            return isinstance(width, int) and _same_forward(m, lean, width, (dtype,))
        probe = copy.deepcopy(m).float()
        with torch.no_grad():
            for p in probe.parameters():
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.1 + 1.0)
        width = int(m.weight.shape[0])  # type: ignore[index]
        return all(_same_forward(probe.to(dt), lean, width, (dt,)) for dt in (torch.float32, torch.bfloat16))
    except Exception as exc:  # noqa: BLE001 - any failure of the check keeps the module's own forward
        logger.debug("lean activations: checking %s raised %r", type(m).__name__, exc)
        return False


def apply(lm: nn.Module) -> dict[str, int]:
    """Give ``lm``'s gated MLPs and RMSNorms the lean forward, in place (an instance attribute: the class and other
    models are untouched), each module that passes :func:`_check` (every instance: modules of one class may differ
    by their settings). Before FSDP and LoRA wrap the model: the forward looks its linears up at each call, so it
    runs whatever wraps them later. Returns how many modules of each kind were patched; the classes with a module
    left as it is are logged."""
    counts = {"mlp": 0, "norm": 0}
    kept: set[str] = set()
    lean: Callable[[Any, Tensor], Tensor]
    for m in lm.modules():
        # the lean forward is a partial of a module-level function, not a bound method (which pickle cannot take): a
        # patched module pickles, and a copy runs its own weights; a norm's function is bound to its eps here once
        if _is_gated_mlp(m):
            kind, lean = "mlp", _mlp_forward
        elif _is_rms_norm(m):
            m.__dict__["_lean_norm"] = functools.partial(_rms, cast(float, _norm_eps(m)))  # a float: _is_rms_norm
            kind, lean = "norm", _norm_forward
        else:
            continue
        if _check(m, kind, lean):
            m.forward = functools.partial(lean, m)  # type: ignore[method-assign]
            counts[kind] += 1
        else:
            kept.add(type(m).__name__)
    if kept:
        logger.info("lean activations: %s keep their own forward (they compute differently)", ", ".join(sorted(kept)))
    return counts
