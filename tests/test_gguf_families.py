"""GGUF input for every family the exporter builds that llama.cpp has an architecture for.

Each tiny checkpoint is written by transformers' own class of its family, then converted to a GGUF
here the way llama.cpp's convert_hf_to_gguf.py stores that architecture (its metadata keys, its
tensor names, q/k rows interleaved for the architectures it runs with interleaved RoPE, Gemma's
norms as 1 + w, Phi-3's longrope factors as tensors, LFM2's per-layer kv head counts and squeezed
conv kernels). The lazy reader must give back the
checkpoint's config and every tensor; where transformers reads the architecture too, the same
config and tensors as `AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`. One Qwen3 and one
LFM2 GGUF are exported and their torch backend compared with transformers on the original checkpoint.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from llama_ane.checkpoint.gguf_lazy import GGUFError, open_gguf  # noqa: E402
from llama_ane.checkpoint.loader import load_checkpoint  # noqa: E402
from llama_ane.config import LlamaConfig  # noqa: E402
from llama_ane.errors import LlamaANEError  # noqa: E402
from llama_ane.testing import make_tiny_checkpoint  # noqa: E402

from support.families import GEMMA4, longrope  # noqa: E402
from support.gguf import (check_gguf_export_matches_transformers, f32, llamacpp_permute, scale_layers,  # noqa: E402
                          write_bare)


GEMMA = {"model_type": "gemma3_text", "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6}
LFM2 = {"model_type": "lfm2", "intermediate_size": 96, "block_multiple_of": 16, "block_ffn_dim_multiplier": 1.5,
        "rope_theta": 1_000_000.0}
# name -> checkpoint overrides (TINY_CONFIG: hidden 64, 3 layers, 4 query heads, 2 kv heads). Each is
# a config llama.cpp's file can say: what its metadata has no key for takes llama.cpp's value
# (SmolLM3's NoPE every fourth layer, Gemma 3's attention scale of head_dim, Granite's head size
# of hidden / heads). The `TRANSFORMERS` cases are also within what transformers' GGUF reader reads
# (Qwen3's and Gemma 3's default head sizes, no RoPE scaling, full rotary, no attention bias).
CASES = {
    "llama_untied_bias": {"model_type": "llama", "attention_bias": True},
    "llama_tied_mha": {"model_type": "llama", "num_key_value_heads": 4, "tie_word_embeddings": True},
    "qwen2_tied": {"model_type": "qwen2", "tie_word_embeddings": True},
    "qwen3_untied_head32": {"model_type": "qwen3", "head_dim": 32, "rope_scaling": {"rope_type": "linear",
                                                                                  "factor": 2.0}},
    "qwen3_tied_mha": {"model_type": "qwen3", "num_key_value_heads": 4, "tie_word_embeddings": True, "head_dim": 128},
    "smollm3_untied_bias": {"model_type": "smollm3", "num_hidden_layers": 4, "no_rope_layer_interval": 4,
                            "attention_bias": True},
    "granite_tied": {"model_type": "granite", "tie_word_embeddings": True, "embedding_multiplier": 12.0,
                     "residual_multiplier": 0.22, "attention_multiplier": 0.05, "logits_scaling": 8.0},
    "olmo2_untied_mha": {"model_type": "olmo2", "num_key_value_heads": 4},
    "phi3_partial_longrope_window": {"model_type": "phi3", "partial_rotary_factor": 0.75, "sliding_window": 48,
                                     "max_position_embeddings": 4096, "original_max_position_embeddings": 64,
                                     "rope_scaling": longrope(6)},
    "phi3_plain_tied": {"model_type": "phi3", "tie_word_embeddings": True, "original_max_position_embeddings": 2048},
    "gemma3_six_layers": dict(GEMMA, num_hidden_layers=6, head_dim=32, query_pre_attn_scalar=32, sliding_window=24,
                              rope_theta=1e6, rope_local_base_freq=1e4,
                              rope_scaling={"rope_type": "linear", "factor": 8.0}),
    "gemma3_pattern_key": dict(GEMMA, head_dim=32, query_pre_attn_scalar=32, sliding_window=16, rope_theta=1e5,
                               rope_local_base_freq=5e3, tie_word_embeddings=False,
                               layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    "gemma3_local_base": dict(GEMMA, num_hidden_layers=2, head_dim=256, query_pre_attn_scalar=256,
                              sliding_window=40, rope_theta=1e6, rope_local_base_freq=1e4,
                              tie_word_embeddings=True),
    "lfm2_tied_mha": dict(LFM2, num_key_value_heads=4, num_hidden_layers=4, conv_L_cache=4, tie_word_embeddings=True,
                          layer_types=["conv", "conv", "full_attention", "conv"]),
    "lfm2_untied_gqa_head32": dict(LFM2, head_dim=32, conv_L_cache=3, tie_word_embeddings=False,
                                   layer_types=["full_attention", "conv", "full_attention"]),
    # llama.cpp's converter writes no conv biases (its LFM2 has none); a file that holds them is read whole
    "lfm2_conv_bias": dict(LFM2, conv_bias=True, tie_word_embeddings=True, layer_types=["conv", "full_attention", "conv"]),
    # Gemma 4 with per-layer inputs: V from K on the global layers, whose proportional RoPE turns half
    # of the frequencies; and E2B/E4B's shape: wider global layers with fewer kv heads, the last two
    # layers sharing K/V with double-wide MLPs, no logit softcapping
    "gemma4_k_eq_v_proportional": dict(GEMMA4, tie_word_embeddings=True, attention_k_eq_v=True, sliding_window=24,
                                       rope_parameters={"full_attention": {
                                           "rope_type": "proportional", "partial_rotary_factor": 0.5,
                                           "rope_theta": 1_000_000.0},
                                           "sliding_attention": {"rope_type": "default", "rope_theta": 5_000.0}}),
    "gemma4_kv_shared_wide": dict(GEMMA4, tie_word_embeddings=False, attention_k_eq_v=True, sliding_window=24,
                                  global_head_dim=64, num_global_key_value_heads=1, num_kv_shared_layers=2,
                                  use_double_wide_mlp=True, final_logit_softcapping=None),
    "gemma4_untied_mha": dict(GEMMA4, tie_word_embeddings=False, num_key_value_heads=4, sliding_window=40),
}
TRANSFORMERS = ["llama_tied_mha", "qwen2_tied", "qwen3_tied_mha", "phi3_plain_tied", "gemma3_local_base",
                "lfm2_tied_mha"]

ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "smollm3": "smollm3", "granite": "granite",
        "olmo2": "olmo2", "phi3": "phi3", "gemma3_text": "gemma3", "lfm2": "lfm2", "gemma4_text": "gemma4"}
PERMUTED = ("llama", "smollm3", "granite")  # llama.cpp's LlamaModel and its subclasses interleave q/k rows
LAYER = {  # HF name inside model.layers.N -> GGUF name inside blk.N (llama.cpp's tensor names)
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.qkv_proj": "attn_qkv", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
SANDWICH = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
            "post_feedforward_layernorm": "post_ffw_norm"}  # OLMo 2 and Gemma 3
PER_LAYER = {"per_layer_input_gate": "inp_gate", "per_layer_projection": "proj",
             "post_per_layer_input_norm": "post_norm"}  # Gemma 4's per-layer inputs
LFM2_LAYER = {  # LFM2's own names (its final norm is model.embedding_norm, llama.cpp's token_embd_norm)
    "operator_norm": "attn_norm", "ffn_norm": "ffn_norm", "feed_forward.w1": "ffn_gate",
    "feed_forward.w3": "ffn_up", "feed_forward.w2": "ffn_down", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.out_proj": "attn_output",
    "self_attn.q_layernorm": "attn_q_norm", "self_attn.k_layernorm": "attn_k_norm",
    "conv.conv": "shortconv.conv", "conv.in_proj": "shortconv.in_proj", "conv.out_proj": "shortconv.out_proj",
}
GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
          "model.embedding_norm": "token_embd_norm", "model.embed_tokens_per_layer": "per_layer_token_embd",
          "model.per_layer_model_projection": "per_layer_model_proj",
          "model.per_layer_projection_norm": "per_layer_proj_norm"}


def gguf_name(hf: str, model_type: str) -> str:
    stem, _, kind = hf.rpartition(".")
    if kind == "layer_scalar":  # Gemma 4's, to which llama.cpp's converter adds .weight
        return f"blk.{stem.split('.')[2]}.layer_output_scale.weight"
    if stem in GLOBAL:
        return f"{GLOBAL[stem]}.{kind}"
    _, _, n, rest = stem.split(".", 3)
    table = {**LAYER, **SANDWICH, **PER_LAYER} if model_type in ("olmo2", "gemma3_text", "gemma4_text") else LAYER
    table = LFM2_LAYER if model_type == "lfm2" else table
    return f"blk.{n}.{table[rest]}.{kind}"


def add_tokenizer(w, folder: Path) -> None:
    """The byte-level BPE of the checkpoint as llama.cpp's convert script stores a GPT-2 style vocabulary."""
    tok = json.loads((folder / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    specials = {t["id"] for t in tok["added_tokens"] if t.get("special")}
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([int(gguf.TokenType.CONTROL if i in specials else gguf.TokenType.NORMAL)
                       for i in range(len(tokens))])
    gguf.SpecialVocab(folder, load_merges=True, n_vocab=len(tokens)).add_to_gguf(w)


def write_gguf(folder: Path, out: Path) -> dict[str, np.ndarray]:
    """Convert the checkpoint in `folder` to `out`, F32, with the metadata llama.cpp's converter
    writes for its architecture. Returns the checkpoint's tensors by HF name."""
    from safetensors.numpy import load_file

    hp = json.loads((folder / "config.json").read_text())
    mt, arch = hp["model_type"], ARCH[hp["model_type"]]
    state = load_file(str(folder / "model.safetensors"))
    heads, kv, hidden = hp["num_attention_heads"], hp["num_key_value_heads"], hp["hidden_size"]
    head_dim = hp.get("head_dim") or hidden // heads
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name("tiny")
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hidden)
    layers, shared = hp["num_hidden_layers"], hp.get("num_kv_shared_layers") or 0
    if mt == "gemma4_text" and hp.get("use_double_wide_mlp"):  # twice as wide on the KV-shared layers
        w.add_feed_forward_length([hp["intermediate_size"] * (2 if n >= layers - shared else 1) for n in range(layers)])
    else:  # LFM2: the width Lfm2MLP adjusts intermediate_size to, as llama.cpp's converter computes it
        w.add_feed_forward_length(state["model.layers.0.feed_forward.w1.weight"].shape[0] if mt == "lfm2"
                                  else hp["intermediate_size"])
    w.add_block_count(hp["num_hidden_layers"])
    w.add_head_count(heads)
    if mt == "lfm2":  # per layer, 0 for a conv layer (how llama.cpp tells them from attention layers)
        w.add_head_count_kv([kv if t == "full_attention" else 0 for t in hp["layer_types"]])
    elif mt == "gemma4_text" and hp.get("num_global_key_value_heads") is not None:  # per layer type
        w.add_head_count_kv([kv if t == "sliding_attention" else hp["num_global_key_value_heads"]
                             for t in hp["layer_types"]])
    else:
        w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    rope = hp.get("rope_parameters") or {}
    theta = rope.get("full_attention", {}).get("rope_theta") if mt == "gemma4_text" else (
        hp.get("rope_theta") or rope.get("rope_theta") or rope.get("full_attention", {}).get("rope_theta"))
    w.add_rope_freq_base(theta)
    scaling = hp.get("rope_scaling") or {}
    if scaling.get("rope_type", scaling.get("type")) == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(scaling["factor"])
    if mt == "lfm2":
        w.add_vocab_size(hp["vocab_size"])
        w.add_shortconv_l_cache(hp["conv_L_cache"])
    if mt in ("qwen3", "gemma3_text") or (mt not in ("granite", "phi3", "gemma4_text") and "head_dim" in hp):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if mt in PERMUTED:
        w.add_rope_dimension_count(hidden // heads if mt == "granite" else head_dim)
        w.add_vocab_size(hp["vocab_size"])
    if mt == "granite":
        w.add_attention_scale(hp["attention_multiplier"])
        w.add_embedding_scale(hp["embedding_multiplier"])
        w.add_residual_scale(hp["residual_multiplier"])
        w.add_logit_scale(hp["logits_scaling"])
    if mt == "phi3":
        rotary = int(hp.get("partial_rotary_factor", 1.0) * hidden) // heads
        w.add_rope_dimension_count(rotary)
        w.add_rope_scaling_orig_ctx_len(hp["original_max_position_embeddings"])
        w.add_sliding_window(hp.get("sliding_window") or 0)
        if scaling:
            scale = hp["max_position_embeddings"] / hp["original_max_position_embeddings"]
            w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(
                hp["original_max_position_embeddings"])))
            w.add_tensor("rope_factors_long.weight", np.array(scaling["long_factor"], np.float32))
            w.add_tensor("rope_factors_short.weight", np.array(scaling["short_factor"], np.float32))
    if mt == "gemma3_text":
        w.add_sliding_window(hp["sliding_window"])
        local = hp.get("rope_local_base_freq") or rope.get("sliding_attention", {}).get("rope_theta")
        if local != 10_000.0:  # a file from before rope.freq_base_swa leaves it out: llama.cpp's 10000
            w.add_rope_freq_base_swa(local)
        sliding = [t == "sliding_attention" for t in hp["layer_types"]]
        if sliding != [(n + 1) % 6 != 0 for n in range(len(sliding))]:  # as OLMo 3's converter writes one
            w.add_sliding_window_pattern(sliding)
    if mt == "gemma4_text":
        write_gemma4_keys(w, hp)
    add_tokenizer(w, folder)
    for name, t in state.items():
        t = t.astype(np.float32)
        if mt in PERMUTED and name.endswith(("q_proj.weight", "q_proj.bias")):
            t = llamacpp_permute(t, heads)
        if mt in PERMUTED and name.endswith(("k_proj.weight", "k_proj.bias")):
            t = llamacpp_permute(t, kv)
        if mt == "gemma3_text" and name.endswith("norm.weight"):
            t = t + np.float32(1)
        if mt == "lfm2" and name.endswith("conv.conv.weight"):
            t = t.squeeze(1)  # llama.cpp's conv op takes the depthwise kernel 2-D
        w.add_tensor(gguf_name(name, mt), t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return state


def write_gemma4_keys(w, hp: dict) -> None:
    """What llama.cpp's Gemma 4 converter adds to Gemma 3's keys: the layer pattern, both head sizes,
    the KV-shared layers, the per-layer input width, and the global layers' proportional RoPE as a
    rope_freqs tensor (1 for each rotated frequency, 1e30 for the rest)."""
    rope = hp["rope_parameters"]
    w.add_sliding_window(hp["sliding_window"])
    w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    if hp.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(hp["final_logit_softcapping"])
    w.add_shared_kv_layers(hp.get("num_kv_shared_layers") or 0)
    w.add_embedding_length_per_layer_input(hp.get("hidden_size_per_layer_input") or 0)
    w.add_sliding_window_pattern([t == "sliding_attention" for t in hp["layer_types"]])
    full = hp.get("global_head_dim") or hp["head_dim"]
    w.add_key_length(full)
    w.add_value_length(full)
    w.add_key_length_swa(hp["head_dim"])
    w.add_value_length_swa(hp["head_dim"])
    w.add_rope_dimension_count(full)
    w.add_rope_dimension_count_swa(hp["head_dim"])
    if rope["full_attention"].get("rope_type") == "proportional":
        rotated = int(full * rope["full_attention"]["partial_rotary_factor"] / 2)
        w.add_tensor("rope_freqs.weight", np.array([1.0] * rotated + [1e30] * (full // 2 - rotated), np.float32))


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    made: dict[str, tuple[Path, Path, dict]] = {}

    def get(name: str) -> tuple[Path, Path, dict]:
        if name not in made:
            folder = make_tiny_checkpoint(tmp_path_factory.mktemp(name), **CASES[name])
            if CASES[name]["model_type"] == "gemma4_text":
                scale_layers(folder)
            file = folder / f"{name}.gguf"
            made[name] = folder, file, write_gguf(folder, file)
        return made[name]

    return get


@pytest.mark.parametrize("name", list(CASES))
def test_config_and_every_tensor_equal_the_checkpoint(converted, name):
    folder, file, state = converted(name)
    lazy = open_gguf(file)
    assert lazy.config_dict["model_type"] == CASES[name]["model_type"]
    ours = LlamaConfig.from_hf_dict(lazy.config_dict)
    want = LlamaConfig.from_hf_dict(json.loads((folder / "config.json").read_text()))
    assert f32(ours.to_dict()) == f32(want.to_dict())  # GGUF holds the config's numbers as float32
    assert sorted(lazy.names()) == sorted(state)
    for hf, t in state.items():
        got = lazy.get(hf)
        assert got.dtype == torch.float32 and tuple(got.shape) == t.shape, hf
        if want.model_type == "gemma3_text" and hf.endswith("norm.weight"):
            # the file holds 1 + w in fp32; taking 1 back off is exact, the sum was not
            torch.testing.assert_close(got, torch.from_numpy(t), rtol=0, atol=2.0 ** -23)
            assert torch.equal(got + 1, torch.from_numpy(t + np.float32(1))), hf
        else:
            assert torch.equal(got, torch.from_numpy(t)), hf


@pytest.mark.parametrize("name", TRANSFORMERS)
def test_config_and_tensors_equal_transformers_gguf_load(converted, name):
    from transformers import AutoConfig, AutoModelForCausalLM

    folder, file, _ = converted(name)
    lazy = open_gguf(file)
    theirs = AutoConfig.from_pretrained(str(folder), gguf_file=file.name).to_dict()
    assert LlamaConfig.from_hf_dict(lazy.config_dict) == LlamaConfig.from_hf_dict(theirs)
    state = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=file.name, dtype=torch.float32).state_dict()
    tied = lazy.config_dict["tie_word_embeddings"]
    assert set(lazy.names()) == set(state) - ({"lm_head.weight"} if tied else set())
    for hf in lazy.names():
        assert torch.equal(lazy.get(hf), state[hf]), hf


@pytest.mark.parametrize("name", ["gemma4_untied_mha", "gemma4_k_eq_v_proportional"])
def test_gemma4_tensors_equal_transformers_gguf_load(converted, name):
    """transformers' GGUF reader takes few of Gemma 4's keys (head sizes, layer pattern, per-layer
    inputs come from Gemma4TextConfig's defaults) and reads no layer_output_scale: given the
    checkpoint's config, every other tensor it loads from the file is the lazy reader's."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder, file, _ = converted(name)
    lazy = open_gguf(file)
    state = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=file.name, dtype=torch.float32,
                                                 config=AutoConfig.from_pretrained(str(folder))).state_dict()
    tied = lazy.config_dict["tie_word_embeddings"]
    assert set(lazy.names()) == set(state) - ({"lm_head.weight"} if tied else set())
    read = [hf for hf in lazy.names() if not hf.endswith("layer_scalar")]
    assert len(read) < len(lazy.names())
    for hf in read:
        assert torch.equal(lazy.get(hf), state[hf]), hf


def test_a_family_we_do_not_export_is_refused_by_name(tmp_path):
    for arch, words in (("lfm2moe", "'lfm2moe' model, which llama-ane does not export"),
                        ("gemma3n", "'gemma3n' model, which llama-ane does not export")):
        path = write_bare(tmp_path / f"{arch}.gguf", arch)
        with pytest.raises(GGUFError) as e:
            open_gguf(path)
        for what in (words, "supported: general.architecture 'llama'", "'phi3' (Phi-3, Phi-3.5, Phi-4-mini)",
                     "'gemma3' (Gemma 3's text model)", "'olmo2'", "'granite'", "'smollm3'",
                     "'lfm2' (LFM2, LFM2.5)", "'gemma4' (Gemma 4's text model)", "'falcon-h1' (Falcon-H1)"):
            assert what in str(e.value)
        with pytest.raises(LlamaANEError, match=words):  # the one line the CLI prints
            load_checkpoint(path)


def copy_gguf(src: Path, dst: Path, drop: tuple[str, ...] = (), extra: dict[str, np.ndarray] | None = None,
              values: dict[str, list[int] | int] | None = None) -> Path:
    """`src` rewritten to `dst` without the metadata keys `drop`, with the tensors `extra` added and the
    integer (list) keys `values` written as given, in place or added."""
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst), arch)
    for key, value in (values or {}).items():
        w.add_array(key, value) if isinstance(value, list) else w.add_uint32(key, value)
    for key, field in reader.fields.items():
        if key in (values or {}):
            continue
        elif key.startswith((f"{arch}.", "tokenizer.")) and key not in drop:
            sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    for t in reader.tensors:
        w.add_tensor(t.name, np.array(t.data))
    for name, t in (extra or {}).items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def test_a_tensor_the_family_lacks_is_refused_by_name(tmp_path, converted):
    """A Qwen3 file with a tensor no Qwen3 block has would be exported without it: refused, named."""
    _, file, _ = converted("qwen3_tied_mha")
    path = copy_gguf(file, tmp_path / "extra.gguf", extra={"blk.0.attn_gate.weight": np.zeros((64, 64), np.float32)})
    with pytest.raises(GGUFError, match=r"tensors a qwen3 checkpoint llama-ane exports does not: \['blk.0.attn_gate"):
        open_gguf(path)


def test_lfm2_conv_layers_are_those_without_kv_heads(tmp_path, converted):
    """llama.cpp tells LFM2's conv layers by a head_count_kv of 0; a list of the wrong length, attention
    layers with different head counts, or a per-layer list in another family is refused, naming the key."""
    _, file, _ = converted("lfm2_tied_mha")
    cfg = LlamaConfig.from_hf_dict(open_gguf(file).config_dict)
    assert (cfg.conv_layers, cfg.conv_kernel, cfg.num_key_value_heads) == ([0, 1, 3], 4, 4)
    for kv in ([0, 0, 4], [0, 2, 4, 0]):
        path = copy_gguf(file, tmp_path / "kv.gguf", values={"lfm2.attention.head_count_kv": kv})
        with pytest.raises(GGUFError, match=r"lfm2.attention.head_count_kv must list block_count \(4\) entries"):
            open_gguf(path)
    _, qwen, _ = converted("qwen2_tied")
    path = copy_gguf(qwen, tmp_path / "qwen.gguf", values={"qwen2.attention.head_count_kv": [2, 2, 2]})
    with pytest.raises(GGUFError, match="per-layer qwen2.attention.head_count_kv"):
        open_gguf(path)


def test_granite_scales_the_file_leaves_out_are_llama_cpps_defaults(tmp_path, converted):
    """llama.cpp's converter writes a Granite multiplier only where it is set; without one llama.cpp
    scales attention by 1/sqrt(head_dim) and leaves the rest alone."""
    _, file, _ = converted("granite_tied")
    keys = ("granite.attention.scale", "granite.embedding_scale", "granite.residual_scale", "granite.logit_scale")
    cfg = LlamaConfig.from_hf_dict(open_gguf(copy_gguf(file, tmp_path / "plain.gguf", drop=keys)).config_dict)
    assert (cfg.query_scale, cfg.embedding_multiplier, cfg.residual_multiplier, cfg.logits_scaling) == (
        cfg.head_dim ** -0.5, 1.0, 1.0, 1.0)


def test_gemma3_layer_pattern_and_attention_scale_as_llama_cpp_takes_them(converted):
    """No key of the file holds Gemma 3's layer pattern (older files) or attention scale: every sixth
    layer is global and the scale is the head size's, as llama.cpp runs them."""
    _, file, _ = converted("gemma3_six_layers")
    cfg = LlamaConfig.from_hf_dict(open_gguf(file).config_dict)
    assert cfg.sliding_layers == [0, 1, 2, 3, 4] and cfg.sliding_window == 24
    assert cfg.query_scale == 32 ** -0.5 and cfg.rope_local_theta == 1e4
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 8.0}


@pytest.mark.parametrize("change, words", [
    ({"values": {"gemma4.expert_count": [4]}}, r"Gemma 4 MoE \(gemma4.expert_count\)"),
    ({"values": {"gemma4.feed_forward_length": [128, 256, 128, 256]}}, "gemma4.feed_forward_length"),
    ({"values": {"gemma4.feed_forward_length": [128, 128, 256]}}, r"lists 3 layers, the model has 4"),
    ({"values": {"gemma4.attention.head_count_kv": [2, 1, 2, 2]}}, "gemma4.attention.head_count_kv gives layers"),
    ({"drop": ("gemma4.attention.sliding_window_pattern",)}, "gemma4.attention.sliding_window_pattern must list"),
    ({"values": {"gemma4.rope.dimension_count_swa": 16}}, r"partial RoPE \(rope.dimension_count 16 of head size 32"),
    ({"values": {"gemma4.rope.dimension_count": 32}}, "unlike their key_length 64"),
])
def test_what_a_gemma4_file_cannot_say_is_refused_by_name(tmp_path, converted, change, words):
    """A Gemma 4 MoE, a layer layout the dense export does not build, or a header that does not add up
    is refused, naming the key; nothing is exported wrong."""
    _, file, _ = converted("gemma4_kv_shared_wide")
    with pytest.raises(GGUFError, match=words):
        open_gguf(copy_gguf(file, tmp_path / "bad.gguf", **change))


@pytest.mark.export
@pytest.mark.parametrize("name", ["qwen3_untied_head32", "lfm2_untied_gqa_head32", "gemma4_kv_shared_wide"])
def test_a_gguf_exports_and_matches_transformers(converted, tmp_path, name):
    """The whole path from a .gguf: load_checkpoint (tokenizer included), export, and the torch
    backend in fp32 against transformers' model of the checkpoint the file was converted from."""
    folder, file, _ = converted(name)
    check_gguf_export_matches_transformers(file, folder, tmp_path / "out", CASES[name]["model_type"])


def test_falcon_h1_mixer_heads_that_do_not_divide_its_width_are_refused_by_name(tmp_path):
    """A falcon-h1 file whose ssm.time_step_rank (the mixer's heads) does not divide ssm.inner_size."""
    file = Path(__file__).parent / "fixtures" / "llamacpp_gguf" / "falcon_h1_untied" / "model.gguf"
    assert open_gguf(copy_gguf(file, tmp_path / "same.gguf")).config_dict["mamba_n_heads"] == 4
    path = copy_gguf(file, tmp_path / "heads.gguf", values={"falcon-h1.ssm.time_step_rank": 3})
    with pytest.raises(GGUFError, match=r"falcon-h1.ssm.inner_size \(128\) is not a multiple of "
                                        r"falcon-h1.ssm.time_step_rank \(3, the mixer's heads\)"):
        open_gguf(path)
