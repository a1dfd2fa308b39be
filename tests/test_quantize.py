"""Compressed exports: the numerics (k-means LUTs, integer blocks), the options and their errors,
and tiny exports whose compressed programs run on the mil and torch backends alike."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from llama_ane.quantize import Compression, QuantizeError, QuantizeOptions, check_divides, stored_bytes
from llama_ane.quantize.kmeans import kmeans_1d, lut_compress, lut_decompress
from llama_ane.quantize.linear import int_compress, int_decompress
from llama_ane.quantize.scaled_lut import scaled_lut_compress, scaled_lut_decompress


# ---- numerics ----------------------------------------------------------------------------------------------------

def exact_kmeans_error(values: np.ndarray, k: int) -> float:
    """The optimal 1-D k-means squared error, by dynamic programming over the sorted values
    (clusters are intervals of them)."""
    x = np.sort(values.astype(np.float64))
    n = len(x)
    s1 = np.concatenate([[0], np.cumsum(x)])
    s2 = np.concatenate([[0], np.cumsum(x * x)])
    best = np.full((k + 1, n + 1), np.inf)
    best[0, 0] = 0
    for c in range(1, k + 1):
        for j in range(c, n + 1):
            i = np.arange(c - 1, j)  # the last cluster holds values i..j-1
            cost = s2[j] - s2[i] - (s1[j] - s1[i]) ** 2 / (j - i)
            best[c, j] = np.min(best[c - 1, i] + cost)
    return float(best[k, n])


@pytest.mark.parametrize("dist", ["normal", "laplace"])
def test_kmeans_is_close_to_the_optimum(dist):
    """On groups the size of real weights' (here 1500 values) the start and 30 iterations land
    within 5% of the optimal error."""
    rng = np.random.default_rng(0)
    groups = getattr(rng, dist)(size=(2, 1500)).astype(np.float32)
    k = 16
    centroids = kmeans_1d(torch.from_numpy(groups), k)
    assert centroids.shape == (2, k) and torch.all(centroids[:, 1:] >= centroids[:, :-1])
    for g in range(2):
        c = centroids[g].numpy().astype(np.float64)
        ours = float(np.min((groups[g][:, None] - c[None, :]) ** 2, axis=1).sum())
        assert ours <= 1.05 * exact_kmeans_error(groups[g], k)  # within 5% of the best possible


@pytest.mark.parametrize("n", [96, 100])  # a multiple of the bin size, and not (read value by value)
@pytest.mark.parametrize("weighted", [False, True])
def test_rank_sums_equal_prefix_sums_at_every_rank(n, weighted):
    """Lloyd's cluster sums come from binned prefix sums plus the values of the bin a rank falls
    in; at every rank 0..N they equal a plain float64 prefix sum (to the float32 rounding of a
    bin's 8 values)."""
    from llama_ane.quantize.kmeans import RankSums

    rng = np.random.default_rng(3)
    xs = np.sort(rng.standard_normal((3, n)).astype(np.float32), axis=1)
    ws = rng.random((3, n)).astype(np.float32) if weighted else None
    below = RankSums(torch.from_numpy(xs), None if ws is None else torch.from_numpy(ws))
    ranks = torch.arange(n + 1).repeat(3, 1)
    sums, mass = below(ranks)
    w = np.ones_like(xs, np.float64) if ws is None else ws.astype(np.float64)
    want = np.concatenate([np.zeros((3, 1)), np.cumsum(w * xs, axis=1)], axis=1)
    np.testing.assert_allclose(sums.numpy(), want, rtol=0, atol=1e-5)  # ~float32 eps x the sums of |values|
    if weighted:
        want_mass = np.concatenate([np.zeros((3, 1)), np.cumsum(w, axis=1)], axis=1)
        np.testing.assert_allclose(mass.numpy(), want_mass, rtol=0, atol=1e-5)
    else:
        assert mass is None



@pytest.mark.parametrize("n", [96, 100])
@pytest.mark.parametrize("weighted", [False, True])
def test_rank_search_is_searchsorted_and_its_sums(n, weighted):
    """The search over bin starts then within a bin gives torch.searchsorted's ranks (ties,
    targets below every value and above every value included) and the sums at those ranks."""
    from llama_ane.quantize.kmeans import RankSums

    rng = np.random.default_rng(4)
    xs = np.sort(rng.integers(-20, 20, (3, n)).astype(np.float32) / 4, axis=1)  # many ties
    ws = rng.random((3, n)).astype(np.float32) if weighted else None
    below = RankSums(torch.from_numpy(xs), None if ws is None else torch.from_numpy(ws))
    targets = np.sort(np.concatenate([xs[:, ::7], xs[:, ::11] + 0.1, np.full((3, 2), -9.0), np.full((3, 2), 9.0)],
                                     axis=1), axis=1)
    t = torch.from_numpy(np.ascontiguousarray(targets))
    ranks, sums, mass = below.search(t)
    assert torch.equal(ranks, torch.searchsorted(torch.from_numpy(xs), t))
    want_sums, want_mass = below(ranks)
    assert torch.equal(sums, want_sums) if n % 8 else torch.allclose(sums, want_sums, rtol=0, atol=1e-5)
    assert (mass is None) == (not weighted)
    if weighted:
        assert torch.allclose(mass, want_mass, rtol=0, atol=1e-5)
    assert (ranks[:, :2] == 0).all() and (ranks[:, -2:] == n).all()


def test_starting_centroids_of_one_group_larger_than_float32_counts():
    """A LUT per tensor of SmolLM2's table (49152 x 576 values, past float32's exact integers)."""
    from llama_ane.quantize.kmeans import companded_start

    n = 49152 * 576
    start = companded_start(torch.arange(n, dtype=torch.float32)[None], 64)
    assert start.shape == (1, 64) and 0 < start[0, 0] < start[0, -1] < n - 1


def test_weighted_kmeans_lowers_the_weighted_error():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((32, 64, 1, 1)).astype(np.float16)
    importance = np.where(np.arange(64) < 8, 100.0, 0.01)  # a few input channels matter
    weighted_err = []
    for imp in (None, importance):
        indices, lut = lut_compress(w, 3, 16, imp)
        err = (lut_decompress(indices, lut).astype(np.float32) - w) ** 2
        weighted_err.append(float((err * importance[None, :, None, None]).sum()))
    assert weighted_err[1] < 0.95 * weighted_err[0]


@pytest.mark.parametrize("bits, group", [(4, 16), (6, 4), (8, 0)])
def test_lut_round_trip(bits, group):
    w = (np.random.default_rng(2).standard_normal((64, 48, 1, 1)) * 0.02).astype(np.float16)
    indices, lut = lut_compress(w, bits, group)
    groups = 1 if group == 0 else 64 // group
    assert indices.shape == w.shape and indices.dtype == np.uint8 and indices.max() < 2 ** bits
    assert lut.shape == (groups, 2 ** bits) and lut.dtype == np.float16
    dense = lut_decompress(indices, lut)
    for g in range(groups):  # each group only takes values of its own LUT
        rows = slice(g * (64 // groups), (g + 1) * (64 // groups))
        assert set(np.unique(dense[rows])) <= set(lut[g])
    rel = float(((dense.astype(np.float32) - w) ** 2).mean() / (w.astype(np.float32) ** 2).mean())
    assert rel < {4: 0.02, 6: 0.002, 8: 0.0002}[bits]


def relative_error(dense: np.ndarray, w: np.ndarray) -> float:
    return float(((dense.astype(np.float32) - w) ** 2).mean() / (w.astype(np.float32) ** 2).mean())


def test_scaled_lut_reproduces_blocks_on_their_own_grids():
    """A weight block-quantized before (every block of 32 on its own 16-value grid, as GGUF's Q4_1
    makes them): a plain LUT per 16 rows cannot hold those grids, a scaled one holds them all."""
    rng = np.random.default_rng(4)
    scale = rng.uniform(0.005, 0.02, (64, 4, 1)).astype(np.float16).astype(np.float32)
    low = (rng.standard_normal((64, 4, 1)) * 0.02).astype(np.float16).astype(np.float32)
    q = rng.integers(0, 16, (64, 4, 32))
    q[..., 0], q[..., 1] = 0, 15  # a block's min and max are its grid's ends
    w = (q * scale + low).astype(np.float16).reshape(64, 128, 1, 1)
    indices, lut, s, o = scaled_lut_compress(w, 4, 16, 32)
    assert indices.shape == w.shape and indices.dtype == np.uint8 and indices.max() < 16
    assert lut.shape == (4, 16) and s.shape == o.shape == (64, 4, 1, 1) and s.dtype == o.dtype == np.float16
    scaled = relative_error(scaled_lut_decompress(indices, lut, s, o), w)
    plain = relative_error(lut_decompress(*lut_compress(w, 4, 16)), w)
    assert scaled < 1e-6 and plain > 1000 * scaled, (scaled, plain)


def test_scaled_lut_beats_integer_blocks_of_the_same_size():
    """Same bytes as int4 in blocks of 32 (codes, and a scale and offset per block) plus a LUT per
    16 rows, which learns where in a block's range Gaussian weights are dense."""
    w = (np.random.default_rng(5).standard_normal((128, 256, 1, 1)) * 0.02).astype(np.float16)
    scaled = relative_error(scaled_lut_decompress(*scaled_lut_compress(w, 4, 16, 32)), w)
    integer = relative_error(int_decompress(*int_compress(w, 4, 32)), w)
    assert scaled < 0.97 * integer, (scaled, integer)


def test_scaled_lut_weighs_important_input_channels():
    rng = np.random.default_rng(6)
    w = (rng.standard_normal((32, 64, 1, 1)) * 0.02).astype(np.float16)
    importance = np.where(np.arange(64) < 8, 100.0, 1.0).astype(np.float32)
    errors = []
    for imp in (None, importance):
        dense = scaled_lut_decompress(*scaled_lut_compress(w, 3, 16, 0, imp))
        errors.append(float((((dense - w.astype(np.float32)) ** 2) * importance[None, :, None, None]).sum()))
    assert errors[1] < 0.95 * errors[0], errors


@pytest.mark.parametrize("bits, block, symmetric", [(4, 32, False), (8, 0, False), (8, 0, True), (4, 16, True)])
def test_integer_blocks_round_to_the_nearest_step(bits, block, symmetric):
    w = (np.random.default_rng(3).standard_normal((16, 64, 1, 1)) * 0.05).astype(np.float16)
    w[0, :32] = 0  # an all-zero block
    data, scale, offset = int_compress(w, bits, block, symmetric=symmetric)
    blocks = 64 // (block or 64)
    assert scale.shape == (16, blocks, 1, 1) and (offset is None) == symmetric
    if symmetric:
        assert data.dtype == np.int8 and data.min() >= -2 ** (bits - 1) and data.max() <= 2 ** (bits - 1) - 1
    else:
        assert data.dtype == np.uint8 and data.max() <= 2 ** bits - 1
    dense = int_decompress(data, scale, offset)
    def per_value(a):  # one value per block -> per weight
        return np.repeat(a.reshape(16, blocks).astype(np.float32), 64 // blocks, axis=1).reshape(w.shape)
    step, target = per_value(scale), w.astype(np.float32)
    if not symmetric:  # a searched range may clip a block's ends: values beyond it go to the nearest end
        lo, hi = -per_value(offset) * step, (2 ** bits - 1 - per_value(offset)) * step
        target = np.clip(target, np.minimum(lo, hi), np.maximum(lo, hi))
    assert np.all(np.abs(dense - target) <= step / 2 + 1e-3 * np.abs(w) + 1e-6)
    if symmetric or block:
        assert np.all(dense[0, :32] == 0)


def test_int4_ranges_are_searched_and_grids_kept():
    """Clipped ranges and least-squares refits lower the error of Gaussian blocks well below
    min-max; blocks already on a 4-bit grid (as a Q4_1 checkpoint's) stay at least as exact."""
    from llama_ane.quantize import linear

    rng = np.random.default_rng(4)
    gauss = (rng.standard_normal((64, 128)) * 0.05).astype(np.float16)
    q = rng.integers(0, 16, (64, 4, 32))
    step, low = rng.random((64, 4, 1)) * 0.01 + 0.001, -rng.random((64, 4, 1)) * 0.08
    grid = (q * step.astype(np.float16) + low.astype(np.float16)).astype(np.float16).reshape(64, 128)
    importance = np.where(np.arange(128) < 16, 50.0, 1.0)

    def error(w, weights=1.0, **kw):
        data, scale, offset = int_compress(w, 4, 32, **kw)
        return float((weights * (int_decompress(data, scale, offset) - w.astype(np.float32)) ** 2).sum())

    searched = {name: error(w) for name, w in (("gauss", gauss), ("grid", grid))}
    weighted = error(gauss, importance, importance=importance)
    saved = linear.CLIPS, linear.REFITS
    linear.CLIPS, linear.REFITS = (0.0,), 0  # min and max only
    try:
        plain = {name: error(w) for name, w in (("gauss", gauss), ("grid", grid))}
        plain_weighted = error(gauss, importance)
    finally:
        linear.CLIPS, linear.REFITS = saved
    assert searched["gauss"] < 0.9 * plain["gauss"]
    assert searched["grid"] <= plain["grid"] and searched["grid"] < 1e-3 * float((grid.astype(np.float32) ** 2).sum())
    assert weighted < plain_weighted


def test_fp16_keys_sort_as_the_values():
    from llama_ane.quantize.kmeans import _fp16_keys

    values = np.concatenate([np.random.default_rng(5).standard_normal(1000) * 10.0 ** np.arange(-3, 2).repeat(200),
                             [0.0, -0.0, 6e-8, -6e-8, 65504.0, -65504.0]]).astype(np.float16)
    order = np.argsort(_fp16_keys(values), kind="stable")
    assert np.all(np.diff(values[order].astype(np.float32)) >= 0)


def test_lut_of_float32_weights_matches_fp16():
    """fp16 weights are sorted by their bit patterns, other dtypes by value: the same LUTs, and the
    same codes but where a value sits on the midpoint of two float32 LUT values that fp16 rounds."""
    w = (np.random.default_rng(6).standard_normal((32, 96)) * 0.02).astype(np.float16)
    a_idx, a_lut = lut_compress(w, 4, 16)
    b_idx, b_lut = lut_compress(w.astype(np.float32), 4, 16)
    assert np.array_equal(a_lut, b_lut.astype(np.float16))
    assert np.mean(a_idx == b_idx) > 0.99


@pytest.mark.parametrize("nbits", [1, 2, 3, 4, 6, 8])
def test_packed_codes_are_coremltools_bytes(nbits, monkeypatch):
    from coremltools.optimize._utils import pack_elements_into_bits

    from llama_ane.export import compressed

    monkeypatch.setattr(compressed, "PACK_ELEMENTS", 1 << 10)  # several blocks, one of them short
    rng = np.random.default_rng(nbits)
    for n in (1, 5, 1000, 3001):
        codes = rng.integers(0, 1 << nbits, n).astype(np.uint8)
        assert np.array_equal(compressed.pack_bits(codes, nbits), pack_elements_into_bits(codes, nbits))
    signed = rng.integers(-8, 8, 77).astype(np.int8)
    assert np.array_equal(compressed.pack_bits(signed, 4), pack_elements_into_bits(signed, 4))


def test_stored_bytes_count_codes_and_tables():
    assert stored_bytes((64, 32), None) == 64 * 32 * 2
    assert stored_bytes((64, 32), Compression("lut4", group_size=16)) == 64 * 32 // 2 + 4 * 16 * 2
    # a scale and an offset (fp16) per row and block; no offsets when symmetric
    assert stored_bytes((64, 32), Compression("int4", block_size=16)) == 64 * 32 // 2 + 64 * 2 * (2 + 2)
    assert stored_bytes((64, 32), Compression("int8", block_size=0, symmetric=True)) == 64 * 32 + 64 * 2
    # a scaled LUT: the codes, the LUTs, and a scale and an offset per row and block
    assert (stored_bytes((64, 32), Compression("lut4", group_size=16, block_size=16, scaled=True))
            == 64 * 32 // 2 + 4 * 16 * 2 + 64 * 2 * (2 + 2))


# ---- options -----------------------------------------------------------------------------------------------------

def test_options_per_part_and_defaults():
    q = QuantizeOptions.from_cli("lut4", lm_head="lut6", embeddings="none")
    assert q.schemes == {"embeddings": "none", "attention": "lut4", "mlp": "lut4", "lm_head": "lut6"}
    # lut4 scales its values per output channel by default (a form the ANE runs just in time)
    assert q.compression("mlp", "iOS18") == Compression("lut4", group_size=16, block_size=0, scaled=True)
    assert q.compression("mlp", "iOS17") == Compression("lut4", group_size=0)  # one plain LUT per tensor there
    assert q.compression("embeddings", "iOS18") is None
    assert QuantizeOptions.from_cli("int4").compression("mlp", "iOS18") == Compression("int4", block_size=32)
    assert QuantizeOptions.from_cli("int8").compression("mlp", "iOS16") == Compression("int8", symmetric=True)
    assert q.describe("iOS18")["lm_head"] == {"scheme": "lut6", "group_size": 8, "device_path": "just-in-time"}
    scaled = QuantizeOptions.from_cli("lut4", embeddings="int8", lut_block_size=32)
    assert scaled.compression("mlp", "iOS18") == Compression("lut4", group_size=16, block_size=32, scaled=True)
    assert scaled.describe("iOS18")["mlp"] == {"scheme": "lut4", "group_size": 16, "block_size": 32,
                                               "device_path": "at-load"}
    assert scaled.compression("embeddings", "iOS18") == Compression("int8", block_size=0)  # not a LUT


@pytest.mark.parametrize("kwargs, target, words", [
    (dict(quantize="lut3"), "iOS18", ["lut3", "is not a scheme", "lut4"]),
    (dict(quantize="none", mlp="int2"), "iOS18", ["--quantize-mlp", "int2"]),
    (dict(quantize="int4"), "iOS17", ["int4", "iOS18", "int8 or lut4"]),
    (dict(quantize="lut4", group_size=16), "macOS14", ["--group-size", "macOS15"]),
    (dict(quantize="int8", block_size=32), "iOS16", ["--block-size", "iOS18"]),
    (dict(quantize="lut6", lut_block_size=32), "iOS17", ["--lut-block-size", "iOS18"]),
    (dict(quantize="lut4", lut_block_size=-1), "iOS18", ["--lut-block-size", ">= 0"]),
])
def test_options_a_target_cannot_run_are_refused(kwargs, target, words):
    with pytest.raises(QuantizeError) as err:
        QuantizeOptions.from_cli(**kwargs).check(target)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_a_group_or_block_size_must_divide_the_channels():
    with pytest.raises(QuantizeError, match="--group-size 48 does not divide the 64 output channels of w"):
        check_divides("w", (64, 32), Compression("lut4", group_size=48))
    with pytest.raises(QuantizeError, match="--block-size 24 does not divide the 32 input channels"):
        check_divides("w", (64, 32), Compression("int4", block_size=24))
    with pytest.raises(QuantizeError, match="--lut-block-size 24 does not divide the 32 input channels"):
        check_divides("w", (64, 32), Compression("lut4", group_size=16, block_size=24, scaled=True))


def run_export(*args):
    from llama_ane.cli import main

    return CliRunner().invoke(main, ["export", *map(str, args)])


@pytest.mark.parametrize("options, words", [
    (["--quantize", "lut5"], ["lut5", "is not a scheme"]),
    (["--quantize", "int4", "--target", "iOS17"], ["int4", "iOS18"]),
    (["--quantize", "lut4", "--group-size", "48"], ["--group-size 48", "does not divide"]),
    (["--quantize", "lut4", "--lut-block-size", "24"], ["--lut-block-size 24", "does not divide"]),
    (["--quantize", "lut4", "--precision", "fp32"], ["--precision fp32"]),
])
def test_bad_quantize_options_are_one_error_line_and_nothing_written(tiny_checkpoint, tmp_path, options, words):
    out = tmp_path / "out"
    r = run_export(tiny_checkpoint(), "-o", out, "--context-length", "64", "--prefill-length", "32", "--quiet",
                   *options)
    assert r.exit_code == 1
    error = [ln for ln in r.output.splitlines() if ln.startswith("Error:")]
    assert len(error) == 1 and all(w in error[0] for w in words), r.output
    assert not out.exists() and not list(tmp_path.glob(".out.partial-*"))


# ---- exports -----------------------------------------------------------------------------------------------------

EXPORTS = {  # name -> (target, options)
    "lut": ("iOS18", dict(quantize="lut4", quantize_lm_head="lut6", quantize_embeddings="lut8")),
    "int": ("iOS18", dict(quantize="int4", quantize_embeddings="int8", quantize_attention="int8")),
    "ios17": ("iOS17", dict(quantize="lut4", quantize_attention="int8")),
    "scaled": ("iOS18", dict(quantize="lut4", quantize_lm_head="lut6", lut_block_size=32)),
}


@pytest.fixture(scope="module")
def quantized(tiny_checkpoint, tmp_path_factory):
    """Tiny exports in every constexpr form: grouped LUTs, blockwise integers, scaled LUTs (a LUT
    op feeding a blockwise one; iOS18) and the iOS16 forms (one LUT per tensor, int8 per channel)
    of an iOS17 target."""
    from llama_ane.api import export_model

    ckpt = tiny_checkpoint(num_hidden_layers=2, head_dim=32)
    root = tmp_path_factory.mktemp("quantized")
    # with decode functions and the cascade's: several functions of a package over one copy of the weights
    made = {"fp16": export_model(ckpt, root / "fp16", context_length=64, prefill_length=16, branch_width=2,
                                 suffix_length=32, decode_function="decode", progress=False, verify=False)}
    for name, (target, options) in EXPORTS.items():
        made[name] = export_model(ckpt, root / name, context_length=64, prefill_length=16, branch_width=2,
                                  suffix_length=32, target=target, decode_function="decode", progress=False,
                                  verify=False, **options)
    return made


@pytest.mark.export
@pytest.mark.parametrize("name", list(EXPORTS))
def test_mil_and_torch_run_the_same_decompressed_weights(quantized, name):
    """The conversion check of verify: the programs (mil, fp32) against the torch modules on the
    export's own decompressed weights; the issue asks top-1 >= 0.99, here they agree to float32."""
    from llama_ane.verify import verify_export

    report = verify_export(quantized[name], with_transformers=False)
    print(report)
    (conversion,) = report.comparisons  # the text (no verify function: the export's default window is 0)
    assert conversion.reference.endswith("same weights)")
    assert conversion.top1_agreement >= 0.99 and conversion.max_abs_diff < 1e-3


@pytest.mark.export
@pytest.mark.parametrize("name", list(EXPORTS))
def test_manifest_records_the_schemes_and_the_bytes(quantized, name):
    from llama_ane.contract.manifest import read_manifest

    m = read_manifest(quantized[name])
    target, options = EXPORTS[name]
    want = QuantizeOptions.from_cli(options["quantize"], embeddings=options.get("quantize_embeddings"),
                                    attention=options.get("quantize_attention"),
                                    lm_head=options.get("quantize_lm_head"),
                                    lut_block_size=options.get("lut_block_size")).describe(target)
    assert m["quantization"] == want
    for model, w in m["weights"].items():
        if model != "cache_update":
            assert 0 < w["bytes"] < w["dense_bytes"], model
    dense = read_manifest(quantized["fp16"])["weights"]
    assert m["weights"]["chunk_0"]["dense_bytes"] == dense["chunk_0"]["dense_bytes"]


@pytest.mark.export
def test_inspect_reports_compressed_and_dense_bytes(quantized):
    from llama_ane.export.inspect import inspect_path

    report = inspect_path(quantized["lut"])
    assert not report.violations, report.violations
    chunk = next(p for p in report.packages if p.file == "chunk_0.mlpackage")
    fn = chunk.functions[0]
    assert fn.dense_weight_bytes > 2 * fn.weight_bytes > 0
    assert "constexpr_lut_to_dense" in fn.op_histogram
    assert "MB dense" in report.format_text()
    # a scaled LUT is two ops and one dense weight: as many dense bytes as the plain LUTs' export
    scaled_report = inspect_path(quantized["scaled"])
    assert not scaled_report.violations, scaled_report.violations
    scaled = next(p for p in scaled_report.packages if p.file == "chunk_0.mlpackage").functions[0]
    assert scaled.op_histogram["constexpr_blockwise_shift_scale"] == scaled.op_histogram["constexpr_lut_to_dense"]
    assert scaled.dense_weight_bytes == fn.dense_weight_bytes and fn.weight_bytes < scaled.weight_bytes


@pytest.mark.export
def test_a_scaled_table_read_by_gather_is_not_held_to_the_ane_limits(quantized, monkeypatch):
    """The embedding table's LUT values feed its scale op, whose output only gather reads: neither
    reaches the ANE. With the dimension limit below the vocabulary, only the LM head breaks it."""
    from llama_ane.export import ane_rules
    from llama_ane.export.inspect import inspect_path

    monkeypatch.setattr(ane_rules, "MAX_DIM", 256)  # the tiny vocabulary has 320 tokens
    violations = inspect_path(quantized["scaled"]).violations
    # the LM head's (in its own package, or in the last chunk's when folded into it), none from the table
    assert violations and all(v.rule == "max-dim" and not v.package.startswith("embeddings") for v in violations)
    assert any("heads_" in v.message for v in violations), violations


@pytest.mark.export
def test_inspect_flags_compression_the_target_cannot_run(quantized):
    from llama_ane.export.inspect import inspect_path

    assert not inspect_path(quantized["ios17"]).violations  # the iOS16 forms run on iOS17
    report = inspect_path(quantized["lut"], target="iOS17")
    rules = {v.rule for v in report.violations}
    assert "compression-op" in rules
    assert any("per-grouped-channel LUT" in v.message and "iOS18" in v.message for v in report.violations)
    report = inspect_path(quantized["int"], target="macOS14")
    assert any("blockwise or 4-bit" in v.message and "macOS15" in v.message for v in report.violations)


@pytest.mark.export
@pytest.mark.parametrize("name", ["lut", "scaled"])
def test_mil_decompresses_each_weight_once_per_package(quantized, name):
    from llama_ane.mil import PackageExecutor

    path = quantized[name] / "chunk_0.mlpackage"
    stored = PackageExecutor(path, precision="fp16", widen_weights=False)
    # prefill, decode and decode_branches share the weights (no verify function unless asked for)
    assert sorted(stored.function_names) == ["decode", "decode_branches", "prefill"]
    dense = json.loads((quantized[name] / "manifest.json").read_text())["weights"]["chunk_0"]["dense_bytes"]
    assert stored.held_weight_bytes() == pytest.approx(dense, rel=0.01)  # one fp16 copy, not four


@pytest.mark.export
def test_a_quantized_export_generates_on_both_backends(quantized):
    import llama_ane

    outs = []
    for backend in ("torch", "mil"):
        model = llama_ane.load(quantized["int"], backend=backend, precision="fp32")
        try:
            outs.append(model.generate([5, 9, 13, 21], max_new_tokens=8).token_ids)
        finally:
            model.close()
    assert outs[0] == outs[1]


@pytest.mark.export
def test_info_prints_schemes_and_bytes_per_token(quantized):
    from llama_ane.cli import main

    r = CliRunner().invoke(main, ["info", str(quantized["lut"]), "--bandwidth", "50"])
    assert r.exit_code == 0, r.output
    assert "attention lut4" in r.output and "lm_head lut6" in r.output and "embeddings lut8" in r.output
    assert "decompressed" in r.output and "MB dense" in r.output and "upper bound" in r.output


# ---- eval --------------------------------------------------------------------------------------------------------

@pytest.mark.export
def test_eval_against_a_reference_export(quantized):
    from llama_ane.cli import main

    r = CliRunner().invoke(main, ["eval", str(quantized["lut"]), "--reference", str(quantized["fp16"]),
                                  "--window", "48", "--json", "--quiet"])  # no progress line beside the JSON
    assert r.exit_code == 0, r.output
    report = json.loads(r.output)
    lengths = [min(48, report["tokens"] - s) for s in range(0, report["tokens"], 48)]
    assert report["tokens"] > 2000 and report["windows"] == sum(n > 1 for n in lengths)
    assert report["predictions"] == sum(n - 1 for n in lengths if n > 1)
    assert np.isfinite(report["perplexity"]) and report["perplexity"] > 1
    assert 0 <= report["top1_agreement"] <= 1 and report["mean_kl"] > 0
    assert report["quantization"]["mlp"]["scheme"] == "lut4"


@pytest.mark.export
def test_eval_of_an_export_against_itself(quantized):
    from llama_ane.evaluate import evaluate

    report = evaluate(quantized["fp16"], reference=quantized["fp16"], window=64, backend="torch")
    assert report.perplexity == pytest.approx(report.reference_perplexity)
    assert report.top1_agreement == 1.0 and report.mean_kl == pytest.approx(0, abs=1e-9)
    assert "+0.00%" in str(report)


@pytest.mark.export
def test_eval_perplexity_is_the_mean_negative_log_likelihood(quantized):
    """Against a direct computation from the logits `score` gives."""
    import llama_ane
    from llama_ane.evaluate import evaluate, log_softmax

    text = "The bakery opens at six, and the first loaves are out of the oven by seven. " * 6
    report = evaluate(quantized["fp16"], text, window=32, backend="torch")
    model = llama_ane.load(quantized["fp16"], backend="torch")
    try:
        ids = model.encode(text)
        nll = []
        for start in range(0, len(ids), 32):
            part = ids[start:start + 32]
            if len(part) > 1:
                logp = log_softmax(model.score(part))
                nll += [-logp[t, part[t + 1]] for t in range(len(part) - 1)]
    finally:
        model.close()
    assert report.perplexity == pytest.approx(float(np.exp(np.mean(nll))), rel=1e-9)


@pytest.mark.export
def test_eval_errors(quantized, tiny_checkpoint, tmp_path):
    from llama_ane.cli import main

    short = tmp_path / "short.txt"
    short.write_text("Too short.")
    r = CliRunner().invoke(main, ["eval", str(quantized["fp16"]), "--text", str(short)])
    assert r.exit_code == 1 and "at least" in r.output
    other = tmp_path / "other"
    shutil.copytree(quantized["fp16"], other)
    m = json.loads((other / "manifest.json").read_text())
    m["config"]["rms_norm_eps"] = 1e-3
    (other / "manifest.json").write_text(json.dumps(m))
    r = CliRunner().invoke(main, ["eval", str(quantized["fp16"]), "--reference", str(other)])
    assert r.exit_code == 1 and "another model" in r.output


@pytest.mark.parametrize("options", [dict(quantize="lut4", lm_head="lut6"),
                                     dict(quantize="int4", attention="none")])
def test_compression_units_cover_each_compressed_weight_once(tiny_checkpoint, monkeypatch, options):
    """Compressed weights are cut into jobs for every worker: each weight's row blocks tile it, in
    whole LUT groups; a tensor-wide LUT (iOS17) stays whole."""
    from llama_ane.contract.plan import ExportOptions, plan_export
    from llama_ane.checkpoint.loader import load_checkpoint
    from llama_ane.export import convert

    monkeypatch.setattr(convert, "UNIT_WEIGHTS", 1000)
    cfg = load_checkpoint(tiny_checkpoint(num_hidden_layers=3, head_dim=32)).config
    for target in ("iOS18", "iOS17"):
        if target == "iOS17" and "int4" in options.values():
            continue
        quantize = QuantizeOptions.from_cli(**options)
        plan = plan_export(cfg, ExportOptions(context_length=64, prefill_length=16, layers_per_chunk=2,
                                              target=target, quantize=quantize))
        units = convert.compression_units(plan)
        work = {}  # the k-means work of each package's units: they come package by package, most work first
        for u in units:
            work[u.spec.file] = work.get(u.spec.file, 0) + u.weights * plan.compression(u.pieces[0].name).bits
        order = [u.spec.file for u in units]
        assert order == sorted(order, key=lambda f: (-work[f], order.index(f)))
        for file in work:  # and in each package, the largest units first
            sizes = [u.weights for u in units if u.spec.file == file]
            assert sizes == sorted(sizes, reverse=True)
        assert all(u.weights == sum(p.weights for p in u.pieces) and {p.spec for p in u.pieces} == {u.spec}
                   for u in units)
        pieces = [p for u in units for p in u.pieces]
        assert sorted(pieces, key=lambda p: p.file) == sorted(convert.weight_rows(plan), key=lambda p: p.file)
        for spec in plan.packages:
            wanted = plan.compressed_weights(spec)
            mine = [p for p in pieces if p.spec == spec]
            assert {u.name for u in mine} == set(wanted)
            for name, shape in wanted.items():
                blocks = sorted((u.start, u.end) for u in mine if u.name == name)
                c = plan.compression(name)
                assert blocks[0][0] == 0 and blocks[-1][1] == shape[0]
                assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))
                if c.kind == "lut":
                    assert all(start % (c.group_size or shape[0]) == 0 for start, _ in blocks)
                    if not c.group_size:
                        assert blocks == [(0, shape[0])]
                    elif shape[0] * shape[1] > 2000:
                        assert len(blocks) > 1


def test_a_package_built_from_compressed_units_is_the_one_built_alone(tiny_checkpoint, tmp_path, monkeypatch):
    """Compressing in units across workers, then building from their payloads, writes the same
    package, byte for byte, as compressing inside the build."""
    from llama_ane.contract.plan import ExportOptions, plan_export
    from llama_ane.checkpoint.loader import load_checkpoint
    from llama_ane.export import convert

    monkeypatch.setattr(convert, "UNIT_WEIGHTS", 2000)
    ckpt = load_checkpoint(tiny_checkpoint(num_hidden_layers=2, head_dim=32))
    quantize = QuantizeOptions.from_cli("lut4", lm_head="lut6", attention="int4")
    plan = plan_export(ckpt.config, ExportOptions(context_length=64, prefill_length=16, branch_width=2,
                                                  suffix_length=32, quantize=quantize))
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    for unit in convert.compression_units(plan):
        convert.compress_unit(unit, plan, ckpt, scratch)
    for spec in plan.packages:
        if not plan.compressed_weights(spec):
            continue
        built = {}
        for how, payloads in (("alone", None), ("units", scratch)):
            folder = tmp_path / f"{how}-{spec.model}"
            folder.mkdir()
            built[how] = convert.build_package(spec, plan, ckpt, folder, payloads=payloads)
        blobs = [p / "Data" / "com.apple.CoreML" / "weights" / "weight.bin" for p in built.values()]
        assert blobs[0].read_bytes() == blobs[1].read_bytes(), spec.file


@pytest.mark.export
def test_calibration_runs_beside_the_compression_it_feeds(tiny_checkpoint, tmp_path):
    """The calibration as the first worker job, its statistics saved layer by layer for the units
    waiting on them, gives the packages that statistics known beforehand give."""
    import functools

    from llama_ane.export.quality import calibrate
    from llama_ane.contract.plan import ExportOptions, plan_export
    from llama_ane.checkpoint.loader import load_checkpoint
    from llama_ane.export import convert

    ckpt = load_checkpoint(tiny_checkpoint(num_hidden_layers=2, head_dim=32))
    quantize = QuantizeOptions.from_cli("lut4", lm_head="lut6", attention="int4", embeddings="int8")
    plan = plan_export(ckpt.config, ExportOptions(context_length=64, prefill_length=16, branch_width=0,
                                                  quantize=quantize))
    said, compressed, built = [], [], []
    known = calibrate(ckpt, said.append)
    for name, kwargs in (("known", dict(importance=known)),
                         ("job", dict(calibration=functools.partial(calibrate, ckpt, said.append)))):
        (tmp_path / name).mkdir()
        convert.convert_all(plan, ckpt, tmp_path / name, workers=2, progress=built.append,
                            compressed=lambda spec, weights: compressed.append(weights), **kwargs)
    assert sum(compressed) == 2 * sum(u.weights for u in convert.compression_units(plan))  # the progress bar's
    assert sorted(p.file for p in built) == sorted(2 * [p.file for p in plan.packages])
    for spec in plan.packages:
        blob = Path(spec.file) / "Data" / "com.apple.CoreML" / "weights" / "weight.bin"
        assert (tmp_path / "known" / blob).read_bytes() == (tmp_path / "job" / blob).read_bytes(), spec.file
    assert not (tmp_path / "job" / ".scratch").exists()


@pytest.mark.export
def test_a_unit_whose_statistics_never_come_is_a_clear_error(tiny_checkpoint, tmp_path):
    from llama_ane.contract.plan import ExportOptions, plan_export
    from llama_ane.checkpoint.loader import load_checkpoint
    from llama_ane.export import convert

    ckpt = load_checkpoint(tiny_checkpoint(num_hidden_layers=2, head_dim=32))
    plan = plan_export(ckpt.config, ExportOptions(context_length=64, prefill_length=16, branch_width=0,
                                                  quantize=QuantizeOptions.from_cli("lut4")))
    with pytest.raises(convert.ConversionError, match="the calibration saved no statistics"):
        convert.convert_all(plan, ckpt, tmp_path, workers=2, calibration=lambda on_found: None)


def _small_units_plan(tiny_checkpoint, monkeypatch):
    from llama_ane.contract.plan import ExportOptions, plan_export
    from llama_ane.checkpoint.loader import load_checkpoint
    from llama_ane.export import convert

    monkeypatch.setattr(convert, "UNIT_WEIGHTS", 2000)
    ckpt = load_checkpoint(tiny_checkpoint(num_hidden_layers=2, head_dim=32))
    plan = plan_export(ckpt.config, ExportOptions(context_length=64, prefill_length=16, branch_width=0,
                                                  quantize=QuantizeOptions.from_cli("lut4", lm_head="lut6")))
    return ckpt, plan


@pytest.mark.export
def test_compression_units_run_in_kept_workers(tiny_checkpoint, tmp_path, monkeypatch):
    """Units go to workers kept for them (one per slot, reused from unit to unit); builds still get a
    process each, which an idle kept worker makes room for."""
    from llama_ane.export import convert

    ckpt, plan = _small_units_plan(tiny_checkpoint, monkeypatch)
    pids = tmp_path / "pids"
    real_unit, real_build = convert.compress_unit, convert.build_package

    def unit(*args, **kwargs):
        with open(pids, "a") as f:
            f.write(f"unit {os.getpid()}\n")
        return real_unit(*args, **kwargs)

    def build(*args, **kwargs):
        with open(pids, "a") as f:
            f.write(f"build {os.getpid()}\n")
        return real_build(*args, **kwargs)
    monkeypatch.setattr(convert, "compress_unit", unit)
    monkeypatch.setattr(convert, "build_package", build)
    (tmp_path / "out").mkdir()
    convert.convert_all(plan, ckpt, tmp_path / "out", workers=2, importance={})
    runs = [line.split() for line in pids.read_text().splitlines()]
    units = [pid for kind, pid in runs if kind == "unit"]
    builds = [pid for kind, pid in runs if kind == "build"]
    assert len(units) == len(convert.compression_units(plan)) > 4
    assert len(set(units)) <= len(units) // 2  # kept workers, not one process per unit
    assert len(builds) == len(plan.packages) == len(set(builds)) and not set(builds) & set(units)
    assert all((tmp_path / "out" / spec.file).exists() for spec in plan.packages)


@pytest.mark.export
def test_a_kept_worker_that_grew_past_its_share_leaves(tiny_checkpoint, tmp_path, monkeypatch):
    """A kept worker whose memory grew by more than a compression worker's share of the memory
    plan goes after its unit (here every unit: a share of nothing), and the export goes on."""
    from llama_ane.export import budget, convert

    ckpt, plan = _small_units_plan(tiny_checkpoint, monkeypatch)
    monkeypatch.setattr(budget, "COMPRESS_BYTES", -1)
    pids, real_unit = tmp_path / "pids", convert.compress_unit

    def unit(*args, **kwargs):
        with open(pids, "a") as f:
            f.write(f"{os.getpid()}\n")
        return real_unit(*args, **kwargs)
    monkeypatch.setattr(convert, "compress_unit", unit)
    (tmp_path / "out").mkdir()
    convert.convert_all(plan, ckpt, tmp_path / "out", workers=2, importance={})
    runs = pids.read_text().split()
    assert len(runs) == len(set(runs)) == len(convert.compression_units(plan))
    assert all((tmp_path / "out" / spec.file).exists() for spec in plan.packages)


@pytest.mark.parametrize("how, words", [("raises", r"compressing .* failed: ValueError: bad unit"),
                                        ("is killed", r"compressing .* killed by signal 9")])
@pytest.mark.export
def test_a_failing_unit_in_a_kept_worker_is_a_clear_error(tiny_checkpoint, tmp_path, monkeypatch, how, words):
    from llama_ane.export import convert

    ckpt, plan = _small_units_plan(tiny_checkpoint, monkeypatch)
    real_unit, calls = convert.compress_unit, tmp_path / "calls"

    def unit(*args, **kwargs):
        with open(calls, "a") as f:
            f.write("x")
        if len(calls.read_text()) == 3:  # the third unit, in a worker that already ran one
            if how == "raises":
                raise ValueError("bad unit")
            os.kill(os.getpid(), signal.SIGKILL)
        return real_unit(*args, **kwargs)
    monkeypatch.setattr(convert, "compress_unit", unit)
    (tmp_path / "out").mkdir()
    with pytest.raises(convert.ConversionError, match=words):
        convert.convert_all(plan, ckpt, tmp_path / "out", workers=2, importance={})
    assert not (tmp_path / "out" / ".scratch").exists()


# ---- device paths, recipes and --quantize auto --------------------------------------------------------------------

@pytest.mark.parametrize("c, path", [
    (Compression("lut4", group_size=0), "just-in-time"),  # per tensor
    (Compression("lut4", group_size=16), "just-in-time"),  # per grouped channel
    (Compression("lut6", group_size=8, block_size=0, scaled=True), "just-in-time"),  # a per-channel scale
    (Compression("lut4", group_size=16, block_size=32, scaled=True), "at-load"),  # scaled per block: the GPU's form
    (Compression("int8", block_size=0, symmetric=True), "just-in-time"),
    (Compression("int8", block_size=32), "at-load"),
    (Compression("int4", block_size=0), "at-load"),
    (Compression("int4", block_size=32), "at-load"),
])
def test_every_form_has_its_device_path(c, path):
    assert c.device_path == path


def test_units_of_exported_weights():
    from llama_ane.quantize.auto import unit_of, units

    assert unit_of("layers.12.q_proj.weight") == "layers.12.attention"
    assert unit_of("layers.3.mlp.down_proj.weight") == "layers.3.mlp"
    assert unit_of("heads.2.weight") == "lm_head" and unit_of("embed_tokens.weight") == "embeddings"
    assert unit_of("layers.3.input_layernorm.weight") is None and unit_of("rope_cos") is None
    assert units(2) == ["embeddings", "layers.0.attention", "layers.0.mlp", "layers.1.attention", "layers.1.mlp",
                        "lm_head"]


def brute_force(costs, budget):
    import itertools

    best = None
    names = list(costs)
    for forms in itertools.product(*(list(costs[u]) for u in names)):
        size = sum(costs[u][f][0] for u, f in zip(names, forms))
        kl = sum(costs[u][f][1] for u, f in zip(names, forms))
        if kl <= budget and (best is None or size < best):
            best = size
    return best


def unit_costs(count: int, seed: int, mean: float, spread: float) -> dict:
    """Costs of `count` MLP units for `choose`: fp16 and each candidate, their KLs lognormal per
    unit (`mean`, `spread`) and 4x larger for every 2 bits fewer."""
    from llama_ane.quantize.auto import CANDIDATES

    rng = np.random.default_rng(seed)
    costs = {}
    for u in range(count):
        sensitivity = rng.lognormal(mean, spread)
        costs[f"layers.{u}.mlp"] = {None: (1000, 0.0)}
        for c in CANDIDATES:
            costs[f"layers.{u}.mlp"][c] = (1000 * c.bits // 16 + 10, sensitivity * 4.0 ** (4 - c.bits))
    return costs


@pytest.mark.parametrize("seed", range(5))
def test_choose_fits_the_budget_in_about_the_fewest_bytes(seed):
    from llama_ane.quantize.auto import CANDIDATES, choose

    costs = unit_costs(6, seed, mean=-4, spread=1.5)
    total_kl = sum(max(k for _, k in options.values()) for options in costs.values())
    for budget in (0.0, total_kl * 0.1, total_kl * 0.5, total_kl * 2):
        forms = choose(costs, budget)
        size = sum(costs[u][f][0] for u, f in forms.items())
        assert sum(costs[u][f][1] for u, f in forms.items()) <= budget + 1e-12
        assert size <= brute_force(costs, budget) * 1.1  # a Lagrangian choice: near the optimum
    assert all(f is None for f in choose(costs, 0.0).values())  # no budget: fp16 everywhere
    assert all(f == CANDIDATES[0] for f in choose(costs, total_kl * 2).values())  # room for the fewest bits


def searched(scale: float, budget: float = 2.0, floor: float = 0.0):
    """What `search` returns, and every choice it measured, on 12 units whose measured increase is
    `scale` times the estimate (estimates low above 1, high below), plus `floor`."""
    from llama_ane.quantize.auto import Recipe, change_pct
    from llama_ane.quantize.sensitivity import search

    costs = unit_costs(12, 0, mean=-6, spread=1.0)
    tried = []

    def measure(forms, attempt):
        kl = sum(costs[u][f][1] for u, f in forms.items())
        size = sum(costs[u][f][0] for u, f in forms.items())
        tried.append(Recipe(forms, budget, change_pct(kl), scale * change_pct(kl) + floor, extra={"weight_bytes": size}))
        return tried[-1]

    return search(costs, budget, measure), tried


def test_search_spends_room_the_estimates_left():
    """Estimates that run high leave room: the search chooses again, in fewer bytes, within the budget."""
    from llama_ane.quantize.auto import MAX_RETRIES

    best, tried = searched(0.3)
    assert 1 < len(tried) <= MAX_RETRIES + 1
    assert best.measured_pct <= 2.0 and best.extra["weight_bytes"] < tried[0].extra["weight_bytes"]
    assert best.extra["weight_bytes"] == min(r.extra["weight_bytes"] for r in tried if r.measured_pct <= 2.0)


def test_search_tightens_after_a_choice_over_the_budget():
    best, tried = searched(3.0)
    assert tried[0].measured_pct > 2.0 and len(tried) > 1 and best.measured_pct <= 2.0


def test_search_without_a_choice_within_the_budget_returns_the_least_lossy():
    best, tried = searched(3.0, budget=0.1, floor=0.5)
    assert len(tried) > 1 and best.measured_pct == min(r.measured_pct for r in tried)


def test_a_recipe_round_trips_and_bad_ones_are_named(tmp_path):
    from llama_ane.quantize.auto import Recipe

    recipe = Recipe({"embeddings": Compression("lut6", group_size=8), "layers.0.mlp": Compression("lut4", group_size=16),
                     "layers.1.attention": None,
                     "lm_head": Compression("lut4", group_size=16, block_size=32, scaled=True)}, budget_pct=5.0,
                    measured_pct=3.2, measured_on="512 tokens")
    recipe.save(tmp_path / "r.json")
    again = Recipe.load(tmp_path / "r.json")
    assert again.forms == recipe.forms and again.budget_pct == 5.0
    # an export's manifest holds its recipe: it is a recipe file too
    (tmp_path / "manifest.json").write_text(json.dumps({"quantization": {"recipe": recipe.to_dict()}}))
    assert Recipe.load(tmp_path / "manifest.json").forms == recipe.forms
    cases = {
        "not json": ("{", "is not JSON"),
        "no format": (json.dumps({"units": {}}), "is not a quantization recipe"),
        "version": (json.dumps({"format": "llama-ane-quantize-recipe", "version": 9, "units": {}}), "version 9"),
        "unit": (json.dumps({"format": "llama-ane-quantize-recipe", "version": 1,
                             "units": {"layers.x.mlp": {"scheme": "lut4"}}}), "'layers.x.mlp' is not a unit"),
        "scheme": (json.dumps({"format": "llama-ane-quantize-recipe", "version": 1,
                               "units": {"lm_head": {"scheme": "lut5"}}}), "units.lm_head: scheme 'lut5'"),
        "size": (json.dumps({"format": "llama-ane-quantize-recipe", "version": 1,
                             "units": {"lm_head": {"scheme": "lut4", "group_size": -2}}}), "group_size must be"),
    }
    for name, (text, words) in cases.items():
        (tmp_path / "bad.json").write_text(text)
        with pytest.raises(QuantizeError, match="--quantize-recipe .*bad.json") as err:
            Recipe.load(tmp_path / "bad.json")
        assert words in str(err.value), (name, str(err.value))
    with pytest.raises(QuantizeError, match="cannot read --quantize-recipe"):
        Recipe.load(tmp_path / "missing.json")
    with pytest.raises(QuantizeError, match="layers.7.mlp.*layers 0..1"):
        Recipe({"layers.7.mlp": None}).check(2)


def test_a_recipe_gives_each_layer_its_form_and_the_plan_its_bytes():
    from llama_ane.config import LlamaConfig
    from llama_ane.contract.plan import ExportOptions, plan_export
    from llama_ane.quantize.auto import Recipe
    from llama_ane.testing import TINY_CONFIG

    cfg = LlamaConfig.from_hf_dict({**TINY_CONFIG, "vocab_size": 320, "num_hidden_layers": 2, "head_dim": 32})
    lut4, lut8 = Compression("lut4", group_size=16), Compression("lut8", group_size=16)
    recipe = Recipe({"layers.0.mlp": lut4, "layers.1.mlp": lut8, "layers.0.attention": lut4,
                     "lm_head": Compression("lut4", group_size=16, block_size=32, scaled=True)})
    q = QuantizeOptions.from_recipe(recipe)
    assert q.compression("mlp", "iOS18", "layers.1.mlp") == lut8 and q.compression("mlp", "iOS18") == lut4
    assert q.compression("embeddings", "iOS18") is None
    described = q.describe("iOS18")
    assert described["mlp"]["units"] == {"lut4 group 16": 1, "lut8 group 16": 1}
    assert described["recipe"]["units"]["layers.1.mlp"] == {"scheme": "lut8", "group_size": 16}
    assert described["lm_head"]["device_path"] == "at-load"
    with pytest.raises(QuantizeError, match="layers.0.mlp.*iOS18"):
        q.check("iOS17")
    opts = ExportOptions(context_length=64, prefill_length=16, branch_width=0, layers_per_chunk=1, quantize=q,
                         fold_lm_head="no")
    plan = plan_export(cfg, opts)
    chunk0, chunk1 = (next(p for p in plan.packages if p.model == f"chunk_{i}") for i in range(2))
    assert chunk0.weight_bytes < chunk1.weight_bytes < chunk1.dense_bytes  # layer 1: fp16 attention, lut8 MLP
    assert chunk0.read_bytes == chunk0.weight_bytes  # grouped LUTs: read as stored
    head = next(p for p in plan.packages if p.model.startswith("lm_head"))
    assert head.weight_bytes < head.dense_bytes == head.read_bytes  # scaled per block: fp16 once loaded
    # inside a chunk, "layers.j" is its j-th layer
    assert plan.compression("layers.0.mlp.up_proj.weight", chunk1) == lut8
    assert plan.compression("layers.0.mlp.up_proj.weight", chunk0) == lut4


def test_device_paths_read_from_a_manifest():
    from llama_ane.quantize.auto import Recipe, device_paths

    plain = QuantizeOptions.from_cli("lut4", embeddings="int8", lm_head="none", lut_block_size=32).describe("iOS18")
    paths = device_paths(plain)
    assert paths["mlp"] == "lut4 group 16, scaled per block 32: at-load"
    assert paths["embeddings"] == "int8 per channel: just-in-time" and paths["lm_head"] == "fp16"
    assert device_paths({"mlp": {"scheme": "lut6", "group_size": 8}})["mlp"] == "lut6 group 8: just-in-time"
    mixed = QuantizeOptions.from_recipe(Recipe({"layers.0.mlp": Compression("lut4", group_size=16),
                                                "layers.1.mlp": Compression("lut6", group_size=8)})).describe("iOS18")
    assert device_paths(mixed)["mlp"] == "1 x lut4 group 16: just-in-time, 1 x lut6 group 8: just-in-time"


def test_forms_are_labelled_in_plain_words():
    from llama_ane.quantize.auto import CANDIDATES, _parse_label, label

    assert [label(c) for c in CANDIDATES] == ["lut4 group 16, scaled per channel, compensated",
                                              "lut6 group 8, compensated", "lut8 group 16"]
    assert label(Compression("lut4", group_size=0, block_size=32, scaled=True)) == "lut4 per tensor, scaled per block 32"
    assert label(Compression("int8", block_size=0, symmetric=True)) == "int8 per channel"
    assert label(Compression("int4", block_size=32)) == "int4 block 32" and label(None) == "fp16"
    for c in CANDIDATES:
        assert _parse_label(label(c)) == c
    assert _parse_label("lut4 group 16, scaled per per channel") == Compression(
        "lut4", group_size=16, scaled=True)  # as earlier exports wrote it


def sixty_units() -> dict:
    """A recipe of 29 layers (60 units): every unit lut6 but 5 MLPs at lut4."""
    from llama_ane.quantize.auto import CANDIDATES, units

    lut4, lut6 = CANDIDATES[:2]
    recipe = {u: lut4 if u in {f"layers.{n}.mlp" for n in range(5)} else lut6 for u in units(29)}
    return {**recipe, "embeddings": dataclasses.replace(lut6, compensated=False)}  # a table is never compensated


def test_a_recipe_is_labelled_exactly():
    from llama_ane.quantize.auto import CANDIDATES, Recipe, recipe_label, units, weights_label

    text = recipe_label(sixty_units())
    assert text.startswith("55 of 60 units lut6, 5 lut4 ("), text
    assert "attention lut6;" in text and "mlp 24 lut6, 5 lut4;" in text and "embeddings lut6;" in text
    assert "lut6: group 8, compensated (plain in embeddings);" in text
    assert "lut4: group 16, scaled per channel, compensated" in text
    assert text in (Path(__file__).parents[1] / "docs" / "quantization.md").read_text()  # the docs' example
    described = QuantizeOptions.from_recipe(Recipe(sixty_units(), budget_pct=5.0)).describe("iOS18")
    assert weights_label(described) == f"auto recipe: {text}"
    assert "attention lut4" not in weights_label(described)  # not each part's most lossy form
    same = recipe_label({u: CANDIDATES[1] for u in units(2)})
    assert same.startswith("all 6 units lut6 (embeddings lut6; attention lut6; mlp lut6; lm_head lut6"), same
    # two forms of one scheme are spelled out in full
    mixed = recipe_label({"layers.0.mlp": CANDIDATES[0], "layers.1.mlp": Compression("lut4", group_size=8)})
    assert mixed.startswith("1 of 2 units lut4 group 16, scaled per channel, compensated, 1 lut4 group 8 (mlp "), mixed


def test_fixed_schemes_are_labelled_per_part():
    from llama_ane.quantize.auto import weights_label

    assert weights_label(QuantizeOptions.from_cli("lut4").describe("iOS18")) == \
        "lut4 group 16, scaled per channel (every part)"
    assert weights_label(QuantizeOptions.from_cli("lut6").describe("iOS17")) == "lut6 per tensor (every part)"
    assert weights_label(QuantizeOptions.from_cli("lut4", embeddings="lut8", lm_head="none").describe("iOS18")) == \
        ("embeddings lut8 group 16; attention lut4 group 16, scaled per channel; mlp lut4 group 16, scaled per "
         "channel; lm_head fp16")
    assert weights_label(QuantizeOptions().describe("iOS18")) == "fp16"


def test_eval_labels_a_recipe_exactly():
    from llama_ane.evaluate import EvalReport
    from llama_ane.quantize.auto import Recipe, recipe_label

    described = QuantizeOptions.from_recipe(Recipe(sixty_units(), budget_pct=5.0)).describe("iOS18")
    report = EvalReport("out", "mil", "fp32", 100, 1, 99, 12.5, quantization=described)
    first = str(report).splitlines()[0]
    assert first.endswith(f"; weights: auto recipe: {recipe_label(sixty_units())}"), first
    assert "per per" not in str(report)


@pytest.fixture(scope="module")
def tiny_quality(tiny_checkpoint):
    from llama_ane.checkpoint.loader import load_checkpoint
    from llama_ane.export import quality

    ckpt = load_checkpoint(tiny_checkpoint(num_hidden_layers=2, head_dim=32))
    ids = quality.text_ids(ckpt, quality.calibration_text(), 48)
    return ckpt, quality.quality_model(ckpt), ids, quality.calibrate(ckpt, lambda _: None, grams=True)


def test_units_are_measured_on_text_the_calibration_did_not_read(tiny_quality):
    """Compensated codes fit the calibration's tokens: `auto` measures the units on the tokens after them."""
    from llama_ane.export import quality
    from llama_ane.quantize.auto import SENSITIVITY_TOKENS

    ckpt = tiny_quality[0]
    read = quality.calibration_tokens(ckpt.config)
    every = quality.text_ids(ckpt, quality.calibration_text(), 1 << 20)
    assert len(every) >= read + SENSITIVITY_TOKENS  # the shipped text is long enough
    assert quality.sensitivity_ids(ckpt) == every[read:read + SENSITIVITY_TOKENS]


def test_the_table_is_measured_on_the_groups_of_its_looked_up_rows_alone(tiny_quality):
    """Fitting only the groups of rows the tokens fall in gives those rows what fitting the whole table gives."""
    from llama_ane.quantize.auto import CANDIDATES
    from llama_ane.quantize.fit import roundtrip
    from llama_ane.quantize.sensitivity import looked_up_rows

    _, model, ids, importance = tiny_quality
    table = model.embed.to(torch.float16).numpy()
    ids = ids[:6]
    assert len({i // 8 for i in ids}) < table.shape[0] // 16  # a few of the table's groups
    for c in (None, *[dataclasses.replace(c, compensated=False) for c in CANDIDATES]):
        whole = table.astype(np.float32) if c is None else roundtrip(table, c, importance.get("embed_tokens.weight"))
        rows, size = looked_up_rows(model, ids, c, importance)
        assert size == stored_bytes(table.shape, c)
        want, original = torch.from_numpy(whole)[torch.tensor(ids)], torch.from_numpy(table[ids]).float()
        assert torch.equal(rows[0], want) and (c is None or not torch.equal(want, original))


def test_the_float32_model_is_transformers_model(tiny_quality):
    from llama_ane.reference import transformers_logits

    ckpt, model, ids, _ = tiny_quality
    want = torch.log_softmax(torch.from_numpy(transformers_logits(ids, ckpt)), -1)
    inputs, got = model.trace(ids)
    assert torch.allclose(got, want, atol=1e-4)
    assert torch.allclose(model.log_probs(ids, 1, inputs), want, atol=1e-4)  # from a layer's saved input


def test_unit_measurements_swap_weights_back_and_grow_with_fewer_bits(tiny_quality):
    from llama_ane.quantize.auto import CANDIDATES, units
    from llama_ane.quantize.sensitivity import measure_units, perplexity_change

    ckpt, model, ids, importance = tiny_quality
    before = {u: {n: t.clone() for n, t in model.weights(u).items()} for u in units(2)}
    found = measure_units(model, ids, CANDIDATES, importance)
    for u in units(2):
        assert all(torch.equal(t, before[u][n]) for n, t in model.weights(u).items()), u
    costs = found["costs"]
    assert set(costs) == set(units(2))
    for u, options in costs.items():
        assert options[None][1] == 0 and all(k >= 0 for _, k in options.values())
        forms = [c for c in options if c is not None]
        assert [c.scheme for c in forms] == [c.scheme for c in CANDIDATES]
        assert all(not c.compensated for c in forms) == (u == "embeddings")  # nothing to compensate a lookup with
        sizes = [options[c][0] for c in forms]
        assert sizes == sorted(sizes) and sizes[-1] < options[None][0]
        assert options[forms[0]][1] > options[forms[-1]][1], u  # 4 bits lose more than 8
    assert perplexity_change(model, {u: None for u in units(2)}, ids, importance) == pytest.approx(0, abs=1e-9)
    lut4 = perplexity_change(model, {u: CANDIDATES[0] for u in units(2)}, ids, importance)
    lut8 = perplexity_change(model, {u: CANDIDATES[-1] for u in units(2)}, ids, importance)
    assert abs(lut8) < abs(lut4)


def test_choose_recipe_measures_what_it_chose(tiny_quality):
    from llama_ane.quantize.sensitivity import choose_recipe

    ckpt, model, ids, importance = tiny_quality
    said = []
    wide = choose_recipe(model, ids, ids[::-1], importance, 1000.0, "test text", said.append)
    assert all(c is not None and c.bits == 4 for c in wide.forms.values())  # room for the fewest bytes
    tight = choose_recipe(model, ids, ids[::-1], importance, 0.01, "test text", said.append)
    assert sum(c is None for c in tight.forms.values()) > sum(c is None for c in wide.forms.values())
    for r in (wide, tight):
        assert r.measured_on == f"{len(ids)} tokens of test text" and r.budget_pct in (1000.0, 0.01)
        assert r.measured_pct is not None and r.estimated_pct is not None
    assert any("measured on" in s for s in said)


@pytest.mark.export
def test_quantize_auto_records_its_recipe_which_an_export_reuses(tiny_checkpoint, tmp_path):
    from llama_ane.contract.manifest import read_manifest

    ckpt = tiny_checkpoint(num_hidden_layers=2, head_dim=32)
    common = ["--context-length", "64", "--prefill-length", "16", "--branches", "0", "--quiet", "--no-verify"]
    r = run_export(ckpt, "-o", tmp_path / "auto", "--quantize", "auto", "--quantize-budget", "50", *common)
    assert r.exit_code == 0, r.output
    assert "auto:" in r.output and "measured on" in r.output
    assert "ETA" not in r.output and "auto: choice 1: " in r.output  # --quiet: no progress, the choice still said
    assert "weights: auto recipe: " in r.output and "per per" not in r.output, r.output
    m = read_manifest(tmp_path / "auto")
    recipe = m["quantization"]["recipe"]
    assert recipe["budget_pct"] == 50 and recipe["measured_pct"] is not None
    assert set(recipe["units"]) == {"embeddings", "lm_head", "layers.0.attention", "layers.0.mlp",
                                    "layers.1.attention", "layers.1.mlp"}
    r = run_export(ckpt, "-o", tmp_path / "again", "--quantize-recipe", tmp_path / "auto" / "manifest.json", *common)
    assert r.exit_code == 0, r.output
    again = read_manifest(tmp_path / "again")
    assert again["quantization"]["recipe"]["units"] == recipe["units"] and again["weights"] == m["weights"]
    r = CliRunner().invoke(__import__("llama_ane.cli", fromlist=["main"]).main, ["info", str(tmp_path / "auto")])
    assert r.exit_code == 0 and "quality   perplexity" in r.output and "just-in-time" in r.output, r.output
    from llama_ane.quantize.auto import recipe_forms, recipe_label

    exact = recipe_label(recipe_forms(m["quantization"]))
    assert re.match(r"(all 6 units|\d of 6 units) lut\d", exact), exact
    assert f"recipe    {exact}" in r.output and "per per" not in r.output, r.output


@pytest.mark.export
def test_quantize_auto_shows_each_phase_with_counts_and_an_eta(tiny_checkpoint, tmp_path):
    """Off a terminal, each phase says its steps done of its total and an ETA, a line at a time;
    each choice is said before it is checked."""
    ckpt = tiny_checkpoint(num_hidden_layers=2, head_dim=32)
    r = run_export(ckpt, "-o", tmp_path / "auto", "--quantize", "auto", "--quantize-budget", "50", "--no-verify",
                   "--context-length", "64", "--prefill-length", "16", "--branches", "0")
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    for phase, total, unit in (("calibrating", 2, "layers"), ("measuring", 6, "units"),
                               ("checking choice 1", 7, "steps")):
        shown = [ln for ln in lines if ln.startswith(f"auto: {phase}: ")]
        assert shown and all("ETA" in ln for ln in shown), (phase, r.output)
        assert shown[0].startswith(f"auto: {phase}: 1/{total} {unit}, "), shown
        assert shown[-1].startswith(f"auto: {phase}: {total}/{total} {unit}, "), shown
    order = [next(i for i, ln in enumerate(lines) if ln.startswith(p))
             for p in ("auto: calibrating", "auto: measuring", "auto: choice 1: ", "auto: checking choice 1")]
    assert order == sorted(order), r.output
    assert "units" in next(ln for ln in lines if ln.startswith("auto: choice 1: "))


def test_step_progress_lines_off_a_terminal_and_a_bar_on_one(monkeypatch):
    import io

    from llama_ane.export import progress

    said = []
    clock = iter(range(0, 1000, 2))  # each look at the clock 2 s later
    monkeypatch.setattr("time.perf_counter", lambda: next(clock))
    p = progress.StepProgress("phase", 10, enabled=True, say=said.append, unit="unit", stream=io.StringIO())
    for n in range(10):
        p.advance(f"unit {n}")
    p.close()
    assert said[0].startswith("phase: 1/10 units, 2 s, ETA 18 s (unit 0)"), said
    assert said[-1].startswith("phase: 10/10 units, ") and "ETA 0 s" in said[-1]
    assert 3 <= len(said) < 10  # a line every few seconds, not one a step

    class Terminal(io.StringIO):
        def isatty(self):
            return True
    said.clear()
    screen = Terminal()
    p = progress.StepProgress("phase", 3, enabled=True, say=said.append, stream=screen)
    for _ in range(3):
        p.advance()
    p.close()
    assert not said and "phase" in screen.getvalue()
    quiet = progress.StepProgress("phase", 3, enabled=False, say=said.append, stream=screen)
    quiet.advance()
    assert not said and quiet.bar is None
    assert progress.duration(185) == "3 min 05 s" and progress.duration(3720) == "1 h 02 min"


@pytest.fixture
def no_calibration(monkeypatch):
    """Fail the test if anything calibrates (the first work --quantize auto does)."""
    from llama_ane import api
    from llama_ane.export import quality

    def refused(*_args, **_kwargs):
        pytest.fail("the calibration ran before the refusal")
    monkeypatch.setattr(quality, "calibrate", refused)
    monkeypatch.setattr(api, "calibrate", refused)


@pytest.mark.parametrize("options, words", [
    (["--target", "coreai"], ["--target coreai", "drop --quantize auto"]),
    (["--target", "iOS16"], ["--quantize auto", "--target iOS18", "iOS16 has one LUT per tensor"]),
    (["--target", "iOS17"], ["--quantize auto", "--target iOS18", "iOS17 has one LUT per tensor"]),
    (["--target", "macOS13"], ["--quantize auto", "--target macOS15", "macOS13 has one LUT per tensor"]),
    (["--target", "macOS14"], ["--quantize auto", "--target macOS15", "macOS14 has one LUT per tensor"]),
    (["--precision", "fp32"], ["--quantize", "drop --precision fp32"]),
])
def test_quantize_auto_refuses_what_it_cannot_make_before_it_calibrates(tiny_checkpoint, tmp_path, no_calibration,
                                                                        options, words):
    out = tmp_path / "out"
    r = run_export(tiny_checkpoint(), "-o", out, "--context-length", "64", "--prefill-length", "32",
                   "--quantize", "auto", *options)
    assert r.exit_code != 0
    error = [ln for ln in r.output.splitlines() if ln.startswith("Error:")]
    assert len(error) == 1 and all(w in error[0] for w in words), r.output
    assert not out.exists()


@pytest.mark.parametrize("case", ["lfm2_tied_gqa", "lfm3_tied_gqa", "olmo_hybrid_tied_gqa", "phi3_plain",
                                  "granite_tied"])
def test_quantize_auto_refuses_a_family_it_cannot_measure_before_it_calibrates(tmp_path, no_calibration, case):
    from support.families import CASES, make_family_checkpoint

    ckpt = make_family_checkpoint(tmp_path / case, **CASES[case])
    r = run_export(ckpt, "-o", tmp_path / "out", "--context-length", "64", "--prefill-length", "32",
                   "--quantize", "auto")
    assert r.exit_code != 0
    error = [ln for ln in r.output.splitlines() if ln.startswith("Error:")]
    family = CASES[case]["model_type"]
    assert len(error) == 1 and "--quantize auto" in error[0] and family in error[0] and "--quantize lut6" in error[0], \
        r.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("options, words", [
    (["--quantize", "auto", "--quantize-mlp", "lut4"], ["--quantize auto gives every part", "--quantize-embeddings"]),
    (["--quantize", "lut4", "--quantize-budget", "3"], ["--quantize-budget", "--quantize auto"]),
    (["--quantize", "auto", "--quantize-budget", "0"], ["--quantize-budget", "positive"]),
    (["--quantize-recipe", "nowhere.json"], ["cannot read --quantize-recipe", "nowhere.json"]),
    (["--quantize", "lut6", "--quantize-recipe", "nowhere.json"], ["drop --quantize lut6"]),
])
def test_bad_auto_options_are_one_error_line(tiny_checkpoint, tmp_path, options, words):
    out = tmp_path / "out"
    r = run_export(tiny_checkpoint(), "-o", out, "--context-length", "64", "--prefill-length", "32", "--quiet",
                   *options)
    assert r.exit_code != 0
    error = [ln for ln in r.output.splitlines() if ln.startswith("Error:")]
    assert len(error) == 1 and all(w in error[0] for w in words), r.output
    assert not out.exists()


def test_a_lossy_scheme_is_measured_and_said_plainly(tiny_quality, monkeypatch):
    from llama_ane.export.quality import check_quality
    from llama_ane.quantize import auto

    ckpt = tiny_quality[0]
    said = []
    change = check_quality(ckpt, QuantizeOptions.from_cli("lut4"), "iOS18", said.append)
    assert any(f"perplexity {change:+.2f}% against fp16" in s for s in said), said
    assert not any(s.startswith("warning") for s in said) or change > auto.WARN_PCT
    monkeypatch.setattr(auto, "WARN_PCT", change - 1)  # a model this scheme costs more than the limit
    said.clear()
    check_quality(ckpt, QuantizeOptions.from_cli("lut4"), "iOS18", said.append)
    warning = [s for s in said if s.startswith("warning")]
    assert len(warning) == 1 and "--quantize auto" in warning[0] and "--lut-block-size 32" in warning[0]


def test_error_compensating_codes_lower_the_output_error():
    """GPTQ's column order with a fixed LUT per row: the codes index the same values, and the
    layer's output error on correlated inputs is smaller than with the nearest values."""
    from llama_ane.quantize.gptq import assign

    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 48)) @ rng.normal(size=(48, 48))  # correlated input channels
    w = rng.normal(size=(40, 48)).astype(np.float32)
    grid = np.sort(rng.normal(size=(40, 16)), axis=1)  # each row's LUT values
    nearest = np.abs(w[:, :, None] - grid[:, None, :]).argmin(axis=2)
    codes = assign(w, grid, torch.from_numpy(x.T @ x))
    assert codes.shape == w.shape and codes.max() < 16

    def output_error(c):
        q = np.take_along_axis(grid, c.astype(np.int64), axis=1)
        return float(((x @ (w - q).T) ** 2).sum())
    assert output_error(codes) < 0.8 * output_error(nearest)


@pytest.mark.parametrize("c", [Compression("lut4", group_size=4, scaled=True, compensated=True),
                               Compression("lut6", group_size=8, compensated=True)])
def test_compensated_lut_codes_lower_the_output_error_in_the_same_bytes(c):
    """A compensated LUT fit given the inputs' second moments: the same LUT and bytes, codes that
    lower the layer's output error; without second moments (a table) it is the plain fit."""
    import dataclasses

    from llama_ane.quantize.fit import fit, roundtrip

    rng = np.random.default_rng(1)
    x = rng.normal(size=(512, 64)) @ rng.normal(size=(64, 64))
    w = rng.normal(size=(32, 64)).astype(np.float16)
    gram = (x.T @ x / len(x)).astype(np.float32)
    plain = dataclasses.replace(c, compensated=False)

    def output_error(dense):
        return float(((x @ (dense - w.astype(np.float32)).T) ** 2).sum())
    mine, theirs = fit(w, c, gram), fit(w, plain, np.diag(gram).copy())
    assert np.array_equal(mine[1], theirs[1]) and mine[0].shape == w.shape  # the same LUT
    assert output_error(roundtrip(w, c, gram)) < 0.8 * output_error(roundtrip(w, plain, np.diag(gram).copy()))
    assert np.array_equal(roundtrip(w, c, None), roundtrip(w, plain, None))
    assert stored_bytes(w.shape, c) == stored_bytes(w.shape, plain)


def test_compensated_forms_round_trip_and_are_labelled():
    from llama_ane.quantize.auto import _parse_label, from_dict, label

    c = Compression("lut4", group_size=16, scaled=True, compensated=True)
    assert c.to_dict() == {"scheme": "lut4", "group_size": 16, "block_size": 0, "compensated": True}
    assert from_dict(c.to_dict(), "x") == c and label(c) == "lut4 group 16, scaled per channel, compensated"
    assert _parse_label(label(c)) == c and c.device_path == "just-in-time"
    with pytest.raises(QuantizeError, match="compensated"):
        from_dict({"scheme": "lut4", "group_size": 16, "block_size": 32, "compensated": True}, "x")
    with pytest.raises(QuantizeError, match="compensated is a field of LUT"):
        from_dict({"scheme": "int8", "compensated": True}, "x")


def test_units_are_measured_layer_locally_with_a_pass_per_layer(tiny_quality, monkeypatch):
    """One partial pass per layer (its gain) and one for the table, and the units' estimates are
    each layer's gain times its own output error: the probed unit's is its measured KL."""
    from llama_ane.quantize.auto import CANDIDATES, units
    from llama_ane.quantize.sensitivity import Float32Model, compressed_unit, kl, measure_units

    ckpt, model, ids, importance = tiny_quality
    calls = []
    real = Float32Model.log_probs
    monkeypatch.setattr(Float32Model, "log_probs", lambda self, *a, **k: calls.append(a[1:2]) or real(self, *a, **k))
    found = measure_units(model, ids, CANDIDATES, importance)
    assert found["passes"] == len(model.layers) + 1  # each layer's gain, and the table's
    assert len(calls) == found["passes"] + len(CANDIDATES)  # and the head's own, which runs only the head
    assert sum(start == (len(model.layers),) for start in calls) == len(CANDIDATES) + 1
    monkeypatch.setattr(Float32Model, "log_probs", real)
    inputs, reference = model.trace(ids)
    values, _ = compressed_unit(model, "layers.1.mlp", CANDIDATES[0], importance)
    with model.swapped({"layers.1.mlp": values}):
        measured = kl(reference, model.log_probs(ids, 1, inputs))
    assert found["costs"]["layers.1.mlp"][CANDIDATES[0]][1] == pytest.approx(measured, rel=1e-4)
    assert set(found["costs"]) == set(units(2))
