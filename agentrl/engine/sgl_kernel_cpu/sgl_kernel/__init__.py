"""A pure-PyTorch stand-in for the ``sgl_kernel`` package, for SGLang's CPU path only.

PyPI's ``sglang-kernel`` is CUDA-only and there is no CPU build, yet SGLang's CPU code imports a few names from
it. agentrl puts this directory on the ``PYTHONPATH`` of the SGLang server processes it starts on CPU (never on
its own import path). It implements only what the torch-native CPU path needs:

- ``assign_req_to_token_pool_cpu``: write each request's new KV-cache slot indices into the request→token table.

Importing it also installs CPU fast paths into SGLang (``_fast_paths``): decode attention compiled on this machine
(``_native``, ``_attention.cpp``; batched PyTorch where it cannot be built), batched prefill (extend) attention and a
faster exact sampler; and, when the launcher asks for it in the environment, the scheduler's
borrowing of the trainer's cores while the trainer waits (``_borrow``).

Every other name imports (SGLang imports several eagerly under ``if _is_cpu``) but raises ``NotImplementedError``
with a clear message when called. No op is registered under ``torch.ops.sgl_kernel``, so SGLang's AMX probe
(``convert_weight_packed``) fails and it runs torch-native kernels.
"""

from __future__ import annotations

import torch

__version__ = "0.0.0+agentrl.cpu"


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """For request i: ``req_to_token[req_pool_indices[i], start[i]:end[i]] = out_cache_loc[o_i : o_i + n_i]``.

    ``out_cache_loc`` holds the slots of all requests back to back, so ``o_i = sum_{j<i} (end[j] - start[j])``
    and ``n_i = end[i] - start[i]``. Same contract as SGLang's Triton kernel ``assign_req_to_token_pool``.
    """
    del pool_len  # the row length is req_to_token.shape[1]; kept for signature parity with the C++ kernel
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    rows = req_pool_indices.tolist()
    offset = 0
    for row, start, end in zip(rows, starts, ends):
        n = end - start
        if n > 0:
            req_to_token[row, start:end] = out_cache_loc[offset : offset + n].to(req_to_token.dtype)
        offset += n


class _Unavailable:
    """Stands for a kernel this module does not implement: importable (SGLang imports some names eagerly on
    CPU), but calling it raises a clear error instead of computing something wrong."""

    def __init__(self, name: str) -> None:
        self.__name__ = name

    def __call__(self, *args: object, **kwargs: object) -> None:
        raise NotImplementedError(
            f"sgl_kernel.{self.__name__} is not available: agentrl's CPU stand-in for sgl_kernel implements only "
            "assign_req_to_token_pool_cpu (SGLang's torch-native CPU path). This SGLang feature needs the real "
            "sglang-kernel (GPU) or must be turned off (e.g. no speculative decoding, no hierarchical cache)."
        )


def __getattr__(name: str) -> _Unavailable:  # PEP 562: every name this stand-in does not implement
    if name.startswith("__"):
        raise AttributeError(name)
    return _Unavailable(name)


from sgl_kernel._borrow import from_environment  # noqa: E402  # resources.engine_borrows_idle_cores
from sgl_kernel._fast_paths import install  # noqa: E402  # batched attention, fast exact sampling
from sgl_kernel._native import load  # noqa: E402  # compiled decode attention

install(borrowing=from_environment(), load_kernels=load)
