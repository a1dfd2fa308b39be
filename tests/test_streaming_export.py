"""The streaming exporter: one package's weights at a time, foreseen memory, nothing left behind."""

from __future__ import annotations

import json
import os
import signal
import tempfile
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from llama_ane.cli import main
from llama_ane.export import convert
from llama_ane.api import export_model
from llama_ane.export.budget import GIB, MemoryBudgetError, plan_memory
from llama_ane.contract.plan import ExportOptions, plan_export
from llama_ane.export.package_weights import model_hf_names
from llama_ane.checkpoint.loader import load_checkpoint

pytestmark = pytest.mark.export  # exports or runs models end to end: outside the quick unit tier

TINY = dict(num_hidden_layers=5, head_dim=32)
OPTIONS = dict(context_length=256, prefill_length=64, layers_per_chunk=2)


def test_each_package_reads_only_its_own_tensors(tiny_checkpoint, tmp_path):
    ckpt = load_checkpoint(tiny_checkpoint(**TINY))
    plan = plan_export(ckpt.config, ExportOptions(**OPTIONS))
    real_get = ckpt.get
    for spec in plan.packages:
        read: list[str] = []
        ckpt.get = lambda name, read=read: read.append(name) or real_get(name)
        convert.build_package(spec, plan, ckpt, tmp_path)
        allowed = model_hf_names(ckpt.config, spec.model, list(spec.layers), spec.rows)
        assert set(read) <= allowed, f"{spec.file} read {sorted(set(read) - allowed)}"
        if spec.layers:  # a chunk reads every tensor of its own layers, each once (and the last, the head's)
            own = model_hf_names(ckpt.config, spec.model, list(spec.layers))
            assert sorted(n for n in read if n in own) == sorted(own)
        if spec.model == "cache_update":
            assert read == []


def test_functions_of_a_package_share_one_copy_of_the_weights(tiny_export):
    manifest = json.loads((tiny_export / "manifest.json").read_text())
    blob = tiny_export / "chunk_0.mlpackage" / "Data" / "com.apple.CoreML" / "weights" / "weight.bin"
    functions = manifest["models"]["chunk_0"]["functions"]
    assert set(functions) == {"prefill", "decode", "decode_branches", "verify"}
    assert {f["file"] for f in functions.values()} == {"chunk_0.mlpackage"}
    ckpt = load_checkpoint(manifest["source"]["path"])
    plan = plan_export(ckpt.config, ExportOptions(**OPTIONS))
    weights = next(p.weight_bytes for p in plan.packages if p.model == "chunk_0")
    assert weights <= blob.stat().st_size <= 1.1 * weights  # once, not once per function


def test_too_small_max_memory_is_refused_before_any_conversion(tiny_checkpoint, tmp_path, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("conversion started")
    monkeypatch.setattr(convert, "convert_all", never)
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["export", str(tiny_checkpoint(**TINY)), "-o", str(out), "--max-memory", "0.5",
                                       "--context-length", "256", "--layers-per-chunk", "2", "--quiet"])
    assert result.exit_code == 1
    assert "the --max-memory is 0.5 GiB; nothing was converted" in result.output
    assert "What would fit" in result.output and "Traceback" not in result.output
    assert list(tmp_path.iterdir()) == []


def test_memory_plan_chooses_fewer_workers_when_memory_is_short(tiny_checkpoint):
    ckpt = load_checkpoint(tiny_checkpoint(**TINY))
    plan = plan_export(ckpt.config, ExportOptions(**OPTIONS))
    roomy = plan_memory(plan, available=64 * GIB, cores=8)
    # one per package: 3 chunks (the last carrying the LM head) and the embeddings (states, and the cascade
    # through the prefill window: no cache update)
    assert roomy.workers == 4
    one = plan_memory(plan, available=None, max_memory=roomy.build_peak - 1, cores=8, verify=False)
    assert 1 <= one.workers < 4 and one.build_peak < roomy.build_peak
    with pytest.raises(MemoryBudgetError, match="--max-memory is"):
        plan_memory(plan, available=None, max_memory=GIB // 2, cores=8)


def test_a_worker_killed_by_the_system_is_a_clear_error(tiny_checkpoint, tmp_path, monkeypatch):
    def killed(spec, *args):
        if spec.model == "chunk_0":
            os.kill(os.getpid(), signal.SIGKILL)  # what the out-of-memory killer does
        return real(spec, *args)
    real = convert.build_package
    monkeypatch.setattr(convert, "build_package", killed)
    with pytest.raises(convert.ConversionError, match=r"building chunk_0\.mlpackage .* killed by signal 9"):
        export_model(tiny_checkpoint(**TINY), tmp_path / "out", progress=False, verify=False, **OPTIONS)
    assert list(tmp_path.iterdir()) == []


def test_two_exports_are_identical_and_leave_no_temporary_files(tiny_checkpoint, tmp_path, monkeypatch):
    """Between the two, this process builds a program of unnamed ops, which advances coremltools'
    per-process op-name counter that forked workers inherit: the second export's bytes stay the same."""
    from coremltools.converters.mil import Builder as mb

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    hashes = []
    for name in ("a", "b"):
        out = export_model(tiny_checkpoint(**TINY), tmp_path / name, progress=False, verify=False, **OPTIONS)
        manifest = json.loads((out / "manifest.json").read_text())
        hashes.append(manifest["files"])

        @mb.program(input_specs=[mb.TensorSpec(shape=(1, 4))])
        def _(x):
            return mb.add(x=mb.mul(x=x, y=2.0), y=mb.linear(x=x, weight=np.ones((4, 4), np.float32)))
    assert hashes[0] == hashes[1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "tmp"]
    assert list(scratch.iterdir()) == []  # coremltools' temporary packages and weight folders included
    assert not [p for p in Path(tmp_path / "a").rglob(".scratch")]
