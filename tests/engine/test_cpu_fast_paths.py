"""The CPU fast paths agentrl installs into SGLang (batched decode and extend attention, inverse-CDF sampling): same results
as the code they replace, installed in the server's processes, and a real server's logprobs match transformers'."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import subprocess
import sys
import types
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from agentrl.engine.base import SamplingParams
from agentrl.engine.client import SGLangClient
from agentrl.engine.server import SGL_KERNEL_CPU_DIR


def _load_fast_paths() -> types.ModuleType:
    """The shim's module on its own (it needs only torch): the test process must not import the shim as sgl_kernel."""
    path = SGL_KERNEL_CPU_DIR / "sgl_kernel" / "_fast_paths.py"
    spec = importlib.util.spec_from_file_location("agentrl_test_fast_paths", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("heads", "kv_heads", "dtype"),
                         [(4, 2, torch.float32), (9, 3, torch.bfloat16), (4, 4, torch.float32)])
def test_batched_decode_equals_the_per_request_loop(heads: int, kv_heads: int, dtype: torch.dtype) -> None:
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    torch.manual_seed(0)
    original = TorchNativeAttnBackend._run_sdpa_forward_decode  # this process never imports the shim: unpatched
    batched = _load_fast_paths().batched_forward_decode(original)
    n, dim, pool = 5, 16, 4000
    seq_lens = torch.tensor([1, 7, 300, 64, 129])
    k_cache, v_cache = torch.randn(pool, kv_heads, dim, dtype=dtype), torch.randn(pool, kv_heads, dim, dtype=dtype)
    req_to_token = torch.randint(0, pool, (16, 512), dtype=torch.int32)  # junk past each length must not matter
    req_pool_indices = torch.tensor([9, 2, 0, 15, 4])
    query = torch.randn(n, heads, dim, dtype=dtype)
    args = (k_cache, v_cache, req_to_token, req_pool_indices, seq_lens)
    kw = {"scaling": dim ** -0.5, "enable_gqa": heads != kv_heads}
    want = original(types.SimpleNamespace(), query, torch.empty_like(query), *args, **kw)
    got = batched(types.SimpleNamespace(), query, torch.empty_like(query), *args, **kw)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.parametrize(("heads", "kv_heads", "dtype", "causal", "budget", "fresh"), [
    (4, 2, torch.float32, True, 1 << 22, False),  # one group, explicit mask
    (9, 3, torch.bfloat16, True, 1 << 22, False),
    (4, 4, torch.float32, True, 4000, False),  # several groups, the long request alone (SDPA's causal mask)
    (4, 2, torch.float32, False, 1 << 22, False),  # encoder-only layers: no causal mask
    (9, 3, torch.bfloat16, True, 1 << 22, True),  # no cached prefix: right-padded requests under SDPA's causal mask
    (4, 2, torch.float32, True, 1 << 22, True),
])
def test_batched_extend_equals_the_per_request_loop(heads: int, kv_heads: int, dtype: torch.dtype, causal: bool,
                                                    budget: int, fresh: bool) -> None:
    """Mixed lengths, prefix-cached requests (only their new tokens are queries), one-token extends."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    torch.manual_seed(0)
    original = TorchNativeAttnBackend._run_sdpa_forward_extend  # unpatched in this process
    batched = _load_fast_paths().batched_forward_extend(original, budget=budget)
    dim, pool = 16, 4000
    prefix = torch.tensor([0, 6, 0, 250, 63, 0, 1]) * (not fresh)
    new = torch.tensor([1, 1, 300, 50, 1, 17, 40])
    seq_lens = prefix + new
    k_cache, v_cache = torch.randn(pool, kv_heads, dim, dtype=dtype), torch.randn(pool, kv_heads, dim, dtype=dtype)
    req_to_token = torch.randint(0, pool, (16, 512), dtype=torch.int32)  # junk past each length must not matter
    req_pool_indices = torch.tensor([9, 2, 0, 15, 4, 7, 11])
    query = torch.randn(int(new.sum()), heads, dim, dtype=dtype)
    args = (k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, prefix, new)
    kw = {"scaling": dim ** -0.5, "enable_gqa": heads != kv_heads, "causal": causal}
    want = original(types.SimpleNamespace(), query, torch.zeros_like(query), *args, **kw)
    got = batched(types.SimpleNamespace(), query, torch.full_like(query, float("nan")), *args, **kw)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)  # NaN left anywhere (a row not written) fails


def test_extend_groups_bound_the_padded_block() -> None:
    groups = _load_fast_paths()._length_groups
    ext, lens = [10, 4000, 10, 12, 9], [10, 4000, 10, 12, 9]
    got = groups(ext, lens, 1 << 22)
    assert sorted(r for g in got for r in g) == [0, 1, 2, 3, 4]
    assert [1] in got and all(len(g) * max(ext[r] for r in g) * max(lens[r] for r in g) <= 1 << 22
                              for g in got if g != [1])
    assert groups(ext, lens, 10**9) == [[4, 0, 2, 3, 1]]  # a large budget: one group, sorted by length


def _recording_original() -> tuple[list[dict[str, object]], Callable[..., str]]:
    """A stand-in for SGLang's own method: records each call's keyword arguments and returns "original"."""
    calls: list[dict[str, object]] = []

    def original(*args: object, **kwargs: object) -> str:
        calls.append(kwargs)
        return "original"

    return calls, original


def test_uncovered_extend_calls_go_to_the_original() -> None:
    calls, original = _recording_original()
    batched = _load_fast_paths().batched_forward_extend(original)
    q = torch.zeros(2, 2, 4)
    one = torch.ones(1, dtype=torch.long)
    table, rows = torch.zeros(1, 4, dtype=torch.int32), torch.zeros(1, dtype=torch.long)
    assert batched(None, q, q, q[0], q[0], table, rows, one * 2, one * 0, one * 2, sliding_window_size=16) == "original"
    assert batched(None, q, q, q[0], q[0], table, rows, one * 2, one * 0, one * 2, encoder_lens=one) == "original"
    assert batched(None, q, q, q[0], q[0], table, rows, one * 3, one * 0, one * 2) == "original"  # prefix + new ≠ len
    assert len(calls) == 3 and calls[0]["sliding_window_size"] == 16


@pytest.mark.parametrize("order", ["shim first", "sglang first"])
def test_the_shim_patches_sglangs_backend_in_a_server_process(order: str) -> None:
    imports = ["import sgl_kernel", "import sglang.srt.layers.attention.torch_native_backend as m",
               "import sglang.srt.layers.sampler as s"]
    if order == "sglang first":  # the backend's own imports pull in sgl_kernel while it is half-initialised ...
        imports = [imports[1], imports[2]]  # ... and it is patched at the next import
    probe = ("print(getattr(m.TorchNativeAttnBackend._run_sdpa_forward_decode, 'agentrl_batched', False) and "
             "getattr(m.TorchNativeAttnBackend._run_sdpa_forward_extend, 'agentrl_batched', False) and "
             "getattr(s.sampling_from_probs_torch, 'agentrl_fast', False))")
    code = "; ".join([*imports, probe])
    env = {**os.environ, "PYTHONPATH": str(SGL_KERNEL_CPU_DIR), "SGLANG_USE_CPU_ENGINE": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                         check=False)
    assert out.stdout.strip().splitlines()[-1:] == ["True"], out.stderr[-2000:]
    env["AGENTRL_SGLANG_CPU_PATCHES"] = "0"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                         check=False)
    assert out.stdout.strip().splitlines()[-1:] == ["False"], out.stderr[-2000:]


def test_uncovered_calls_go_to_the_original() -> None:
    calls, original = _recording_original()
    batched = _load_fast_paths().batched_forward_decode(original)
    q = torch.zeros(1, 2, 4)
    out = batched(None, q, q, q[0], q[0], torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, dtype=torch.long),
                  torch.ones(1, dtype=torch.long), sliding_window_size=16)
    assert out == "original" and calls[0]["sliding_window_size"] == 16


def test_sampler_draws_from_the_given_distribution() -> None:
    sample = _load_fast_paths().sample_from_probs
    torch.manual_seed(0)
    vocab = 1000  # not a multiple of the 256-token block: the padded tail must never be drawn
    probs = torch.zeros(vocab)
    probs[[0, 255, 256, 511, 700, 999]] = torch.tensor([0.05, 0.15, 0.1, 0.2, 0.3, 0.2])
    draws = sample(probs.repeat(200_000, 1)).flatten()
    assert draws.shape == (200_000,) and int(draws.max()) < vocab
    counts = torch.bincount(draws, minlength=vocab).double()
    assert counts[probs == 0].sum() == 0  # never a zero-probability token
    expected = probs[probs > 0].double() * len(draws)
    chi2 = float(((counts[probs > 0] - expected) ** 2 / expected).sum())
    assert chi2 < 20.5  # 5 degrees of freedom: p ≈ 0.001


def test_patched_sampler_returns_what_sglangs_returns() -> None:
    """Compared with SGLang's own ``sampling_from_probs_torch`` by value. Where the draw is determined (one-hot
    rows: block edges, the vocabulary's last token) the tokens are identical, no tolerance; where it is random,
    the two draw from the same distribution: a two-sample chi-square test of 20 000 draws each, failing at
    p ≈ 0.001. A seeded request goes to SGLang's own code with its arguments."""
    from sglang.srt.layers.sampler import sampling_from_probs_torch  # this process never imports the shim

    fast_paths = _load_fast_paths()
    fast = fast_paths._sampler_with_fast_path(sampling_from_probs_torch)
    vocab = 49152  # SGLang's shape: rows of a 49k vocabulary
    hot = torch.tensor([0, 1, 255, 256, 257, 4095, 30000, vocab - 1])
    probs = torch.zeros(len(hot), vocab)
    probs[torch.arange(len(hot)), hot] = 1.0
    want, got = sampling_from_probs_torch(probs), fast(probs)
    assert (got.shape, got.dtype) == (want.shape, want.dtype) == ((len(hot),), torch.int32)
    assert got.tolist() == want.tolist() == hot.tolist()

    torch.manual_seed(0)
    vocab, n = 1000, 20_000  # not a multiple of the 256-token block
    support = torch.tensor([0, 255, 256, 511, 700, 999])
    row = torch.zeros(vocab)
    row[support] = torch.tensor([0.05, 0.15, 0.1, 0.2, 0.3, 0.2])
    probs = row.repeat(n, 1)
    ours = torch.bincount(fast(probs).long(), minlength=vocab).double()
    theirs = torch.bincount(sampling_from_probs_torch(probs).long(), minlength=vocab).double()
    assert ours.sum() == theirs.sum() == n and ours[row == 0].sum() == theirs[row == 0].sum() == 0
    a, b = ours[support], theirs[support]
    chi2 = float(((a - b) ** 2 / (a + b)).sum())  # equal sample sizes: 5 degrees of freedom
    assert chi2 < 20.5, (a.tolist(), b.tolist())

    def sglangs(probs: torch.Tensor, sampling_seed: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> tuple:
        return probs, sampling_seed, positions

    one, seed, positions = probs[:1], torch.tensor([7]), torch.tensor([3])
    handed = fast_paths._sampler_with_fast_path(sglangs)(one, seed, positions)
    assert all(x is y for x, y in zip(handed, (one, seed, positions), strict=True))


@pytest.mark.sglang
async def test_sglang_logprobs_match_transformers(sglang_url: str, tiny_model_path: Path) -> None:
    """Greedy and sampled continuations of prompts of different lengths, generated concurrently (so decode batches
    mix lengths and go through both fast paths), scored again by transformers in fp32."""
    from transformers import AutoModelForCausalLM

    prompts = [[1, 2, 3], list(range(5, 45)), list(range(100, 230)), [7] * 11]
    temperatures = [0.0, 1.0]
    async with SGLangClient(sglang_url) as client:
        results = await asyncio.gather(*(
            client.generate(p, SamplingParams(max_new_tokens=24, temperature=t, ignore_eos=True))
            for t in temperatures for p in prompts))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_path), dtype=torch.float32).eval()
    for k, res in enumerate(results):
        prompt, greedy = prompts[k % len(prompts)], temperatures[k // len(prompts)] == 0.0
        assert len(res.output_ids) == 24
        ids = torch.tensor([prompt + res.output_ids])
        with torch.no_grad():
            logp = model(ids).logits[0, :-1].float().log_softmax(-1)
        positions = torch.arange(len(prompt) - 1, ids.shape[1] - 1)
        hf = logp[positions, ids[0, len(prompt):]]
        assert hf.tolist() == pytest.approx(res.logprobs, abs=2e-3)
        if greedy:  # each token SGLang chose is (one of) transformers' argmax
            assert (logp[positions].max(-1).values - hf).max().item() < 2e-3
