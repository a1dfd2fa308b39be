"""`inspect` on deliberately bad programs: each planted ANE rule violation must be found, and a
clean program must have none. CLI exit codes with and without --strict."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

ct = pytest.importorskip("coremltools")
from coremltools.converters.mil import Builder as mb  # noqa: E402
from coremltools.converters.mil.mil import types  # noqa: E402

from llama_ane.commands.inspect import command as inspect_command  # noqa: E402
from llama_ane.export import ane_rules  # noqa: E402
from llama_ane.export.inspect import inspect_path  # noqa: E402
from conftest import convert_to  # noqa: E402

FP16 = types.fp16
IOS18 = ct.target.iOS18


def save(prog, path, *, fp16=True):
    return convert_to(prog, path, compute_precision=ct.precision.FLOAT16 if fp16 else ct.precision.FLOAT32)


def clean_chunk(path):
    w = np.random.default_rng(0).standard_normal((64, 64, 1, 1)).astype(np.float16)

    @mb.program(input_specs=[mb.TensorSpec((1, 64, 1, 8), dtype=FP16), mb.TensorSpec((2, 64, 1, 128), dtype=FP16)],
                opset_version=IOS18)
    def prog(hidden_states, k_cache):
        y = mb.conv(x=hidden_states, weight=w)
        s = mb.slice_by_index(x=k_cache, begin=[0, 0, 0, 0], end=[1, 64, 1, 128])
        return mb.relu(x=y, name="hidden_states_out"), mb.reduce_mean(x=s, axes=[3], keep_dims=True, name="pooled")

    return save(prog, path)


def rules(report):
    return sorted({v.rule for v in report.violations})


def test_clean_program_has_no_violations(tmp_path):
    report = inspect_path(clean_chunk(tmp_path / "chunk_0.mlpackage"))
    assert report.violations == []
    fn = report.packages[0].functions[0]
    assert fn.role == "chunk"
    assert fn.op_histogram["conv"] == 1 and fn.op_histogram["relu"] == 1
    assert fn.weight_bytes == 64 * 64 * 2
    assert fn.largest_dim == 128
    assert [d.name for d in fn.inputs] == ["hidden_states", "k_cache"]


def test_gather_inside_a_chunk_is_found_but_allowed_in_embeddings(tmp_path):
    table = np.random.default_rng(0).standard_normal((100, 64)).astype(np.float16)

    @mb.program(input_specs=[mb.TensorSpec((1, 8), dtype=types.int32)], opset_version=IOS18)
    def prog(input_ids):
        return mb.gather(x=table, indices=input_ids, axis=0, name="rows")

    chunk = inspect_path(save(prog, tmp_path / "chunk_3.mlpackage"))
    assert rules(chunk) == ["fallback-op"]
    assert "gather" in str(chunk.violations[0]) and "block chunk" in str(chunk.violations[0])
    assert inspect_path(save(prog, tmp_path / "embeddings.mlpackage")).violations == []


def test_20000_wide_output_is_found(tmp_path):
    @mb.program(input_specs=[mb.TensorSpec((1, 20000), dtype=FP16)], opset_version=IOS18)
    def wide(x):
        return mb.relu(x=x, name="logits")

    report = inspect_path(save(wide, tmp_path / "wide.mlpackage"))
    assert rules(report) == ["max-dim"]
    assert report.packages[0].functions[0].largest_dim == 20000
    assert "20000" in str(report.violations[0])


def test_fp32_output_is_found(tmp_path):
    @mb.program(input_specs=[mb.TensorSpec((1, 64, 1, 4), dtype=FP16)], opset_version=IOS18)
    def prog(x):
        return mb.cast(x=mb.relu(x=x), dtype="fp32", name="logits")

    report = inspect_path(save(prog, tmp_path / "lm_head.mlpackage"))
    assert rules(report) == ["fp32-io"]
    assert "output 'logits' is float32" in str(report.violations[0])


def test_cond_dynamic_slice_band_part_and_cache_dims_are_found(tmp_path):
    @mb.program(input_specs=[mb.TensorSpec((2, 48, 1, 64), dtype=FP16), mb.TensorSpec((4,), dtype=types.int32)],
                opset_version=IOS18)
    def prog(k_cache, begin):
        window = mb.slice_by_size(x=k_cache, begin=begin, size=[1, 48, 1, 8])
        banded = mb.band_part(x=mb.reshape(x=window, shape=[48, 8]), lower=0, upper=-1)
        flag = mb.greater(x=mb.reduce_sum(x=begin), y=0)
        chosen = mb.cond(pred=flag, _true_fn=lambda: mb.add(x=banded, y=np.float16(1)),
                         _false_fn=lambda: mb.mul(x=banded, y=np.float16(2)))
        return mb.identity(x=chosen, name="out")

    report = inspect_path(save(prog, tmp_path / "cache_update.mlpackage"))
    text = "\n".join(str(v) for v in report.violations)
    assert rules(report) == ["cache-multiple", "fallback-op"]
    assert "'cond'" in text and "'band_part'" in text and "runtime offsets (begin)" in text
    assert "axis 1 = 48" in text


def test_file_size_limits_depend_on_the_target(tmp_path, monkeypatch):
    assert [v.rule for v in ane_rules.check_file_size("x", 1_500_000_000, "iOS18")] == ["file-size"]
    assert ane_rules.check_file_size("x", 1_500_000_000, "macOS15") == []
    assert [v.rule for v in ane_rules.check_file_size("x", 2_500_000_000, "macOS15")] == ["file-size"]
    # end to end on a real package, with the limits lowered around its size
    path = clean_chunk(tmp_path / "chunk_0.mlpackage")
    size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    assert inspect_path(path, target="iOS18").violations == []
    monkeypatch.setitem(ane_rules.FILE_LIMIT_BYTES, "iOS", size - 1)
    monkeypatch.setitem(ane_rules.FILE_LIMIT_BYTES, "macOS", size)
    assert rules(inspect_path(path, target="iOS18")) == ["file-size"]
    assert inspect_path(path, target="macOS15").violations == []


def test_cli_json_and_strict_exit_codes(tmp_path):
    @mb.program(input_specs=[mb.TensorSpec((1, 64, 1, 4), dtype=FP16)], opset_version=IOS18)
    def prog(x):
        return mb.cast(x=x, dtype="fp32", name="out")

    bad = save(prog, tmp_path / "bad.mlpackage")
    good = clean_chunk(tmp_path / "chunk_0.mlpackage")
    runner = CliRunner()
    result = runner.invoke(inspect_command, [str(bad), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["violations"][0]["rule"] == "fp32-io"
    assert data["packages"][0]["functions"][0]["op_histogram"] == {"cast": 1}
    assert runner.invoke(inspect_command, [str(bad), "--strict"]).exit_code != 0
    strict_good = runner.invoke(inspect_command, [str(good), "--strict"])
    assert strict_good.exit_code == 0 and "no ANE rule violations" in strict_good.output
    missing = runner.invoke(inspect_command, [str(tmp_path / "nothing")])
    assert missing.exit_code != 0 and "neither an export folder" in missing.output


def test_tiny_export_has_no_violations(tiny_export):
    report = inspect_path(tiny_export)
    assert report.target_source == "manifest"
    assert report.violations == [], "\n".join(map(str, report.violations))
    roles = {fn.model: fn.role for pkg in report.packages for fn in pkg.functions}
    assert roles["embeddings"] == "embeddings" and roles["chunk_0"] == "chunk"
    assert all(fn.weight_bytes > 0 for pkg in report.packages if pkg.file.startswith("chunk")
               for fn in pkg.functions)


@pytest.mark.slow
def test_default_export_has_no_violations(smollm2_export):
    report = inspect_path(smollm2_export)
    print(report.format_text())
    assert report.violations == [], "\n".join(map(str, report.violations))
    # the LM head is its own model or folded into the last chunk (--fold-lm-head auto); either way
    # the vocabulary is split, so no function but the embeddings' gather has a dimension over 16384
    roles = {fn.role for pkg in report.packages for fn in pkg.functions}
    manifest = json.loads((smollm2_export / "manifest.json").read_text())
    assert ("lm_head" in roles) != ("folded_into" in manifest["lm_head"])
    assert max(manifest["lm_head"]["vocab_splits"]) <= 16384
    others = [fn for pkg in report.packages for fn in pkg.functions if fn.role != "embeddings"]
    assert others and all(fn.largest_dim <= 16384 for fn in others), [(fn.model, fn.largest_dim) for fn in others]
