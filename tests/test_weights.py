"""Checkpoint loading (HF folder, checks of broken input) and the pure HF -> ANE weight mapping."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from llama_ane.checkpoint.loader import CheckpointError, copy_tokenizer, load_checkpoint
from llama_ane.checkpoint.mapping import chunk_state_dict, embeddings_state_dict, lm_head_state_dict


@pytest.fixture(scope="module")
def ckpt_dir(tiny_checkpoint):
    return tiny_checkpoint()


def hf_state(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def test_loads_a_hf_folder(ckpt_dir):
    ckpt = load_checkpoint(ckpt_dir)
    assert ckpt.source == {"kind": "hf", "path": str(ckpt_dir.resolve())}
    assert ckpt.config.num_hidden_layers == 3 and ckpt.config.vocab_size == 320
    state = hf_state(ckpt_dir)
    torch.testing.assert_close(ckpt.tensor("model.norm.weight"), state["model.norm.weight"])


def test_layer_mapping_is_a_reshape_with_the_attention_scale_in_q(ckpt_dir):
    ckpt = load_checkpoint(ckpt_dir)
    state = hf_state(ckpt_dir)
    ours = chunk_state_dict(ckpt, [1, 2])
    d = ckpt.config.head_dim
    for j, layer in enumerate([1, 2]):
        p = f"model.layers.{layer}."
        q = ours[f"layers.{j}.q_proj.weight"]
        assert q.shape == (*state[p + "self_attn.q_proj.weight"].shape, 1, 1)
        torch.testing.assert_close(q[:, :, 0, 0], state[p + "self_attn.q_proj.weight"] * d ** -0.5)
        for ours_name, hf_name in [("k_proj", "self_attn.k_proj"), ("v_proj", "self_attn.v_proj"),
                                   ("o_proj", "self_attn.o_proj"), ("mlp.gate_proj", "mlp.gate_proj"),
                                   ("mlp.up_proj", "mlp.up_proj"), ("mlp.down_proj", "mlp.down_proj")]:
            torch.testing.assert_close(ours[f"layers.{j}.{ours_name}.weight"][:, :, 0, 0], state[p + hf_name + ".weight"])
        torch.testing.assert_close(ours[f"layers.{j}.input_layernorm.weight"], state[p + "input_layernorm.weight"])
    assert len(ours) == 2 * 9


def test_untied_lm_head_uses_lm_head_weight_split_by_rows(ckpt_dir):
    ckpt = load_checkpoint(ckpt_dir)
    state = hf_state(ckpt_dir)
    out = lm_head_state_dict(ckpt, [200, 120])
    rows = torch.cat([out["heads.0.weight"], out["heads.1.weight"]])[:, :, 0, 0]
    torch.testing.assert_close(rows, state["lm_head.weight"])
    assert not torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])
    torch.testing.assert_close(embeddings_state_dict(ckpt)["embed_tokens.weight"], state["model.embed_tokens.weight"])


def test_tied_lm_head_uses_the_embedding_table(tiny_checkpoint):
    folder = tiny_checkpoint(tie_word_embeddings=True)
    assert "lm_head.weight" not in hf_state(folder)  # transformers saves the table once
    ckpt = load_checkpoint(folder)
    out = lm_head_state_dict(ckpt, [320])
    torch.testing.assert_close(out["heads.0.weight"][:, :, 0, 0], hf_state(folder)["model.embed_tokens.weight"])


def test_sharded_checkpoint_with_an_index(ckpt_dir, tmp_path):
    from safetensors.torch import save_file

    state = hf_state(ckpt_dir)
    folder = tmp_path / "sharded"
    shutil.copytree(ckpt_dir, folder)
    (folder / "model.safetensors").unlink()
    names = sorted(state)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in halves.items():
        save_file({k: state[k].contiguous() for k in keys}, str(folder / file))
    index = {"metadata": {}, "weight_map": {k: f for f, keys in halves.items() for k in keys}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    ckpt = load_checkpoint(folder)
    for k in names:
        torch.testing.assert_close(ckpt.tensor(k), state[k])
    # a shard listed in the index but absent is named
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors.*missing"):
        load_checkpoint(folder)


def test_missing_path(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nowhere")


def test_folder_without_config(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        load_checkpoint(tmp_path)


def test_a_file_that_is_not_gguf(tmp_path):
    f = tmp_path / "model.bin"
    f.write_bytes(b"\0" * 16)
    with pytest.raises(CheckpointError, match="not a .gguf"):
        load_checkpoint(f)


def test_folder_without_weights(ckpt_dir, tmp_path):
    folder = tmp_path / "noweights"
    folder.mkdir()
    shutil.copy(ckpt_dir / "config.json", folder)
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_checkpoint(folder)


def test_invalid_json_config(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize("keep", [0.5, 0.999])
def test_truncated_safetensors_is_caught_before_conversion(ckpt_dir, tmp_path, keep):
    folder = tmp_path / "cut"
    shutil.copytree(ckpt_dir, folder)
    f = folder / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load_checkpoint(folder)


def test_garbage_safetensors(ckpt_dir, tmp_path):
    folder = tmp_path / "garbage"
    shutil.copytree(ckpt_dir, folder)
    (folder / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match="not a readable safetensors"):
        load_checkpoint(folder)


def test_missing_tensor_is_named_when_the_checkpoint_is_opened(ckpt_dir, tmp_path):
    from safetensors.torch import save_file

    folder = tmp_path / "partial"
    shutil.copytree(ckpt_dir, folder)
    state = hf_state(ckpt_dir)
    del state["model.layers.2.mlp.up_proj.weight"]
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match="no tensor 'model.layers.2.mlp.up_proj.weight'"):
        load_checkpoint(folder)


def test_copy_tokenizer(ckpt_dir, tmp_path):
    ckpt = load_checkpoint(ckpt_dir)
    copied = copy_tokenizer(ckpt, tmp_path)
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(copied)
    assert all((tmp_path / name).is_file() for name in copied)


def test_copy_tokenizer_without_tokenizer_files(ckpt_dir, tmp_path):
    folder = tmp_path / "notok"
    shutil.copytree(ckpt_dir, folder)
    (folder / "tokenizer.json").unlink()
    ckpt = load_checkpoint(folder)
    dest = tmp_path / "dest"
    dest.mkdir()
    with pytest.raises(CheckpointError, match="no tokenizer.json"):
        copy_tokenizer(ckpt, dest)
