"""The mil executor against torch and numpy references, on programs converted here.

Each case converts a small torch module (or a program written with coremltools' MIL builder),
saves it as an .mlpackage, runs it with `PackageExecutor` and compares with the reference:
tightly in fp32 mode (weights kept fp32 in the package), loosely in fp16 mode (fp16 package).
"""

from __future__ import annotations

import gc
import tempfile
import weakref

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

ct = pytest.importorskip("coremltools")
from coremltools.converters.mil import Builder as mb  # noqa: E402

from llama_ane.mil import PackageExecutor, UnsupportedOpError  # noqa: E402
from llama_ane.mil.executor import ExecutionError  # noqa: E402
from conftest import convert_to  # noqa: E402


def convert_torch(module, example: dict[str, torch.Tensor], path, *, fp16: bool, out_names):
    """Trace `module` on `example` (name -> tensor), convert to an iOS18 mlprogram and save."""
    module = module.eval()
    traced = torch.jit.trace(module, tuple(example.values()))
    float_type = np.float16 if fp16 else np.float32
    inputs = [
        ct.TensorType(name, shape=tuple(t.shape), dtype=np.int32 if t.dtype == torch.int32 else float_type)
        for name, t in example.items()
    ]
    return convert_to(traced, path, inputs=inputs, outputs=[ct.TensorType(n, dtype=float_type) for n in out_names],
                      compute_precision=ct.precision.FLOAT16 if fp16 else ct.precision.FLOAT32)


def save_program(prog, path, *, fp16: bool = False):
    return convert_to(prog, path, compute_precision=ct.precision.FLOAT16 if fp16 else ct.precision.FLOAT32)


def torch_reference(module, example):
    with torch.no_grad():
        out = module.eval()(*example.values())
    out = out if isinstance(out, tuple) else (out,)
    return [o.numpy() for o in out]


class LlamaLikeBlock(nn.Module):
    """The op mix of a block chunk: RMSNorm, 1x1 convs, per-head einsum attention, silu MLP."""

    def __init__(self, C=64, H=4, D=16, F_=96):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Conv2d(C, C, 1, bias=False) for _ in range(4))
        self.up = nn.Conv2d(C, F_, 1, bias=False)
        self.gate = nn.Conv2d(C, F_, 1, bias=False)
        self.down = nn.Conv2d(F_, C, 1, bias=True)
        self.norm = nn.Parameter(torch.rand(C) + 0.5)
        self.H, self.D, self.C = H, D, C

    def forward(self, x, cos, sin, mask):
        h = x * torch.rsqrt(x.pow(2).mean(1, keepdim=True) + 1e-5) * self.norm[None, :, None, None]
        q, k, v = self.q(h), self.k(h), self.v(h)
        heads = []
        for i in range(self.H):
            s = slice(i * self.D, (i + 1) * self.D)
            qi, ki, vi = q[:, s], k[:, s], v[:, s]
            half = self.D // 2
            qi = qi * cos + torch.cat([-qi[:, half:], qi[:, :half]], 1) * sin
            ki = ki * cos + torch.cat([-ki[:, half:], ki[:, :half]], 1) * sin
            scores = torch.einsum("bchq,bchk->bkhq", qi, ki) / self.D ** 0.5 + mask
            heads.append(torch.einsum("bkhq,bchk->bchq", scores.softmax(1), vi))
        x = x + self.o(torch.cat(heads, 1))
        y = self.down(F.silu(self.gate(x)) * self.up(x))
        return x + y, F.layer_norm(y.transpose(1, 3), (self.C,)).transpose(1, 3), y.amax(1)


def block_example(S=8, C=64, D=16):
    g = torch.Generator().manual_seed(1)
    mask = torch.triu(torch.full((S, S), -1e4), 1).T[None, :, None, :].contiguous()
    return {
        "x": torch.randn(1, C, 1, S, generator=g),
        "cos": torch.rand(1, D, 1, S, generator=g),
        "sin": torch.rand(1, D, 1, S, generator=g),
        "mask": mask,
    }


@pytest.fixture(scope="module")
def block_packages(tmp_path_factory):
    torch.manual_seed(0)
    module = LlamaLikeBlock()
    example = block_example()
    root = tmp_path_factory.mktemp("block")
    names = ["out", "ln", "mx"]
    return {
        "module": module,
        "example": example,
        "fp32": convert_torch(module, example, root / "b32.mlpackage", fp16=False, out_names=names),
        "fp16": convert_torch(module, example, root / "b16.mlpackage", fp16=True, out_names=names),
    }


def test_block_fp32_matches_torch(block_packages):
    ref = torch_reference(block_packages["module"], block_packages["example"])
    ex = PackageExecutor(block_packages["fp32"], precision="fp32")
    out = ex.run("main", {k: v.numpy() for k, v in block_packages["example"].items()})
    assert list(out) == ["out", "ln", "mx"]
    for got, want in zip(out.values(), ref):
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_block_fp16_stores_half_and_stays_close(block_packages):
    ref = torch_reference(block_packages["module"], block_packages["example"])
    feeds = {k: v.numpy().astype(np.float16) for k, v in block_packages["example"].items()}
    half = PackageExecutor(block_packages["fp16"], precision="fp16").run("main", feeds)
    wide = PackageExecutor(block_packages["fp16"], precision="fp32").run("main", feeds)
    for h, w, want in zip(half.values(), wide.values(), ref):
        assert h.dtype == np.float16 and w.dtype == np.float32
        np.testing.assert_allclose(h.astype(np.float32), want, atol=3e-2, rtol=3e-2)
        # fp16 storage must actually round something: the two modes differ, a little
        assert 0 < np.abs(h.astype(np.float32) - w).max() < 3e-2


@pytest.mark.parametrize("precision", ["fp16", "fp32"])
def test_stored_weights_give_the_same_outputs_with_half_the_bytes(block_packages, monkeypatch, precision):
    """widen_weights=False keeps the fp16 conv weights as stored and widens them per call, a few rows
    at a time (the block is shrunk here so every weight takes several): the same float32 products,
    summed by BLAS in blocks (so an fp16 output may round one ulp the other way), half the bytes."""
    from llama_ane.mil.kernels import linear

    monkeypatch.setattr(linear, "_WIDEN_BLOCK", 5 * 64)  # 5 rows of a 64-channel weight per block
    feeds = {k: v.numpy().astype(np.float16) for k, v in block_packages["example"].items()}
    wide = PackageExecutor(block_packages["fp16"], precision=precision)
    stored = PackageExecutor(block_packages["fp16"], precision=precision, widen_weights=False)
    for w, s in zip(wide.run("main", feeds).values(), stored.run("main", feeds).values()):
        assert s.dtype == w.dtype
        tol = 2 ** -10 if precision == "fp16" else 1e-6  # one fp16 ulp, or float32 rounding
        np.testing.assert_allclose(s.astype(np.float32), w.astype(np.float32), rtol=tol, atol=tol)
    if precision == "fp16":
        assert stored.held_weight_bytes() * 2 == pytest.approx(wide.held_weight_bytes(), rel=0.05)


class Embeddings(nn.Module):
    """gather by token id, a RoPE table sliced at a runtime position, a mask from the position."""

    def __init__(self, V=50, C=32, P=16, D=8):
        super().__init__()
        self.table = nn.Parameter(torch.randn(V, C))
        self.register_buffer("cos", torch.randn(P, D))

    def forward(self, ids, position):
        h = self.table[ids[0]].T[None, :, None, :]
        pos = position + torch.arange(ids.shape[1], dtype=torch.int32)
        cos = self.cos[pos].T[None, :, None, :]
        keys = torch.arange(16, dtype=torch.int32)[:, None]
        mask = torch.where(keys <= pos[None, :], 0.0, -1e4)[None, :, None, :]
        return h, cos, mask


def test_embeddings_gather_and_position_math(tmp_path):
    module = Embeddings()
    example = {"ids": torch.tensor([[3, 7, 49, 0]], dtype=torch.int32),
               "position": torch.tensor([5], dtype=torch.int32)}
    path = convert_torch(module, example, tmp_path / "emb.mlpackage", fp16=False, out_names=["h", "cos", "mask"])
    ex = PackageExecutor(path, precision="fp32")
    for position in (0, 5, 12):
        feeds = {"ids": example["ids"].numpy(), "position": np.array([position], dtype=np.int32)}
        ref = torch_reference(module, {"ids": example["ids"], "position": torch.tensor([position], dtype=torch.int32)})
        got = ex.run("main", feeds)
        for g, r in zip(got.values(), ref):
            np.testing.assert_allclose(g, r, rtol=1e-6, atol=1e-6)


class General(nn.Module):
    """Ops beyond the block: strided/grouped/padded conv, matmul with transpose, reductions, etc."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(8, 12, (3, 2), stride=(2, 1), padding=(1, 1), dilation=(1, 2), groups=4)
        self.lin = nn.Linear(6, 5)

    def forward(self, x, y):
        a = self.conv(x)
        b = torch.matmul(y, y.transpose(-1, -2))
        c = self.lin(y)
        d = torch.cat([y.sum(-1), y.max(-1)[0], y.mean(-1), torch.exp(y).log().sum(-1)], -1)
        e = F.gelu(y, approximate="tanh") + torch.sigmoid(y) * torch.tanh(y) + F.relu(y) - y.clamp(-0.3, 0.4)
        f = y[:, 1:3, ::2].reshape(1, -1) * 2 - y[:, :, -1:].flatten()[None, :3].repeat(1, 2)
        g = torch.argmax(y, -1).to(torch.float32)
        return a, b, c, d, e, f, g


def test_general_ops_fp32_match_torch(tmp_path):
    torch.manual_seed(3)
    module = General()
    example = {"x": torch.randn(1, 8, 9, 7), "y": torch.randn(1, 4, 6)}
    names = list("abcdefg")
    path = convert_torch(module, example, tmp_path / "gen.mlpackage", fp16=False, out_names=names)
    got = PackageExecutor(path, precision="fp32").run("main", {k: v.numpy() for k, v in example.items()})
    ref = torch_reference(module, example)
    for name, r in zip(names, ref):
        np.testing.assert_allclose(got[name], r, rtol=1e-4, atol=1e-5, err_msg=name)


def pymil_ops() -> int:
    """How many pymil operations are alive (reachable or not yet collected)."""
    from coremltools.converters.mil.mil import Operation

    return sum(isinstance(o, Operation) for o in gc.get_objects())


@pytest.mark.parametrize("widen_weights", [True, False])
def test_a_dropped_executor_leaves_no_program_behind(tmp_path, block_packages, widen_weights):
    """An executor keeps no pymil object: one would keep its whole program (every op and a copy of
    every weight, in reference cycles) alive until some later collection. Dropped, the executor is
    freed with everything it held, automatic collection off (streamed scoring holds one package at a
    time). The general ops include a grouped conv with a bias."""
    torch.manual_seed(3)
    general = convert_torch(General(), {"x": torch.randn(1, 8, 9, 7), "y": torch.randn(1, 4, 6)},
                            tmp_path / "gen.mlpackage", fp16=False, out_names=list("abcdefg"))
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        for path in (general, block_packages["fp16"]):
            before = pymil_ops()
            executor = PackageExecutor(path, precision="fp32", widen_weights=widen_weights)
            held = weakref.ref(executor)
            del executor
            assert held() is None, path.name
            assert pymil_ops() == before, path.name
    finally:
        if enabled:
            gc.enable()


def test_builder_ops_match_numpy(tmp_path):
    """Ops torch rarely emits, written directly with the MIL builder; references in numpy."""
    x_np = np.random.default_rng(0).standard_normal((2, 6, 5)).astype(np.float32)

    int32 = ct.converters.mil.mil.types.int32

    @mb.program(input_specs=[mb.TensorSpec(shape=(2, 6, 5)), mb.TensorSpec(shape=(2,), dtype=int32)])
    def prog(x, begin):
        band = mb.band_part(x=x, lower=1, upper=0)
        dyn = mb.slice_by_size(x=x, begin=mb.concat(values=[begin, [0]], axis=0), size=[1, 2, -1])
        parts = mb.split(x=x, split_sizes=[2, 4], axis=1)
        padded = mb.pad(x=x, pad=[1, 2], mode="reflect")
        cums = mb.cumsum(x=x, axis=1, exclusive=True, reverse=True)
        idx = mb.reduce_argmax(x=x, axis=2, keep_dims=True)
        along = mb.gather_along_axis(x=x, indices=idx, axis=2)
        l2 = mb.l2_norm(x=x, epsilon=1e-6)  # no kernel here: coremltools' value inference runs it
        inter = mb.concat(values=[x, mb.mul(x=x, y=2.0)], axis=2, interleave=True)
        return band, dyn, parts[1], padded, cums, along, l2, inter

    path = save_program(prog, tmp_path / "ops.mlpackage")
    ex = PackageExecutor(path, precision="fp32")
    got = list(ex.run("main", {"x": x_np, "begin": np.array([1, 3], dtype=np.int32)}).values())
    i, j = np.arange(6)[:, None], np.arange(5)[None, :]
    np.testing.assert_allclose(got[0], np.where((i - j <= 1) & (j - i <= 0), x_np, 0))
    np.testing.assert_allclose(got[1], x_np[1:2, 3:5, :])
    np.testing.assert_allclose(got[2], x_np[:, 2:])
    np.testing.assert_allclose(got[3], np.pad(x_np, [(0, 0), (0, 0), (1, 2)], mode="reflect"))
    rev = np.flip(x_np, 1)
    np.testing.assert_allclose(got[4], np.flip(np.cumsum(rev, 1) - rev, 1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[5], x_np.max(2, keepdims=True))
    # MIL l2_norm of a rank-3 tensor normalises over all three axes
    np.testing.assert_allclose(got[6], x_np / np.sqrt((x_np ** 2).sum() + 1e-6), rtol=1e-5)
    np.testing.assert_allclose(got[7], np.stack([x_np, 2 * x_np], 3).reshape(2, 6, 10))


def test_unknown_op_names_op_and_package(tmp_path):
    @mb.program(input_specs=[mb.TensorSpec(shape=(1, 2, 4, 4))])
    def prog(x):
        return mb.avg_pool(x=x, kernel_sizes=[2, 2], strides=[2, 2], pad_type="valid")

    path = save_program(prog, tmp_path / "pooling.mlpackage")
    with pytest.raises(UnsupportedOpError, match=r"avg_pool.*pooling\.mlpackage"):
        PackageExecutor(path)


def test_wrong_input_shape_is_a_clear_error(block_packages):
    ex = PackageExecutor(block_packages["fp32"], precision="fp32")
    feeds = {k: v.numpy() for k, v in block_packages["example"].items()}
    feeds["x"] = feeds["x"][..., :4]
    with pytest.raises(ExecutionError, match="input 'x' has shape"):
        ex.run("main", feeds)


def _conv_softmax_package(path, S, weight):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.c = nn.Conv2d(32, 48, 1, bias=False)
            self.c.weight.data = weight

        def forward(self, x):
            return self.c(x).softmax(1)

    return convert_torch(M(), {"x": torch.zeros(1, 32, 1, S)}, path, fp16=True, out_names=["y"])


def test_multifunction_package_runs_every_function_on_shared_weights(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # save_multifunction's temporary package
    weight = torch.randn(48, 32, 1, 1) / 6
    one = _conv_softmax_package(tmp_path / "s1.mlpackage", 1, weight)
    four = _conv_softmax_package(tmp_path / "s4.mlpackage", 4, weight)
    desc = ct.utils.MultiFunctionDescriptor()
    desc.add_function(str(one), src_function_name="main", target_function_name="decode")
    desc.add_function(str(four), src_function_name="main", target_function_name="prefill")
    desc.default_function_name = "decode"
    multi = tmp_path / "multi.mlpackage"
    ct.utils.save_multifunction(desc, str(multi))

    ex = PackageExecutor(multi, precision="fp16")
    assert sorted(ex.function_names) == ["decode", "prefill"]
    x = np.random.default_rng(1).standard_normal((1, 32, 1, 4)).astype(np.float16)
    w = weight.reshape(48, 32).numpy().astype(np.float16).astype(np.float32)
    logits = np.einsum("oc,bcs->bos", w, x.astype(np.float32).reshape(1, 32, 4)).reshape(1, 48, 1, 4)
    want = np.exp(logits - logits.max(1, keepdims=True))
    want /= want.sum(1, keepdims=True)
    np.testing.assert_allclose(ex.run("prefill", {"x": x})["y"], want, atol=2e-3)
    np.testing.assert_allclose(ex.run("decode", {"x": x[..., :1]})["y"], want[..., :1], atol=2e-3)
    # both functions read the one weight of the package: no more held than for a single function
    assert ex.held_weight_bytes() == PackageExecutor(one).held_weight_bytes() > 0
    with pytest.raises(Exception, match="no function 'verify'"):
        ex.run("verify", {"x": x})


def test_reading_a_package_leaves_it_as_it_was(tmp_path):
    """Opening a package (its spec, its description, its program) writes nothing into it: coremltools'
    load_spec writes Manifest.json back, which made every load of an export hash its packages again.
    A Manifest.json that does not name a model file of the package is refused, saying which."""
    import json
    import shutil

    from llama_ane.mil import MilPackage, PackageError
    from llama_ane.mil.package import read_spec

    @mb.program(input_specs=[mb.TensorSpec(shape=(1, 4))])
    def prog(x):
        return mb.add(x=x, y=np.arange(4, dtype=np.float32).reshape(1, 4))

    path = save_program(prog, tmp_path / "add.mlpackage")

    def state():
        return {p.relative_to(path).as_posix(): (p.read_bytes(), p.stat().st_ino, p.stat().st_mtime_ns,
                                                 p.stat().st_ctime_ns) for p in path.rglob("*") if p.is_file()}
    before = state()
    package = MilPackage(path)
    package.describe()
    PackageExecutor(package, precision="fp32").run("main", {"x": np.zeros((1, 4), np.float32)})
    assert state() == before
    assert read_spec(path) == ct.utils.load_spec(str(shutil.copytree(path, tmp_path / "copy.mlpackage")))

    manifest = json.loads((path / "Manifest.json").read_text())
    root = manifest["itemInfoEntries"][manifest["rootModelIdentifier"]]
    root["path"] = "com.apple.CoreML/missing.mlmodel"
    (path / "Manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(PackageError, match=r"names the model 'com.apple.CoreML/missing.mlmodel', which is not a file"):
        MilPackage(path)
    (path / "Manifest.json").write_text("{}")
    with pytest.raises(PackageError, match=r"Manifest.json does not name the package's model \(KeyError"):
        MilPackage(path)
