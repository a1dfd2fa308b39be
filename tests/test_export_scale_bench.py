"""The pure parts of benchmarks/export_scale.py: checkpoint shapes, sharding and parameter counts (no export)."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from conftest import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("export_scale")


def expected_tensors(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes transformers' LlamaForCausalLM loads for `cfg` (built on the meta device)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**copy.deepcopy(cfg)))  # it edits rope_scaling in place
    state = model.state_dict()
    if cfg["tie_word_embeddings"]:
        state.pop("lm_head.weight")  # tied: loaded from the embedding, not stored in the checkpoint
    return {k: tuple(v.shape) for k, v in state.items()}


def test_tiny_checkpoint_matches_transformers_and_is_sharded(bench, tmp_path):
    from safetensors import safe_open

    from llama_ane.checkpoint.loader import check_safetensors

    cfg = bench.preset_config("tiny")
    shapes = dict(bench.tensor_shapes(cfg))
    limit = 2 * max(torch.Size(s).numel() for s in shapes.values()) + 200_000  # the embedding and a bit more
    folder = tmp_path / "tiny"
    assert bench.write_checkpoint(cfg, folder, shard_limit=limit, tokenizer=False)

    index = json.loads((folder / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 2
    assert files == sorted(p.name for p in folder.glob("*.safetensors"))
    assert all(f.endswith(f"-of-{len(files):05d}.safetensors") for f in files)
    expected = expected_tensors(cfg)
    assert set(index["weight_map"]) == set(expected)

    total = 0
    for name in files:
        file = folder / name
        assert file.stat().st_size <= limit
        with safe_open(str(file), framework="pt") as f:
            assert set(check_safetensors(file)) == set(f.keys())
            for key in f.keys():
                assert index["weight_map"][key] == name
                t = f.get_tensor(key)
                assert t.dtype == torch.bfloat16 and tuple(t.shape) == expected[key], key
                total += t.numel() * 2
                if key.endswith("norm.weight"):
                    assert torch.all(t == 1)
    assert total == index["metadata"]["total_size"] == 2 * bench.param_count(cfg)
    assert json.loads((folder / "config.json").read_text()) == cfg

    # a complete checkpoint is kept as it is; a different seed rewrites it
    assert not bench.write_checkpoint(cfg, folder, shard_limit=limit, tokenizer=False)
    assert bench.write_checkpoint(cfg, folder, seed=1, shard_limit=limit, tokenizer=False)


@pytest.mark.parametrize("preset, approx", [("1b", 1.236e9), ("3b", 3.213e9), ("8b", 8.030e9)])
def test_param_count_formula(bench, preset, approx):
    cfg = bench.preset_config(preset)
    from_shapes = sum(torch.Size(s).numel() for _, s in bench.tensor_shapes(cfg))
    assert bench.param_count(cfg) == from_shapes
    assert from_shapes == pytest.approx(approx, rel=1e-3)


def test_1b_names_match_transformers(bench):
    cfg = bench.preset_config("1b")
    assert dict(bench.tensor_shapes(cfg)) == expected_tensors(cfg)


def test_unknown_preset(bench):
    with pytest.raises(bench.BenchError, match="unknown preset"):
        bench.preset_config("70b")
    assert bench.preset_config("smollm2") is None


def test_not_enough_disk(bench, tmp_path, monkeypatch):
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(bench.shutil, "disk_usage", lambda _: usage(1 << 40, 1 << 40, 1 << 30))
    with pytest.raises(bench.BenchError, match=r"needs 2\.3 GiB .* 1\.0 GiB free"):
        bench.write_checkpoint(bench.preset_config("1b"), tmp_path / "1b", tokenizer=False)
    assert not (tmp_path / "1b").exists()
