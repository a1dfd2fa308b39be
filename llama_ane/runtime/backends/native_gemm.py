"""The native kernels of the torch backend on a CPU, built into one library: products of a few
columns with a prepacked weight (native_gemm.c, here) and attention of a few query rows over a KV
cache (native_attention.c, wrapped by native_attention.py).

One-token decoding and a verify window of a few tree nodes multiply every projection weight by 1 to
16 columns. On a CPU that product is bound by reading the weight once, but torch's `linear` and
oneDNN compute it nearly column by column: a window of 6 nodes costs ~1.5 one-token steps. The
kernel reads each weight once for all the columns (see the C file), so a one-token step and a
small window cost about the same; measured by `benchmarks/verify_columns.py`.

The library is compiled on first use with the C compiler at hand (`$CC`, else `cc`), optimised
for this CPU (-march=native on x86-64, -mcpu=native on arm64), with OpenMP threads where the
compiler has them, and cached under `$LLAMA_ANE_CACHE` (default `~/.cache/llama-ane`), keyed by
the sources, the compiler and the CPU. Before first use both kernels are checked against numpy. Without a
compiler (or with `LLAMA_ANE_NATIVE=0`) `library()` is None and the torch backend keeps oneDNN;
`unavailable()` says why. `forget()` drops what was found, so that the next call looks again.

    packed = pack(weight)                        # float32 (N, K) -> packed, built once
    y = columns(x, packed, n)                    # x (K, M) float32 (a view is fine) -> y (N, M)
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import torch

SOURCES = (Path(__file__).with_name("native_gemm.c"), Path(__file__).with_name("native_attention.c"))
DISABLE = "LLAMA_ANE_NATIVE"  # "0": never build or use the kernels


def cache_dir() -> Path:
    """Where built libraries are kept: $LLAMA_ANE_CACHE, else $XDG_CACHE_HOME/llama-ane or ~/.cache/llama-ane."""
    if os.environ.get("LLAMA_ANE_CACHE"):
        return Path(os.environ["LLAMA_ANE_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llama-ane"


def _cpu_signature() -> str:
    """What the build is specialised for: the machine, and on Linux the CPU model and its flags."""
    sig = [platform.system(), platform.machine()]
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags", "Features")):
                sig.append(line)
                if len(sig) == 4:
                    break
    except OSError:
        pass
    return "\n".join(sig)


def _flag_sets() -> list[list[str]]:
    """Compiler flags to try in order: tuned for this CPU with OpenMP, then without each."""
    arch = ["-march=native"] if platform.machine().lower() in ("x86_64", "amd64") else ["-mcpu=native"]
    base = ["-O3", "-std=c11", "-ffp-contract=fast", "-shared", "-fPIC"]
    return [base + arch + ["-fopenmp"], base + arch, base + ["-fopenmp"], base]


def _build(compiler: str) -> Path | None:
    """The library built for this CPU (from the cache, or compiled now); None if no flags compile."""
    sources, cpu = [src.read_bytes() for src in SOURCES], _cpu_signature().encode()
    for flags in _flag_sets():
        key = hashlib.sha256(b"\0".join([*sources, compiler.encode(), " ".join(flags).encode(), cpu])).hexdigest()[:16]
        path = cache_dir() / f"native_gemm-{key}.so"
        if path.exists():
            return path
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
        os.close(fd)
        try:
            done = subprocess.run([compiler, *flags, *map(str, SOURCES), "-o", tmp], capture_output=True, timeout=120)
            if done.returncode == 0:
                os.replace(tmp, path)  # whole or not at all, even with another process building too
                return path
        except (OSError, subprocess.TimeoutExpired):
            pass
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return None


def _check(lib: ctypes.CDLL) -> bool:
    """Whether the kernels compute x @ W^T (odd sizes, strided output) and attention (odd cache
    and window lengths) as numpy does."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((37, 29)).astype(np.float32)
    x = rng.standard_normal((9, 29)).astype(np.float32)
    rows = lib.llama_ane_panel_rows()
    packed = np.empty(-(-37 // rows) * rows * 29, np.float32)
    lib.llama_ane_pack(w.ctypes.data, packed.ctypes.data, 37, 29)
    y = np.full((37, 9), np.nan, np.float32)  # written transposed: (N, M)
    lib.llama_ane_gemm(x.ctypes.data, 29, 1, packed.ctypes.data, y.ctypes.data, 1, 9, 9, 37, 29, 1)
    if not np.allclose(y.T, x @ w.T, rtol=1e-4, atol=1e-4):
        return False
    g, r, d, s, t = 2, 3, 8, 3, 21
    q, k, v = (rng.standard_normal(shape).astype(np.float32) for shape in ((g, r, d, s), (g, d, t + s), (g, d, t + s)))
    mask = np.zeros((s, t + s), np.float32)
    mask[:, t:] = np.triu(np.full((s, s), -1e4, np.float32), 1)
    kw, vw = np.ascontiguousarray(k[..., t:]), np.ascontiguousarray(v[..., t:])
    out = np.full((g, r, d, s), np.nan, np.float32)
    lib.llama_ane_attend(q.ctypes.data, r * d * s, d * s, s, 1, k.ctypes.data, d * (t + s), t + s, v.ctypes.data,
                         d * (t + s), t + s, kw.ctypes.data, vw.ctypes.data, mask.ctypes.data, out.ctypes.data,
                         g, r, d, s, t, 1)
    scores = np.einsum("grds,gdu->grsu", q, k) + mask
    p = np.exp(scores - scores.max(axis=-1, keepdims=True))
    expected = np.einsum("grsu,gdu->grds", p / p.sum(axis=-1, keepdims=True), v)
    return bool(np.allclose(out, expected, rtol=1e-4, atol=1e-4))


@functools.lru_cache(maxsize=None)
def _loaded() -> tuple[ctypes.CDLL | None, str | None]:
    """(the kernels' library, None), built and checked on first call, or (None, why it cannot be)."""
    if os.environ.get(DISABLE, "1") == "0":
        return None, f"{DISABLE}=0"
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        return None, f"no C compiler ({compiler!r} not found; set CC)"
    try:
        path = _build(compiler)
    except OSError as e:
        return None, f"cannot write under {cache_dir()}: {e}; set LLAMA_ANE_CACHE"
    if path is None:
        return None, f"{compiler} could not compile {' and '.join(src.name for src in SOURCES)}"
    lib = ctypes.CDLL(str(path))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.llama_ane_pack.argtypes = [ptr, ptr, i64, i64]
    lib.llama_ane_pack.restype = None
    lib.llama_ane_gemm.argtypes = [ptr, i64, i64, ptr, ptr, i64, i64, i64, i64, i64, ctypes.c_int]
    lib.llama_ane_gemm.restype = None
    lib.llama_ane_panel_rows.restype = i64
    lib.llama_ane_attend.argtypes = [ptr, i64, i64, i64, i64, ptr, i64, i64, ptr, i64, i64, ptr, ptr, ptr, ptr,
                                     i64, i64, i64, i64, i64, ctypes.c_int]
    lib.llama_ane_attend.restype = ctypes.c_int
    lib.llama_ane_attention_channels.restype = i64
    if not _check(lib):
        return None, f"the kernels built at {path} give wrong results"
    return lib, None


def library() -> ctypes.CDLL | None:
    """The kernels' library, built and checked on first call; None where it cannot be (see `unavailable`)."""
    return _loaded()[0]


def available() -> bool:
    return library() is not None


def unavailable() -> str | None:
    """Why the kernels cannot be used here (None when it can)."""
    return _loaded()[1]


def forget() -> None:
    """Drop the library found (or the reason it was not), so that the next call looks again (after
    a change of $CC, $LLAMA_ANE_CACHE or $LLAMA_ANE_NATIVE)."""
    _loaded.cache_clear()


def pack(weight: torch.Tensor) -> torch.Tensor:
    """The packed copy of a float32 CPU weight (N, K): a flat float32 tensor of ceil(N / 16) * 16 * K."""
    lib = library()
    w = weight.detach().to(torch.float32).contiguous()
    n, k = w.shape
    rows = lib.llama_ane_panel_rows()
    out = torch.empty(-(-n // rows) * rows * k, dtype=torch.float32)
    lib.llama_ane_pack(w.data_ptr(), out.data_ptr(), n, k)
    return out


def columns(x: torch.Tensor, packed: torch.Tensor, n: int, threads: int | None = None) -> torch.Tensor:
    """W x for x float32 (K, M), any strides, and W (N, K) packed by `pack`: y float32 (N, M),
    contiguous. On `threads` threads (default: torch's)."""
    k, m = x.shape
    y = torch.empty(n, m, dtype=torch.float32)
    library().llama_ane_gemm(x.data_ptr(), x.stride(1), x.stride(0), packed.data_ptr(), y.data_ptr(), 1, m,
                             m, n, k, threads or torch.get_num_threads())
    return y
