"""The native kernel for products of a few columns (runtime/backends/native_gemm) and the torch
backend's modules on it."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from llama_ane.chunks.layers import Conv1x1
from llama_ane.runtime.backends import native_gemm
from llama_ane.runtime.backends.base import BackendError
from llama_ane.runtime.backends.torch_backend import TorchBackend
from llama_ane.runtime.backends.torch_modules import NativeConv1x1, with_cpu_kernels

needs_kernel = pytest.mark.skipif(not native_gemm.available(), reason=f"no native kernel: {native_gemm.unavailable()}")


@pytest.fixture
def fresh_library(monkeypatch, tmp_path):
    """`native_gemm.library()` rebuilt from scratch under a temporary cache, and restored after."""
    monkeypatch.setenv("LLAMA_ANE_CACHE", str(tmp_path))
    native_gemm.forget()
    yield
    native_gemm.forget()


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n, k", [(16, 8), (37, 29), (200, 96)])
def test_columns_match_a_matmul(n, k, threads):
    """W x for 1..25 columns (one to three register blocks, of up to 6 or 12 columns by the CPU),
    rows not a multiple of the panel, a transposed (strided) x, on 1 and 2 threads."""
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g)
    packed = native_gemm.pack(w)
    for m in range(1, 26):
        x = torch.randn(m, k, generator=g).t()  # (K, M), a view with strides (1, K)
        y = native_gemm.columns(x, packed, n, threads=threads)
        assert y.shape == (n, m) and y.is_contiguous()
        torch.testing.assert_close(y, w @ x, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_a_column_does_not_depend_on_the_others():
    """Each output column is the same bits whether computed alone or in a window of any size, so
    a verify window's projections are exactly those of one-token decoding."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(300, 576, generator=g)
    packed = native_gemm.pack(w)
    x = torch.randn(576, 25, generator=g)
    alone = torch.cat([native_gemm.columns(x[:, j:j + 1], packed, 300) for j in range(25)], dim=1)
    for m in (2, 5, 6, 7, 8, 12, 13, 16, 25):
        assert torch.equal(native_gemm.columns(x[:, :m], packed, 300), alone[:, :m])


@needs_kernel
def test_native_conv_is_the_conv():
    """`NativeConv1x1` gives Conv1x1's product (with and without bias) for (1, C, 1, S) windows and
    batched (B, C, H, S) inputs; a module's Conv1x1s are all swapped by with_cpu_kernels."""
    torch.manual_seed(0)
    for bias in (False, True):
        conv = Conv1x1(48, 40, bias=bias).eval()
        native = NativeConv1x1(conv)
        for shape in ((1, 48, 1, 1), (1, 48, 1, 7), (2, 48, 3, 5)):
            x = torch.randn(shape)
            torch.testing.assert_close(native(x), conv(x), rtol=1e-5, atol=1e-5)
    block = torch.nn.Sequential(Conv1x1(8, 8), torch.nn.ReLU(), Conv1x1(8, 4))
    clone = with_cpu_kernels(block, "native")
    assert [type(m).__name__ for m in clone] == ["NativeConv1x1", "ReLU", "NativeConv1x1"]
    assert [type(m).__name__ for m in block] == ["Conv1x1", "ReLU", "Conv1x1"]  # the original is untouched


@pytest.mark.skipif(shutil.which(os.environ.get("CC") or "cc") is None or os.environ.get("LLAMA_ANE_NATIVE") == "0",
                    reason="no C compiler, or the kernel is disabled")
def test_the_kernel_builds_and_checks_out_where_there_is_a_compiler():
    """Where a C compiler is at hand the kernel must build and pass its check against numpy: a
    kernel that computes wrong products is refused (and the backend keeps oneDNN), which this
    makes a failure rather than a skip."""
    assert native_gemm.available(), native_gemm.unavailable()


def test_disabled_or_without_compiler_says_why(fresh_library, monkeypatch):
    monkeypatch.setenv("LLAMA_ANE_NATIVE", "0")
    assert native_gemm.library() is None and native_gemm.unavailable() == "LLAMA_ANE_NATIVE=0"
    native_gemm.forget()
    monkeypatch.delenv("LLAMA_ANE_NATIVE")
    monkeypatch.setenv("CC", "no-such-compiler-xyz")
    assert native_gemm.library() is None and "no C compiler" in native_gemm.unavailable()


def test_a_compiler_that_fails_leaves_nothing_behind(fresh_library, monkeypatch, tmp_path):
    """A compiler that cannot build the source: no library, a reason, and no partial file in the cache."""
    fake = tmp_path / "bin" / "cc-fails"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho broken >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    assert native_gemm.library() is None and "could not compile" in native_gemm.unavailable()
    assert not list(tmp_path.glob("*.so")) and not list(tmp_path.glob("tmp*"))


@needs_kernel
def test_the_build_is_cached(fresh_library, tmp_path):
    assert native_gemm.library() is not None
    built = list(tmp_path.glob("native_gemm-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    native_gemm.forget()
    assert native_gemm.library() is not None and built[0].stat().st_mtime_ns == stamp  # not rebuilt


def test_prepack_values_are_checked(tmp_path):
    manifest = {"models": {}}
    with pytest.raises(BackendError, match="prepack must be one of"):
        TorchBackend(tmp_path, manifest, prepack="fast")
    with pytest.raises(BackendError, match="prepack needs fp32"):
        TorchBackend(tmp_path, manifest, precision="fp16", prepack="native")
