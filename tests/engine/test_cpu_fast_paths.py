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
from typing import Any

import pytest
import torch

from agentrl.engine.base import SamplingParams
from agentrl.engine.client import SGLangClient
from agentrl.engine.server import SGL_KERNEL_CPU_DIR


def _load_shim_module(name: str) -> types.ModuleType:
    """One of the shim's modules on its own (each needs only torch): the test process must not import the shim as
    sgl_kernel."""
    spec = importlib.util.spec_from_file_location(f"agentrl_test{name}", SGL_KERNEL_CPU_DIR / "sgl_kernel" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load_fast_paths() -> types.ModuleType:
    return _load_shim_module("_fast_paths")


def _load_native() -> types.ModuleType:
    return _load_shim_module("_native")


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


@pytest.fixture(scope="module")
def compiled_decode() -> Callable[..., None]:
    """``torch.ops.agentrl_cpu.decode_attention``, built (or found in the cache) and loaded in this process."""
    native = _load_native()
    if native.compiler() is None:
        pytest.skip("no C++ compiler: apt-get install g++ (scripts/install_system.sh test profile)")
    if os.environ.get("AGENTRL_CPU_KERNELS") == "0":
        pytest.skip("AGENTRL_CPU_KERNELS=0 in this environment")
    why_not = native.load()
    assert why_not is None, why_not
    return torch.ops.agentrl_cpu.decode_attention


@pytest.mark.parametrize(("heads", "kv_heads", "dtype"), [
    (4, 2, torch.float32), (9, 3, torch.bfloat16), (4, 4, torch.float32), (8, 1, torch.float16)])
def test_compiled_decode_equals_the_per_request_loop(compiled_decode: Callable[..., None], heads: int, kv_heads: int,
                                                    dtype: torch.dtype) -> None:
    """The compiled kernel through the patched method, against SGLang's own loop: scattered slots, a one-token
    request, junk past every length, a strided output (a view of a wider buffer, as SGLang's reshape hands it)."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    torch.manual_seed(0)
    original = TorchNativeAttnBackend._run_sdpa_forward_decode
    patched = _load_fast_paths().batched_forward_decode(original, compiled_decode)
    assert patched.agentrl_compiled
    n, dim, pool = 5, 64, 4000
    seq_lens = torch.tensor([1, 7, 300, 64, 129])
    k_cache, v_cache = torch.randn(pool, kv_heads, dim, dtype=dtype), torch.randn(pool, kv_heads, dim, dtype=dtype)
    req_to_token = torch.randint(0, pool, (16, 512), dtype=torch.int32)
    req_pool_indices = torch.tensor([9, 2, 0, 15, 4])
    query = torch.randn(n, heads, dim, dtype=dtype)
    args = (k_cache, v_cache, req_to_token, req_pool_indices, seq_lens)
    kw = {"scaling": 0.3, "enable_gqa": heads != kv_heads}
    want = original(types.SimpleNamespace(), query, torch.empty_like(query), *args, **kw)
    wide = torch.full((n, heads, dim * 2), float("nan"), dtype=dtype)
    out = wide[:, :, :dim]  # strided rows: the kernel must write through out's strides, and only its own elements
    got = patched(types.SimpleNamespace(), query, out, *args, **kw)
    assert got is out and not wide[:, :, dim:].isnan().logical_not().any()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    unscaled = patched(types.SimpleNamespace(), query, torch.empty_like(query), *args, enable_gqa=kw["enable_gqa"])
    torch.testing.assert_close(unscaled, original(types.SimpleNamespace(), query, torch.empty_like(query), *args,
                                                  scaling=dim ** -0.5, enable_gqa=kw["enable_gqa"]),
                               atol=tol, rtol=tol)  # scaling None: 1/sqrt(head_dim), as SDPA


def test_calls_the_compiled_kernel_does_not_take_go_the_pytorch_way(compiled_decode: Callable[..., None]) -> None:
    """An int64 request table and mixed dtypes are SGLang-legal but not the kernel's: same answer, no error."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    torch.manual_seed(1)
    original = TorchNativeAttnBackend._run_sdpa_forward_decode
    patched = _load_fast_paths().batched_forward_decode(original, compiled_decode)
    seq_lens, rows = torch.tensor([3, 40]), torch.tensor([1, 0])
    query = torch.randn(2, 4, 16)
    for k_cache, table in [(torch.randn(100, 2, 16), torch.randint(0, 100, (2, 64))),  # int64 table
                           (torch.randn(100, 2, 16, dtype=torch.bfloat16),
                            torch.randint(0, 100, (2, 64), dtype=torch.int32))]:  # bf16 cache, fp32 query
        args = (k_cache, k_cache.flip(0), table, rows, seq_lens)
        want = original(types.SimpleNamespace(), query, torch.empty_like(query), *args, enable_gqa=True)
        got = patched(types.SimpleNamespace(), query, torch.empty_like(query), *args, enable_gqa=True)
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


def test_compiled_kernel_refuses_bad_shapes_with_a_clear_error(compiled_decode: Callable[..., None]) -> None:
    q = torch.randn(2, 3, 16)
    cache, table = torch.randn(10, 2, 16), torch.zeros(2, 4, dtype=torch.int32)
    lens, rows = torch.ones(2, dtype=torch.long), torch.arange(2)
    with pytest.raises(RuntimeError, match="heads must be a multiple of kv_heads"):
        compiled_decode(q, torch.empty_like(q), cache, cache, table, rows, lens, 1.0)
    q = torch.randn(2, 4, 16)
    with pytest.raises(RuntimeError, match="int32"):
        compiled_decode(q, torch.empty_like(q), cache, cache, table.long(), rows, lens, 1.0)
    # indices out of range: an error naming them, never a read outside the tensors
    with pytest.raises(RuntimeError, match="request 1 has seq_len 5 and table row 1 .table 2 x 4."):
        compiled_decode(q, torch.empty_like(q), cache, cache, table, rows, torch.tensor([1, 5]), 1.0)
    with pytest.raises(RuntimeError, match="table row 7"):
        compiled_decode(q, torch.empty_like(q), cache, cache, table, torch.tensor([0, 7]), lens, 1.0)
    with pytest.raises(RuntimeError, match="request 0 position 2 points at KV slot 10 of 10"):
        compiled_decode(q, torch.empty_like(q), cache, cache, torch.tensor([[0, 1, 10, 3]] * 2, dtype=torch.int32),
                        rows, torch.tensor([3, 1]), 1.0)


def test_without_a_compiler_the_build_says_why(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    native = _load_native()
    monkeypatch.setenv("AGENTRL_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "no-such-compiler-agentrl")
    with pytest.raises(RuntimeError, match="no C.. compiler .no-such-compiler-agentrl not on PATH"):
        native.build()
    assert "no-such-compiler-agentrl" in (native.load() or "")
    monkeypatch.setenv("AGENTRL_CPU_KERNELS", "0")
    assert native.load() == "AGENTRL_CPU_KERNELS=0"
    assert not list(tmp_path.rglob("*.so"))


def test_a_failed_build_leaves_nothing_and_keeps_the_compilers_words(monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Path) -> None:
    native = _load_native()
    fake = tmp_path / "cxx"
    fake.write_text("#!/bin/sh\necho 'cxx 1.0'; [ \"$1\" = --version ] && exit 0; echo 'error: no room' >&2; exit 3\n")
    fake.chmod(0o755)
    monkeypatch.setenv("AGENTRL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", str(fake))
    with pytest.raises(RuntimeError, match=r"(?s)failed \(exit 3\).*error: no room"):
        native.build()
    assert [p.name for p in (tmp_path / "cache" / "kernels").iterdir() if not p.name.endswith(".lock")] == []


def test_the_cache_key_follows_the_source_torch_and_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    native = _load_native()
    cxx = native.compiler() or "/bin/true"
    base = native.library_path(cxx)
    monkeypatch.setattr(native, "_cpu_flags", lambda: "flags : avx2")
    other_cpu = native.library_path(cxx)
    monkeypatch.setattr(native.torch, "__version__", "0.0.0")
    other_torch = native.library_path(cxx)
    command = native._command
    monkeypatch.setattr(native, "_command", lambda cxx, out: [*command(cxx, out), "-O1"])
    other_flags = native.library_path(cxx)
    assert len({base, other_cpu, other_torch, other_flags}) == 4 and base.parent == native.cache_dir()


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


def _pythons(*jobs: tuple[str, dict[str, str]]) -> list[subprocess.CompletedProcess[str]]:
    """Each ``(code, env)`` in an interpreter of its own, all at once: one imports SGLang's attention backend in
    ~8 s of a core, and a test's variants do not depend on each other."""
    procs: list[subprocess.Popen[str]] = []
    try:
        for code, env in jobs:
            procs.append(subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True))
        done = []
        for proc in procs:
            try:
                out, err = proc.communicate(timeout=300)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
            done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
        return done
    finally:  # interrupted (Ctrl-C, pytest-timeout) or a start that failed: none is left running
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.parametrize("order", ["shim first", "sglang first"])
def test_the_shim_patches_sglangs_backend_in_a_server_process(order: str) -> None:
    imports = ["import sgl_kernel", "import sglang.srt.layers.attention.torch_native_backend as m",
               "import sglang.srt.layers.sampler as s"]
    if order == "sglang first":  # the backend's own imports pull in sgl_kernel while it is half-initialised ...
        imports = [imports[1], imports[2]]  # ... and it is patched at the next import
    probe = ("print(getattr(m.TorchNativeAttnBackend._run_sdpa_forward_decode, 'agentrl_batched', False) and "
             "getattr(m.TorchNativeAttnBackend._run_sdpa_forward_extend, 'agentrl_batched', False) and "
             "getattr(s.sampling_from_probs_torch, 'agentrl_fast', False) and "
             "getattr(s.top_k_top_p_min_p_sampling_from_probs_torch, 'agentrl_fast', False))")
    code = "; ".join([*imports, probe])
    env = {**os.environ, "PYTHONPATH": str(SGL_KERNEL_CPU_DIR), "SGLANG_USE_CPU_ENGINE": "1"}
    on, off = _pythons((code, env), (code, {**env, "AGENTRL_SGLANG_CPU_PATCHES": "0"}))
    assert on.stdout.strip().splitlines()[-1:] == ["True"], on.stderr[-2000:]
    assert off.stdout.strip().splitlines()[-1:] == ["False"], off.stderr[-2000:]


def test_a_server_process_attends_with_the_compiled_kernel(compiled_decode: Callable[..., None]) -> None:
    """The shim as SGLang's processes import it: the decode method is the compiled one, and it says so on stderr;
    with ``AGENTRL_CPU_KERNELS=0`` the batched PyTorch path, and the reason."""
    code = ("import sgl_kernel; import sglang.srt.layers.attention.torch_native_backend as m; "
            "print(m.TorchNativeAttnBackend._run_sdpa_forward_decode.agentrl_compiled)")
    env = {**os.environ, "PYTHONPATH": str(SGL_KERNEL_CPU_DIR), "SGLANG_USE_CPU_ENGINE": "1"}
    out, off = _pythons((code, env), (code, {**env, "AGENTRL_CPU_KERNELS": "0"}))
    assert out.stdout.strip().splitlines()[-1:] == ["True"], out.stderr[-2000:]
    assert "compiled CPU decode attention loaded" in out.stderr
    assert off.stdout.strip().splitlines()[-1:] == ["False"], off.stderr[-2000:]
    assert "batched PyTorch path instead: AGENTRL_CPU_KERNELS=0" in off.stderr


def test_a_server_process_loads_the_library_its_launcher_built(compiled_decode: Callable[..., None],
                                                                tmp_path: Path) -> None:
    """``SGLangServer.prepare`` builds the kernel and names the library in the server's environment: the server's
    processes load that file without a compiler (none on their PATH here); a name that is not a file is ignored
    (they build as usual, and here say why they could not)."""
    from agentrl.engine.server import SGLangServer, SGLangServerConfig

    extra = SGLangServer(SGLangServerConfig(model_path="/m", device="cpu")).prepare()
    library = extra.get("AGENTRL_CPU_KERNEL_LIB", "")
    assert Path(library).is_file() and library.endswith(".so"), extra
    code = ("import sgl_kernel; import sglang.srt.layers.attention.torch_native_backend as m; "
            "print(m.TorchNativeAttnBackend._run_sdpa_forward_decode.agentrl_compiled)")
    env = {**os.environ, **extra, "PYTHONPATH": str(SGL_KERNEL_CPU_DIR), "SGLANG_USE_CPU_ENGINE": "1",
           "CXX": "no-such-compiler-agentrl", "AGENTRL_CACHE_DIR": str(tmp_path)}
    out, gone = _pythons((code, env), (code, {**env, "AGENTRL_CPU_KERNEL_LIB": str(tmp_path / "gone.so")}))
    assert out.stdout.strip().splitlines()[-1:] == ["True"], out.stderr[-2000:]
    assert gone.stdout.strip().splitlines()[-1:] == ["False"], gone.stderr[-2000:]
    assert "no-such-compiler-agentrl not on PATH" in gone.stderr


def test_prepare_turns_the_kernel_off_for_a_server_when_it_cannot_be_built(monkeypatch: pytest.MonkeyPatch,
                                                                            tmp_path: Path) -> None:
    from agentrl.engine.server import SGLangServer, SGLangServerConfig

    monkeypatch.setenv("AGENTRL_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "no-such-compiler-agentrl")
    assert SGLangServer(SGLangServerConfig(model_path="/m", device="cpu")).prepare() == {"AGENTRL_CPU_KERNELS": "0"}
    assert SGLangServer(SGLangServerConfig(model_path="/m", device="cuda")).prepare() == {}
    off = SGLangServerConfig(model_path="/m", device="cpu", env={"AGENTRL_SGLANG_CPU_PATCHES": "0"})
    assert SGLangServer(off).prepare() == {}
    assert not list(tmp_path.rglob("*.so"))
    monkeypatch.setenv("AGENTRL_CPU_KERNEL_LIB", str(tmp_path / "another-torch.so"))  # inherited: never passed on
    assert "AGENTRL_CPU_KERNEL_LIB" not in SGLangServer(off).environment()


def test_make_install_says_whether_the_kernel_was_built(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The line scripts/install_venv.sh prints, by the code it runs (a broken line once went unnoticed: the build
    succeeded and the script's `|| true` swallowed the traceback)."""
    from agentrl.engine.server import describe_cpu_kernel_build

    script = (Path(__file__).resolve().parents[2] / "scripts" / "install_venv.sh").read_text()
    assert "from agentrl.engine.server import describe_cpu_kernel_build" in script
    if _load_native().compiler() is not None:
        assert describe_cpu_kernel_build() == "agentrl: SGLang CPU decode kernel ready"
    monkeypatch.setenv("AGENTRL_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "no-such-compiler-agentrl")
    line = describe_cpu_kernel_build()
    assert line.startswith("agentrl: SGLang CPU decode kernel not built, the servers decode in PyTorch: no C++")


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


def test_a_batch_mixing_greedy_and_sampled_rows_is_drawn_as_sglangs_filtering_sampler_draws_it() -> None:
    """SGLang's top-k/top-p sampler for a batch where some rows filter: greedy rows (top-k 1) give the same token,
    rows without a cut draw from the same distribution (two-sample chi-square), rows with a real cut, and seeded or
    mask-returning calls, are SGLang's own."""
    from sglang.srt.layers.sampler import TOP_K_ALL
    from sglang.srt.layers.sampler import top_k_top_p_min_p_sampling_from_probs_torch as sglangs

    handed: list[int] = []  # rows each call handed to SGLang's function

    def counting(probs: torch.Tensor, *args: Any, **kw: Any) -> torch.Tensor:
        handed.append(probs.shape[0])
        return sglangs(probs, *args, **kw)

    fast = _load_fast_paths()._filtering_sampler_with_fast_path(counting)
    torch.manual_seed(0)
    vocab, n = 1000, 20_000
    support = torch.tensor([0, 255, 256, 511, 700, 999])
    row = torch.zeros(vocab)
    row[support] = torch.tensor([0.05, 0.15, 0.1, 0.2, 0.3, 0.2])
    probs = row.repeat(n, 1)
    greedy = torch.arange(n) % 4 == 0  # a greedy evaluation decoding beside sampled rows
    top_ks = torch.where(greedy, 1, TOP_K_ALL)
    top_ps, min_ps, positions = torch.ones(n), torch.zeros(n), torch.zeros(n, dtype=torch.long)
    ours = fast(probs, top_ks, top_ps, min_ps, False, None, positions)
    theirs = sglangs(probs, top_ks, top_ps, min_ps, False, None, positions)
    assert (ours.shape, ours.dtype) == (theirs.shape, theirs.dtype) == ((n,), torch.int32)
    assert set(ours[greedy].tolist()) == set(theirs[greedy].tolist()) == {700}
    a = torch.bincount(ours[~greedy].long(), minlength=vocab).double()
    b = torch.bincount(theirs[~greedy].long(), minlength=vocab).double()
    assert a[row == 0].sum() == b[row == 0].sum() == 0
    chi2 = float(((a[support] - b[support]) ** 2 / (a[support] + b[support])).sum())
    assert chi2 < 20.5, (a[support].tolist(), b[support].tolist())
    assert handed == []  # nothing of that batch sorted: the fast path drew every row

    # rows that cut (top-k 2, top-p 0.5, min-p): only the surviving tokens, as SGLang keeps them
    cut_ks = torch.tensor([2, TOP_K_ALL, TOP_K_ALL, 1])
    cut_ps, cut_min = torch.tensor([1.0, 0.5, 1.0, 1.0]), torch.tensor([0.0, 0.0, 0.9, 0.0])
    many = row.repeat(4, 1)
    for _ in range(50):
        got = fast(many, cut_ks, cut_ps, cut_min, True, None, torch.zeros(4, dtype=torch.long)).tolist()
        assert got[0] in (700, 511, 999) and got[1] in (700, 511, 999) and got[2] == 700 and got[3] == 700
    assert handed == [3] * 50  # the three rows with a cut went to SGLang's function, the greedy one did not

    calls = []

    def recording(*args: Any, **kw: Any) -> str:
        calls.append((args, kw))
        return "sglang's"

    seeded = _load_fast_paths()._filtering_sampler_with_fast_path(recording)
    args = (many, cut_ks, cut_ps, cut_min, True, torch.tensor([1, 2, 3, 4]), torch.zeros(4, dtype=torch.long))
    assert seeded(*args) == "sglang's" and calls[-1][0] == args
    assert seeded(*args[:5], None, args[6], return_filtered_probs=True) == "sglang's"
    assert calls[-1][1] == {"return_filtered_probs": True, "max_top_k": None}


@pytest.mark.sglang
async def test_sglang_logprobs_match_transformers(sglang_server: Any, sglang_url: str, tiny_model_path: Path) -> None:
    """Greedy and sampled continuations of prompts of different lengths, generated concurrently (so decode batches
    mix lengths and go through both fast paths: the compiled decode kernel where a compiler is), scored again by
    transformers in fp32."""
    from transformers import AutoModelForCausalLM

    compiler = _load_native().compiler()

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
    if compiler is not None and os.environ.get("AGENTRL_CPU_KERNELS") != "0":  # that was the compiled kernel's work
        log = Path(sglang_server.log_path).read_text()
        assert "compiled CPU decode attention loaded" in log
        assert "decode attention by the compiled kernel (first such call" in log
        assert "decode attention in PyTorch" not in log


def test_the_process_starting_servers_does_not_import_torch_for_the_kernel(tmp_path: Path) -> None:
    """The build (and its cache key, which needs torch) runs in a child: the rollout actor, which starts the servers
    and imports no torch otherwise, would hold its ~280 MB for the whole run."""
    code = ("import sys; from agentrl.engine.server import SGLangServer, SGLangServerConfig; "
            "extra = SGLangServer(SGLangServerConfig(model_path='/m', device='cpu')).prepare(); "
            "print(sorted(extra), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=False)
    expected = "['AGENTRL_CPU_KERNEL_LIB']" if _load_native().compiler() is not None else "['AGENTRL_CPU_KERNELS']"
    assert out.stdout.strip().splitlines()[-1:] == [f"{expected} False"], out.stderr[-2000:]


def test_a_build_process_that_dies_leaves_the_pytorch_path_and_says_why(monkeypatch: pytest.MonkeyPatch,
                                                                       tmp_path: Path) -> None:
    from agentrl.engine import server

    monkeypatch.setenv("AGENTRL_CACHE_DIR", str(tmp_path))  # a key of its own in the per-process cache
    monkeypatch.setattr(server.sys, "executable", "/bin/false")
    built, why = server.build_cpu_kernels()
    assert built is None and why == "the build process failed: exited with 1: (no output)"


def test_a_new_process_finds_the_built_kernel_without_the_build_process(monkeypatch: pytest.MonkeyPatch,
                                                                       tmp_path: Path) -> None:
    """The child that checks the build imports torch (~3 s at every server start in a new process, e.g. each run's
    rollout actor): what it found is written down under a fingerprint of its inputs, read with a few stats; a changed
    source, or a library gone from the cache, goes back to the child."""
    import shutil

    from agentrl.engine import server

    if _load_native().compiler() is None:
        pytest.skip("no C++ compiler: nothing is built")
    built, why = server.build_cpu_kernels()
    assert built is not None, why
    monkeypatch.setattr(server, "_BUILT", {})  # a new process
    monkeypatch.setattr(server.sys, "executable", "/bin/false")  # a build process now fails: only the memo answers
    assert server.build_cpu_kernels() == (built, None)
    memo = server._kernel_memo(None, os.environ.get("PATH"), os.environ.get("AGENTRL_CACHE_DIR"))
    assert memo is not None and memo.read_text() == str(built)

    monkeypatch.setattr(server, "_BUILT", {})
    changed = tmp_path / "sgl_kernel_cpu"
    shutil.copytree(server.SGL_KERNEL_CPU_DIR, changed)
    (changed / "sgl_kernel" / "_attention.cpp").write_text("// another kernel\n")
    monkeypatch.setattr(server, "SGL_KERNEL_CPU_DIR", changed)
    assert server._kernel_memo(None, os.environ.get("PATH"), os.environ.get("AGENTRL_CACHE_DIR")) != memo
    assert server.build_cpu_kernels()[0] is None  # the child's answer (here: it failed), not the old library

    monkeypatch.setenv("AGENTRL_CACHE_DIR", str(tmp_path / "cache"))  # a memo naming a library that is gone
    gone = server._kernel_memo(None, os.environ.get("PATH"), str(tmp_path / "cache"))
    assert gone is not None
    gone.parent.mkdir(parents=True)
    gone.write_text(str(tmp_path / "deleted.so"))
    assert server.build_cpu_kernels()[0] is None
    gone.write_bytes(b"\xff\xfe damaged")  # not even text: still an answer, not an exception
    assert server.build_cpu_kernels()[0] is None


def test_the_kernel_memo_changes_with_torchs_files(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Another torch (reinstalled, upgraded, another venv's) is another memo: the child is asked again."""
    import importlib.machinery
    import importlib.util
    import shutil

    from agentrl.engine import server

    if _load_native().compiler() is None:
        pytest.skip("no C++ compiler: the memo needs one")
    fake = tmp_path / "venv" / "torch"
    (fake / "lib").mkdir(parents=True)
    for name in ("__init__.py", "version.py", "lib/libtorch_cpu.so"):
        (fake / name).write_text("x")
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: importlib.machinery.ModuleSpec(
        "torch", None, origin=str(fake / "__init__.py")) if name == "torch" else real_find_spec(name, *a))

    def memo() -> Path | None:
        return server._kernel_memo(None, os.environ.get("PATH"), str(tmp_path / "cache"))

    first = memo()
    assert first is not None and first == memo()  # the same inputs, the same memo
    os.utime(fake / "version.py", ns=(1, 1))
    second = memo()
    (fake / "lib" / "libtorch_cpu.so").write_text("another build")
    third = memo()
    other = tmp_path / "other-venv" / "torch"
    shutil.copytree(fake, other, copy_function=shutil.copy2)  # the same stamps, another place
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: importlib.machinery.ModuleSpec(
        "torch", None, origin=str(other / "__init__.py")) if name == "torch" else real_find_spec(name, *a))
    assert len({first, second, third, memo()}) == 4
    (other / "version.py").unlink()
    assert memo() is None  # a part that cannot be read: no memo, the child decides
