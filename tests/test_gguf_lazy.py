"""The lazy GGUF reader: a tiny GGUF written here read back exactly, one dequantization per `get`,
clear errors, llama3/linear RoPE scaling from the file, and (slow) the embedded SmolLM2 against transformers."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from llama_ane.config import LlamaConfig, inv_freq  # noqa: E402
from llama_ane.checkpoint.gguf_lazy import GGUFError, open_gguf  # noqa: E402

from support.gguf import (CTX, EPS, HEAD_DIM, HEADS, HIDDEN, INTER, KV_HEADS, LAYERS, VOCAB,  # noqa: E402
                          write_tiny)

CONFIG_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
               "max_position_embeddings", "tie_word_embeddings", "bos_token_id", "eos_token_id")


def llamacpp_rope_freqs(theta: float, factor: float, low: float, high: float, ctx: int) -> np.ndarray:
    """The rope_freqs.weight llama.cpp's convert script writes for a llama3 `rope_scaling`."""
    out = []
    for i in range(0, HEAD_DIM, 2):
        wavelen = 2 * math.pi * theta ** (i / HEAD_DIM)
        if wavelen < ctx / high:
            out.append(1.0)
        elif wavelen > ctx / low:
            out.append(factor)
        else:
            smooth = (ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


@pytest.mark.parametrize("untied", [False, True], ids=["tied", "untied"])
def test_tiny_gguf_reads_back_config_and_every_tensor(tmp_path, untied):
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = tmp_path / "tiny.gguf"
    hf = write_tiny(path, untied=untied)
    lazy = open_gguf(path)
    assert lazy.config_dict == {
        "model_type": "llama", "vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": INTER,
        "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM, "rms_norm_eps": EPS, "rope_theta": 10000.0, "max_position_embeddings": CTX,
        "tie_word_embeddings": not untied, "bos_token_id": 1, "eos_token_id": 2}
    theirs = load_gguf_checkpoint(str(path), return_tensors=False)["config"]
    assert {k: lazy.config_dict.get(k) for k in CONFIG_KEYS} == {k: theirs.get(k) for k in CONFIG_KEYS}
    LlamaConfig.from_hf_dict(lazy.config_dict)  # one the exporter accepts

    assert sorted(lazy.names()) == sorted(hf)
    for name, want in hf.items():
        got = lazy.get(name)
        assert got.dtype == torch.float32 and tuple(got.shape) == want.shape, name
        # F32 tensors exactly; F16 ones exactly their fp16 rounding, widened losslessly to float32
        assert torch.equal(got, torch.from_numpy(want)), name


def test_tensor_table_gives_hf_shapes_and_types_without_reading_data(tmp_path, monkeypatch):
    from llama_ane.checkpoint.gguf_lazy import GGUF_FLOATS
    from llama_ane.checkpoint.mapping import check_tensors

    path = tmp_path / "tiny.gguf"
    hf = write_tiny(path, untied=True)
    lazy = open_gguf(path)
    monkeypatch.setattr(gguf, "dequantize", lambda *a: pytest.fail("a tensor was read"))
    info = lazy.tensor_info()
    assert {name: i.shape for name, i in info.items()} == {name: w.shape for name, w in hf.items()}
    assert info["model.layers.0.self_attn.q_proj.weight"].dtype == "F32"
    assert info["model.layers.1.self_attn.q_proj.weight"].dtype == "F16"
    assert not lazy.has_tokenizer  # write_tiny stores no tokenizer.ggml.* metadata
    check_tensors(LlamaConfig.from_hf_dict(lazy.config_dict), info, "tiny", GGUF_FLOATS, "floats")


def test_integer_tensors_are_refused_by_name(tmp_path):
    from llama_ane.checkpoint.gguf_lazy import GGUF_FLOATS
    from llama_ane.checkpoint.loader import CheckpointError
    from llama_ane.checkpoint.mapping import check_tensors

    path = tmp_path / "int8.gguf"
    write_tiny(path, int8="blk.1.ffn_up.weight")
    lazy = open_gguf(path)
    assert "I8" not in GGUF_FLOATS and {"Q4_1", "Q8_0", "BF16"} <= set(GGUF_FLOATS)
    with pytest.raises(CheckpointError, match="'model.layers.1.mlp.up_proj.weight' is stored as I8"):
        check_tensors(LlamaConfig.from_hf_dict(lazy.config_dict), lazy.tensor_info(), "int8", GGUF_FLOATS, "floats")


def test_get_dequantizes_only_the_requested_tensor(tmp_path, monkeypatch):
    path = tmp_path / "tiny.gguf"
    hf = write_tiny(path)
    calls: list[tuple[tuple[int, ...], str]] = []
    real = gguf.dequantize

    def counting(data, qtype):
        calls.append((tuple(data.shape), qtype.name))
        return real(data, qtype)

    monkeypatch.setattr(gguf, "dequantize", counting)
    lazy = open_gguf(path)
    assert calls == []  # opening reads metadata only
    for name, want in hf.items():
        calls.clear()
        lazy.get(name)
        # one call, on data of exactly this tensor's size (a whole-file read would pass more)
        assert len(calls) == 1 and math.prod(calls[0][0]) == want.size, (name, calls)


def test_get_returns_a_tensor_the_caller_owns(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny(path)
    lazy = open_gguf(path)
    norm = lazy.get("model.norm.weight")  # F32: gguf hands back a view of the read-only map
    norm.zero_()
    assert lazy.get("model.norm.weight").abs().sum() > 0


def test_unknown_names_raise_key_error(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny(path)
    lazy = open_gguf(path)
    assert "lm_head.weight" not in lazy.names()
    for name in ("lm_head.weight", "model.layers.2.self_attn.q_proj.weight", "blk.0.attn_q.weight"):
        with pytest.raises(KeyError):
            lazy.get(name)


def llama3(factor: float, low: float, high: float, ctx: int) -> dict:
    return {"factor": factor, "low_freq_factor": low, "high_freq_factor": high, "original_max_position_embeddings": ctx}


# with head_dim 8: Llama 3.1's values leave one frequency in the smooth band (found among the known
# settings), theta 100 leaves two (fitted); low_freq_factor 2 is the same RoPE as 1 with half the context
@pytest.mark.parametrize("theta,rope", [
    (500000.0, llama3(8.0, 1.0, 4.0, 8192)), (100.0, llama3(8.0, 1.0, 4.0, 64)), (100.0, llama3(4.0, 2.0, 8.0, 128)),
], ids=["llama3.1", "fitted", "equivalent"])
def test_llama3_rope_freqs_become_rope_scaling(tmp_path, theta, rope):
    path = tmp_path / "llama3.gguf"
    freqs = llamacpp_rope_freqs(theta, rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"],
                                rope["original_max_position_embeddings"])
    write_tiny(path, theta=theta, rope_freqs=freqs)
    lazy = open_gguf(path)
    assert "rope_freqs.weight" not in lazy.names()
    ours = lazy.config_dict["rope_scaling"]
    if rope["low_freq_factor"] == 1.0:
        assert ours == {"rope_type": "llama3", **rope}
    # the frequencies RoPE uses are what the file says, whatever the parametrisation
    want = LlamaConfig.from_hf_dict({**lazy.config_dict, "rope_scaling": {"rope_type": "llama3", **rope}})
    np.testing.assert_allclose(inv_freq(LlamaConfig.from_hf_dict(lazy.config_dict)), inv_freq(want), rtol=1e-6)


def test_linear_rope_scaling(tmp_path):
    path = tmp_path / "linear.gguf"
    write_tiny(path, scaling=("linear", 4.0))
    assert open_gguf(path).config_dict["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}


def test_unreadable_or_unsupported_files_say_what_is_supported(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(GGUFError, match="not a readable GGUF.*supported: general.architecture 'llama'"):
        open_gguf(junk)
    with pytest.raises(GGUFError, match="does not exist"):
        open_gguf(tmp_path / "missing.gguf")
    moe = tmp_path / "lfm2moe.gguf"
    write_tiny(moe, arch="lfm2moe")
    with pytest.raises(GGUFError, match="holds a 'lfm2moe' model, which llama-ane does not export; supported: "
                                        "general.architecture 'llama'.*'gemma3'.*'qwen3'"):
        open_gguf(moe)
    yarn = tmp_path / "yarn.gguf"
    write_tiny(yarn, scaling=("yarn", 4.0))
    with pytest.raises(GGUFError, match="RoPE scaling 'yarn'; supported"):
        open_gguf(yarn)
    odd = tmp_path / "odd.gguf"
    write_tiny(odd, rope_freqs=np.array([1.0, 3.0, 1.0, 8.0], dtype=np.float32))
    with pytest.raises(GGUFError, match="match no llama3 RoPE scaling"):
        open_gguf(odd)


@pytest.mark.slow
def test_smollm2_matches_transformers_full_load():
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from llama_ane.checkpoint.loader import default_gguf_path

    path = default_gguf_path()
    lazy = open_gguf(path)
    theirs = load_gguf_checkpoint(str(path), return_tensors=False)["config"]
    assert {k: lazy.config_dict.get(k) for k in CONFIG_KEYS} == {k: theirs.get(k) for k in CONFIG_KEYS}
    assert "rope_scaling" not in lazy.config_dict and lazy.config_dict["tie_word_embeddings"] is True

    state = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch.float32).state_dict()
    # a tied model's state dict repeats the embedding as lm_head.weight; the file holds it once
    assert set(lazy.names()) == set(state) - {"lm_head.weight"}
    for name in lazy.names():
        got = lazy.get(name)
        assert got.shape == state[name].shape and torch.equal(got, state[name]), name
