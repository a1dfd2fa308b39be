"""GGUF input checked against files llama.cpp's own converter wrote.

tests/fixtures/llamacpp_gguf/ holds, per case of its make.py, a tiny checkpoint written by
transformers' class of the family and the .gguf llama.cpp's convert_hf_to_gguf.py made of it
(--outtype f32; make.py's docstring says how to make them again). The lazy reader must give back the
checkpoint's config and every tensor exactly, and load_checkpoint a tokenizer that splits text as the
checkpoint's does; both Gemma 4 files, the LFM2 one, OLMo 3's (written as 'olmo2' with a sliding
window) and Falcon-H1's export and match transformers' logits. Falcon-H1's converter folds its muP
multipliers into the weights and writes none of them: its file gives back the checkpoint's config
with the multipliers 1, its tensors with the multipliers folded in as llama-ane folds them, and the
export is transformers' model.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from llama_ane.checkpoint.gguf_lazy import open_gguf  # noqa: E402
from llama_ane.checkpoint.loader import load_checkpoint  # noqa: E402
from llama_ane.config import LlamaConfig  # noqa: E402
from llama_ane.testing import _CORPUS  # noqa: E402

from support.gguf import check_gguf_export_matches_transformers, f32  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures" / "llamacpp_gguf"
_spec = importlib.util.spec_from_file_location("llamacpp_gguf_make", FIXTURES / "make.py")
make = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make)
CASES, REFUSED = make.CASES, make.REFUSED
FOLDED = ("falcon_h1_untied",)  # cases whose converter folds the config's multipliers into the weights
TEXT = _CORPUS + " Unseen wörds: ünïcode 🦙, two  spaces,\n\nnewlines and 12345."


def source(name: str) -> tuple[Path, Path, dict]:
    """The case's checkpoint folder, the .gguf llama.cpp wrote of it, and the checkpoint's config.json."""
    folder = FIXTURES / name
    return folder, folder / "model.gguf", json.loads((folder / "config.json").read_text())


def test_every_case_has_its_checkpoint_and_gguf():
    folders = {p.name for p in FIXTURES.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == set(CASES) | set(REFUSED)
    for name in folders:
        for file in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "model.gguf"):
            assert (FIXTURES / name / file).is_file(), f"{name}/{file}"


@pytest.mark.parametrize("name", [n for n in CASES if n not in FOLDED])
def test_config_and_every_tensor_equal_the_checkpoint(name):
    from safetensors.numpy import load_file

    folder, file, config = source(name)
    lazy = open_gguf(file)
    assert lazy.config_dict["model_type"] == config["model_type"]
    ours = LlamaConfig.from_hf_dict(lazy.config_dict)
    want = LlamaConfig.from_hf_dict(config)
    assert f32(ours.to_dict()) == f32(want.to_dict())  # GGUF holds the config's numbers as float32
    state = load_file(str(folder / "model.safetensors"))
    assert sorted(lazy.names()) == sorted(state)
    assert {i.dtype for i in lazy.tensor_info().values()} == {"F32"}  # --outtype f32: nothing rounded
    for hf, t in state.items():
        got = lazy.get(hf)
        assert got.dtype == torch.float32 and tuple(got.shape) == t.shape, hf
        if config["model_type"] == "gemma3_text" and hf.endswith("norm.weight"):
            # llama.cpp stores 1 + w in fp32; taking 1 back off is exact, the sum was not
            torch.testing.assert_close(got, torch.from_numpy(t), rtol=0, atol=2.0 ** -23)
            assert torch.equal(got + 1, torch.from_numpy(t + np.float32(1))), hf
        else:
            assert torch.equal(got, torch.from_numpy(t)), hf


def test_falcon_h1_reads_as_its_checkpoint_with_the_multipliers_folded():
    """The config without its multipliers (and the gated norm after the gate, as the checkpoint has it);
    each tensor the checkpoint's times the factors the export folds into it (families.falcon_h1.weight_scale,
    the embedding and LM-head multipliers), the rest exactly, A_log too (the file holds -exp(A_log))."""
    from safetensors.numpy import load_file

    from llama_ane.checkpoint.mapping import layer_tensors
    from llama_ane.families.falcon_h1 import MULTIPLIERS

    folder, file, config = source("falcon_h1_untied")
    lazy = open_gguf(file)
    hf = LlamaConfig.from_hf_dict(config)
    plain = {k: v for k, v in config.items() if k not in (*MULTIPLIERS, "embedding_multiplier", "lm_head_multiplier")}
    assert f32(LlamaConfig.from_hf_dict(lazy.config_dict).to_dict()) == f32(LlamaConfig.from_hf_dict(plain).to_dict())
    assert hf.mamba_gate == "after" and hf.mamba_multipliers != LlamaConfig.from_hf_dict(plain).mamba_multipliers
    state = load_file(str(folder / "model.safetensors"))
    assert sorted(lazy.names()) == sorted(state)
    assert {i.dtype for i in lazy.tensor_info().values()} == {"F32"}
    factors = {"model.embed_tokens.weight": config["embedding_multiplier"], "lm_head.weight": config["lm_head_multiplier"]}
    for layer in range(hf.num_hidden_layers):
        for ours, theirs in layer_tensors(hf, layer).items():
            scale = hf.family.weight_scale(hf, ours)
            if scale is not None:
                factors[f"model.layers.{layer}.{theirs}"] = np.reshape(scale, (-1, 1)) if isinstance(scale, list) else scale
    assert len(factors) == 2 + 8 * hf.num_hidden_layers  # q, k, v, o, in_proj, out_proj, gate, down
    for name, t in state.items():
        got = lazy.get(name)
        assert got.dtype == torch.float32 and tuple(got.shape) == t.shape, name
        if name in factors:
            assert not np.allclose(factors[name], 1.0), name
            want = torch.from_numpy((t * np.asarray(factors[name], np.float64)).astype(np.float32))
            torch.testing.assert_close(got, want, rtol=2e-7, atol=0, msg=name)  # fp32 products, one rounding apart
        else:
            assert torch.equal(got, torch.from_numpy(t)), name


@pytest.mark.parametrize("name", list(CASES))
def test_the_files_tokenizer_splits_text_as_the_checkpoints(name):
    """load_checkpoint rebuilds the tokenizer from the file's vocabulary (for SmolLM3, Granite and OLMo 2
    too, whose files transformers' GGUF config reader does not take)."""
    from transformers import AutoTokenizer

    folder, file, _ = source(name)
    ckpt = load_checkpoint(file)
    theirs, ours = AutoTokenizer.from_pretrained(str(folder)), AutoTokenizer.from_pretrained(str(ckpt.tokenizer_dir))
    ids = theirs(TEXT)["input_ids"]
    assert ours(TEXT)["input_ids"] == ids and len(ids) > 100
    assert ours.decode(ids) == theirs.decode(ids)


@pytest.mark.export
@pytest.mark.parametrize("name", ["gemma4_e2b_shape", "gemma4_k_eq_v", "lfm2_tied", "olmo3_sliding", "falcon_h1_untied"])
def test_a_llamacpp_gguf_exports_and_matches_transformers(tmp_path, name):
    folder, file, config = source(name)
    check_gguf_export_matches_transformers(file, folder, tmp_path / "out", config["model_type"])
