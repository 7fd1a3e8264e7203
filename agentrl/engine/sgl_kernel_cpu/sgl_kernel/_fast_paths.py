"""CPU fast paths for SGLang, installed by this package's ``__init__`` in the SGLang server processes.

Profiling SGLang's scheduler on our 2-core CPU (135M model, bf16, 32 requests decoding) showed hot spots in
code written for GPUs (``benchmarks/sglang_decode_bench.py`` measures the result against SGLang as it is):

1. **Decode attention.** ``TorchNativeAttnBackend._run_sdpa_forward_decode`` loops over the requests in Python,
   per layer, and gathers each one's keys and values with advanced indexing: ~27 ms per layer call, ~0.8 s of
   every 30-layer decode step. :func:`batched_forward_decode` calls a C++ kernel compiled on this machine
   (``_attention.cpp``, built by ``_native.py``) that attends through ``req_to_token`` in place, one request a
   task, in fp32: 2.2 ms a layer call for 32 requests in bf16 on an AVX-512 EPYC, where SGLang's loop took 13 ms and
   the batched PyTorch path below 24 (its masked bf16 SDPA alone 16 ms). Without a compiler it does one
   ``index_select`` gather for the whole batch (3-4x faster than advanced indexing for these 384-byte rows) into a
   padded block and one masked ``scaled_dot_product_attention`` call (1.45x SGLang's loop on a Xeon in fp32, but
   slower than it in bf16 on that EPYC). Calls neither covers (encoder-decoder, sliding window) go to the
   original. Prefill is batched in PyTorch: ``_run_sdpa_forward_extend`` loops over the requests too, and computes
   attention for every position of a request, its cached prefix included (a multi-turn episode's prefix is
   recomputed at every turn, then thrown away); :func:`batched_forward_extend` computes the new tokens' queries
   only, gathering the keys of requests of similar length with one ``index_select`` and running one call per
   group: SDPA's own causal mask where no request has a cached prefix, else an explicit one offset by each
   request's prefix. Groups are bounded (``_EXTEND_BUDGET``) so that one long prompt among short ones does not pad
   them all to its length.
2. **Sampling.** ``torch.multinomial`` (or the Gumbel trick) over a 49k vocabulary took ~50-70 ms per step for
   32 rows, about as much as the model's forward pass. :func:`sample_from_probs` samples the same categorical
   distribution by inverse CDF in two levels (a block of 256 tokens by its mass, then a token inside it), in
   float64 where it accumulates: ~30x faster, and exact to float64 rounding. A batch in which some request filters
   (a greedy held-out evaluation beside RL's sampling) goes to SGLang's top-k/top-p path, which sorts every row:
   there the rows without a cut are drawn the same way and greedy rows by argmax. Seeded (deterministic) sampling
   keeps SGLang's own path.

All give the same results as the code they replace (tests: equality with the per-request loops, a chi-square
check of the sampler, and a real server's logprobs against transformers'). ``AGENTRL_SGLANG_CPU_PATCHES=0`` in the
server's environment keeps SGLang as it is.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

ATTENTION = "sglang.srt.layers.attention.torch_native_backend"
SAMPLER = "sglang.srt.layers.sampler"
_BLOCK = 256  # tokens per block of the two-level inverse-CDF sampler
# Padded query×key positions per attention call of batched extend (a request over it goes alone). Measured (CPU time,
# one thread, 135M shapes): 32 multi-turn extends (prefix 300-600, 20-80 new tokens) 3.5x faster than SGLang's loop in
# bf16, 3.9x in fp32, at 2^16 or 2^18; 32 fresh prompts of 150-450 tokens at parity (compute-bound, and padding costs
# what batching saves: 2^22 was 2x slower in fp32). Memory: heads × 2^16 scores at most, a few MB.
_EXTEND_BUDGET = 1 << 16


def batched_forward_decode(original: Any, compiled: Any = None) -> Any:
    """``compiled``: ``torch.ops.agentrl_cpu.decode_attention`` (``_attention.cpp``, which attends through
    ``req_to_token`` in place: no gather, no padding) or None for the batched PyTorch path. Calls the kernel does not
    take (another dtype or index type, a strided last axis) go the PyTorch way."""
    told: set[bool] = set()

    def run(self: Any, query: torch.Tensor, output: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
            encoder_lens: torch.Tensor | None = None, scaling: float | None = None, enable_gqa: bool = False,
            causal: bool = False, is_cross_attn: bool = False, sliding_window_size: int | None = None) -> torch.Tensor:
        n = seq_lens.shape[0]
        if _uncovered(encoder_lens, is_cross_attn, sliding_window_size) or n == 0 or query.shape[0] != n:
            return original(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                            encoder_lens=encoder_lens, scaling=scaling, enable_gqa=enable_gqa, causal=causal,
                            is_cross_attn=is_cross_attn, sliding_window_size=sliding_window_size)
        if compiled is not None:
            takes = _compiled_takes(query, output, k_cache, v_cache, req_to_token)
            if takes not in told:  # the first call of each kind, in the server's log (tests read it)
                told.add(takes)
                print(f"agentrl: decode attention {'by the compiled kernel' if takes else 'in PyTorch'} (first such "
                      f"call: {n} requests, q {query.dtype} {tuple(query.shape)}, KV cache {k_cache.dtype}, "
                      f"table {req_to_token.dtype})", file=sys.stderr, flush=True)
            if takes:
                compiled(query, output, k_cache, v_cache, req_to_token,
                         req_pool_indices.to(torch.int64).contiguous(), seq_lens.to(torch.int64).contiguous(),
                         scaling if scaling is not None else query.shape[-1] ** -0.5)
                return output
        max_len = int(seq_lens.max())
        rows = req_to_token[req_pool_indices, :max_len].reshape(-1).long()  # padding rows are masked out below
        key = torch.index_select(k_cache.reshape(k_cache.shape[0], -1), 0, rows).view(n, max_len, *k_cache.shape[1:])
        value = torch.index_select(v_cache.reshape(v_cache.shape[0], -1), 0, rows).view(n, max_len, *v_cache.shape[1:])
        if not (query.dtype == key.dtype == value.dtype):
            key, value = key.to(query.dtype), value.to(query.dtype)
        valid = torch.arange(max_len, device=seq_lens.device)[None, :] < seq_lens[:, None]  # [n, max_len]
        out = F.scaled_dot_product_attention(
            query.unsqueeze(2),  # [n, heads, 1, head_dim]
            key.transpose(1, 2), value.transpose(1, 2),  # [n, kv_heads, max_len, head_dim]
            attn_mask=valid[:, None, None, :], scale=scaling, enable_gqa=enable_gqa)
        output.copy_(out.squeeze(2))
        return output

    run.agentrl_batched = True  # type: ignore[attr-defined]
    run.agentrl_compiled = compiled is not None  # type: ignore[attr-defined]
    return run


def _compiled_takes(query: torch.Tensor, output: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    req_to_token: torch.Tensor) -> bool:
    """What ``decode_attention`` checks, so that a call it would refuse goes the PyTorch way instead of raising."""
    return (query.dim() == 3 and output.shape == query.shape and k_cache.dim() == 3 and v_cache.shape == k_cache.shape
            and k_cache.shape[2] == query.shape[2] and query.shape[1] % k_cache.shape[1] == 0
            and query.dtype == output.dtype == k_cache.dtype == v_cache.dtype
            and query.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and query.stride(2) == output.stride(2) == k_cache.stride(2) == v_cache.stride(2) == 1
            and req_to_token.dtype == torch.int32 and req_to_token.dim() == 2 and req_to_token.stride(1) == 1
            and query.device.type == "cpu" and k_cache.device.type == "cpu")


def _uncovered(encoder_lens: Any, is_cross_attn: bool, sliding_window_size: int | None) -> bool:
    return encoder_lens is not None or is_cross_attn or (sliding_window_size is not None and sliding_window_size > -1)


def _length_groups(ext: list[int], lens: list[int], budget: int) -> list[list[int]]:
    """Requests in groups of similar length whose padded block ``len(g) · max ext · max len`` stays within
    ``budget`` query×key positions (a request alone over it forms its own group, as the original's own loop
    would have materialised it). Sorting by length first keeps the padding small: one long request among many
    short ones goes alone instead of padding all the others to its length."""
    groups: list[list[int]] = []
    cur: list[int] = []
    max_e = max_s = 0
    for r in sorted(range(len(lens)), key=lens.__getitem__):
        e, s = max(max_e, ext[r]), max(max_s, lens[r])
        if cur and (len(cur) + 1) * e * s > budget:
            groups.append(cur)
            cur, e, s = [], ext[r], lens[r]
        cur.append(r)
        max_e, max_s = e, s
    if cur:
        groups.append(cur)
    return groups


def batched_forward_extend(original: Any, budget: int = _EXTEND_BUDGET) -> Any:
    def run(self: Any, query: torch.Tensor, output: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
            extend_prefix_lens: torch.Tensor, extend_seq_lens: torch.Tensor, encoder_lens: torch.Tensor | None = None,
            scaling: float | None = None, enable_gqa: bool = False, causal: bool = False, is_cross_attn: bool = False,
            sliding_window_size: int | None = None) -> torch.Tensor:
        n = seq_lens.shape[0]
        lens, pre, ext = seq_lens.tolist(), extend_prefix_lens.tolist(), extend_seq_lens.tolist()
        if (_uncovered(encoder_lens, is_cross_attn, sliding_window_size) or n == 0 or sum(ext) != query.shape[0]
                or any(p + e != s or e < 1 for p, e, s in zip(pre, ext, lens, strict=True))):
            return original(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                            extend_prefix_lens, extend_seq_lens, encoder_lens=encoder_lens, scaling=scaling,
                            enable_gqa=enable_gqa, causal=causal, is_cross_attn=is_cross_attn,
                            sliding_window_size=sliding_window_size)
        starts = torch.tensor([0, *ext[:-1]], dtype=torch.long, device=query.device).cumsum(0)  # first query row
        k_rows, v_rows = k_cache.reshape(k_cache.shape[0], -1), v_cache.reshape(v_cache.shape[0], -1)
        for group in _length_groups(ext, lens, budget):
            g = len(group)
            max_e, max_s = max(ext[r] for r in group), max(lens[r] for r in group)
            idx = torch.tensor(group, dtype=torch.long, device=query.device)
            g_ext = extend_seq_lens.index_select(0, idx)[:, None]  # [g, 1]
            g_pre = extend_prefix_lens.index_select(0, idx)[:, None]
            g_len = seq_lens.index_select(0, idx)[:, None, None]
            # query j of request r sits at row starts[r] + j of `query`; padding rows (j ≥ ext[r]) read row
            # starts[r] and are never written back
            j = torch.arange(max_e, device=query.device)[None, :]
            q_valid = j < g_ext  # [g, max_e]
            tokens = starts.index_select(0, idx)[:, None] + torch.where(q_valid, j, 0)
            q = query.index_select(0, tokens.reshape(-1)).view(g, max_e, *query.shape[1:])
            rows = req_to_token.index_select(0, req_pool_indices.index_select(0, idx))[:, :max_s].reshape(-1).long()
            key = torch.index_select(k_rows, 0, rows).view(g, max_s, *k_cache.shape[1:])
            value = torch.index_select(v_rows, 0, rows).view(g, max_s, *v_cache.shape[1:])
            if not (q.dtype == key.dtype == value.dtype):
                key, value = key.to(q.dtype), value.to(q.dtype)
            if causal and all(pre[r] == 0 for r in group):
                # no cached prefix: SDPA's own causal mask is exact for the real rows of right-padded requests
                # (query j < len sees keys ≤ j < len), and its kernel skips the masked half (an explicit mask
                # made prefill ~2x slower than the original's per-request is_causal calls)
                mask, is_causal = None, True
            else:
                k_pos = torch.arange(max_s, device=query.device)[None, None, :]
                mask = k_pos < g_len  # [g, 1, max_s]: padding keys never seen
                if causal:  # the original's causal mask over prefix+new: query j of r sees keys < pre[r] + j + 1
                    mask = mask & (k_pos <= (g_pre + j)[:, :, None])  # [g, max_e, max_s]
                mask, is_causal = mask[:, None], False
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),  # [g, heads, len, head_dim]
                attn_mask=mask, is_causal=is_causal, scale=scaling, enable_gqa=enable_gqa)
            out = out.transpose(1, 2).reshape(g * max_e, *output.shape[1:])
            keep = q_valid.reshape(-1)
            output.index_copy_(0, tokens.reshape(-1)[keep], out[keep])
        return output

    run.agentrl_batched = True  # type: ignore[attr-defined]
    return run


def sample_from_probs(probs: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs`` ([rows, vocab], rows summing to ~1), as ``torch.multinomial(probs, 1)``."""
    rows, vocab = probs.shape
    pad = (-vocab) % _BLOCK
    p = (F.pad(probs, (0, pad)) if pad else probs).reshape(rows, -1, _BLOCK)
    block_cdf = p.sum(-1, dtype=torch.float64).cumsum(-1)  # [rows, blocks]
    u = torch.rand(rows, 1, dtype=torch.float64, device=probs.device) * block_cdf[:, -1:]
    block = torch.searchsorted(block_cdf, u, right=True).clamp_max_(block_cdf.shape[1] - 1)  # [rows, 1]
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp_min(0)), torch.zeros_like(u))
    inner_cdf = p.gather(1, block.unsqueeze(-1).expand(rows, 1, _BLOCK)).squeeze(1).to(torch.float64).cumsum(-1)
    inner = torch.searchsorted(inner_cdf, u - before, right=True).clamp_max_(_BLOCK - 1)
    return (block * _BLOCK + inner).clamp_max_(vocab - 1)


def _sampler_with_fast_path(original: Any) -> Any:
    def sampling_from_probs_torch(probs: torch.Tensor, sampling_seed: torch.Tensor | None = None,
                                  positions: torch.Tensor | None = None) -> torch.Tensor:
        if sampling_seed is not None or probs.dim() != 2:
            return original(probs, sampling_seed=sampling_seed, positions=positions)
        return sample_from_probs(probs).view(-1).to(torch.int32)  # what SGLang's own returns

    sampling_from_probs_torch.agentrl_fast = True  # type: ignore[attr-defined]
    return sampling_from_probs_torch


def _filtering_sampler_with_fast_path(original: Any) -> Any:
    """``top_k_top_p_min_p_sampling_from_probs_torch``, which SGLang uses for the whole batch as soon as one request
    filters: a greedy one (temperature 0 is top-k 1) decoding beside sampled ones — a held-out evaluation during RL —
    sorts every row's 49k probabilities (a third of the scheduler's time in the demo while one ran). Rows that do not
    filter are drawn by :func:`sample_from_probs`, top-k-1 rows by argmax; rows with a real top-k/top-p/min-p cut (and
    seeded or mask-returning calls) go to SGLang's function."""

    def top_k_top_p_min_p_sampling_from_probs_torch(probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor,
                                                    min_ps: torch.Tensor, need_min_p_sampling: bool,
                                                    sampling_seed: torch.Tensor | None, positions: torch.Tensor,
                                                    *, return_filtered_probs: bool = False,
                                                    max_top_k: int | None = None) -> Any:
        if sampling_seed is not None or return_filtered_probs or probs.dim() != 2:
            return original(probs, top_ks, top_ps, min_ps, need_min_p_sampling, sampling_seed, positions,
                            return_filtered_probs=return_filtered_probs, max_top_k=max_top_k)
        unfiltered = (top_ks >= probs.shape[1]) & (top_ps >= 1.0)
        if need_min_p_sampling:
            unfiltered &= min_ps <= 0
        greedy = top_ks == 1
        out = torch.empty(probs.shape[0], dtype=torch.int32, device=probs.device)
        if bool(greedy.any()):
            out[greedy] = probs[greedy].argmax(-1).to(torch.int32)
        if bool(unfiltered.any()):
            out[unfiltered] = sample_from_probs(probs[unfiltered]).view(-1).to(torch.int32)
        rest = ~(greedy | unfiltered)
        if bool(rest.any()):
            out[rest] = original(probs[rest], top_ks[rest], top_ps[rest], min_ps[rest], need_min_p_sampling, None,
                                 positions, max_top_k=max_top_k)  # positions: read only with a seed
        return out

    top_k_top_p_min_p_sampling_from_probs_torch.agentrl_fast = True  # type: ignore[attr-defined]
    return top_k_top_p_min_p_sampling_from_probs_torch


def patch(name: str, module: ModuleType, borrowing: Any = None, compiled_decode: Any = None) -> bool:
    """Patch ``module`` (ATTENTION or SAMPLER) if it is fully loaded; False if it is not (yet). ``borrowing``: an
    ``EngineCoreBorrowing`` (``_borrow.py``) to run before every forward pass, or None; ``compiled_decode``: see
    :func:`batched_forward_decode`."""
    if name == ATTENTION:
        cls = getattr(module, "TorchNativeAttnBackend", None)
        if cls is None:
            return False
        if not getattr(cls._run_sdpa_forward_decode, "agentrl_batched", False):
            cls._run_sdpa_forward_decode = batched_forward_decode(cls._run_sdpa_forward_decode, compiled_decode)
        if not getattr(cls._run_sdpa_forward_extend, "agentrl_batched", False):
            cls._run_sdpa_forward_extend = batched_forward_extend(cls._run_sdpa_forward_extend)
        if borrowing is not None and not getattr(cls.init_forward_metadata, "agentrl_borrow", False):
            cls.init_forward_metadata = borrowing.wrap(cls.init_forward_metadata)
            print(f"agentrl: the scheduler borrows cores {borrowing.lend} while the trainer waits "
                  f"({borrowing.flag})", file=sys.stderr, flush=True)
    else:
        fn = getattr(module, "sampling_from_probs_torch", None)
        if fn is None:
            return False
        if not getattr(fn, "agentrl_fast", False):
            # looked up as a global at call time
            module.sampling_from_probs_torch = _sampler_with_fast_path(fn)  # type: ignore[attr-defined]
        filtering = getattr(module, "top_k_top_p_min_p_sampling_from_probs_torch", None)
        if filtering is not None and not getattr(filtering, "agentrl_fast", False):
            module.top_k_top_p_min_p_sampling_from_probs_torch = (  # type: ignore[attr-defined]
                _filtering_sampler_with_fast_path(filtering))
    print(f"agentrl: CPU fast path installed in {name} (AGENTRL_SGLANG_CPU_PATCHES=0 turns it off)",
          file=sys.stderr, flush=True)
    return True


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches SGLang's modules right after they are executed. If this package was imported from inside one of
    them (it is half-initialised then), that one is patched at the next import of any module after it finished:
    SGLang imports many more before it runs a forward pass."""

    def __init__(self, borrowing: Any = None, compiled_decode: Any = None) -> None:
        self.pending = {ATTENTION, SAMPLER}
        self.borrowing = borrowing
        self.compiled_decode = compiled_decode

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        for loaded in [m for m in self.pending if m in sys.modules]:
            if patch(loaded, sys.modules[loaded], self.borrowing, self.compiled_decode):
                self.pending.discard(loaded)
        if name not in self.pending:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        loader, exec_module = spec.loader, spec.loader.exec_module

        def exec_and_patch(module: ModuleType) -> None:
            exec_module(module)
            if patch(name, module, self.borrowing, self.compiled_decode):
                self.pending.discard(name)

        loader.exec_module = exec_and_patch  # type: ignore[method-assign]  # this spec's own loader instance
        return spec


def install(borrowing: Any = None, load_kernels: Any = None) -> None:
    """``load_kernels``: ``_native.load`` (None when the compiled kernels are loaded, else why not), or None."""
    if os.environ.get("AGENTRL_SGLANG_CPU_PATCHES", "1") == "0":
        return
    if any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        return
    compiled_decode = None
    if load_kernels is not None:
        try:
            why_not = load_kernels()
        except Exception as e:  # noqa: BLE001  # never stop a server for want of the kernel
            why_not = f"{type(e).__name__}: {e}"
        if why_not is None:
            compiled_decode = torch.ops.agentrl_cpu.decode_attention
            print("agentrl: compiled CPU decode attention loaded", file=sys.stderr, flush=True)
        else:
            print(f"agentrl: compiled CPU decode attention unavailable, batched PyTorch path instead: {why_not}",
                  file=sys.stderr, flush=True)
    finder = _PatchOnImport(borrowing, compiled_decode)
    for name in list(finder.pending):
        if name in sys.modules and patch(name, sys.modules[name], borrowing, compiled_decode):
            finder.pending.discard(name)
    if finder.pending:
        sys.meta_path.insert(0, finder)  # never removed (that would disturb an import in progress)
