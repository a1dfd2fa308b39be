"""GGUF files the tests write and what they are held to: a tiny 2-layer Llama GGUF with q/k rows interleaved
as llama.cpp's convert script stores them, float32 rounding of a config, Gemma 4's layer scalars made
distinct, a GGUF's export against transformers' model of its checkpoint, and a file that says only
which architecture it holds."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

# the tiny GGUF's shapes (write_tiny)
VOCAB, HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, HEAD_DIM, CTX = 64, 32, 48, 2, 4, 2, 8, 256
EPS = float(np.float32(1e-5))  # GGUF stores it as float32


def llamacpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert script on q/k rows: each head's (2, D/2) halves -> (D/2, 2) pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny(path: Path, *, untied: bool = False, arch: str = "llama", theta: float = 10000.0,
               rope_freqs: np.ndarray | None = None, scaling: tuple[str, float] | None = None,
               int8: str | None = None) -> dict[str, np.ndarray]:
    """A 2-layer Llama GGUF: layer 0 and the norms in F32, layer 1, embeddings and head in F16
    (`int8`: the GGUF name of one tensor stored as I8 instead).

    Returns the HF tensors as the file should give them back (F16 ones already rounded to fp16).
    """
    gguf = pytest.importorskip("gguf")
    rng = np.random.default_rng(0)
    hf: dict[str, np.ndarray] = {}
    tensors: list[tuple[str, np.ndarray]] = []

    def add(hf_name: str, gguf_name: str, shape: tuple[int, ...], f16: bool, permute_heads: int = 0):
        w = rng.standard_normal(shape).astype(np.float16 if f16 else np.float32)
        hf[hf_name] = w.astype(np.float32)
        tensors.append((gguf_name, llamacpp_permute(w, permute_heads) if permute_heads else w))

    add("model.embed_tokens.weight", "token_embd.weight", (VOCAB, HIDDEN), True)
    for i in range(LAYERS):
        p, b, f16 = f"model.layers.{i}.", f"blk.{i}.", i == 1
        add(p + "input_layernorm.weight", b + "attn_norm.weight", (HIDDEN,), False)
        add(p + "self_attn.q_proj.weight", b + "attn_q.weight", (HEADS * HEAD_DIM, HIDDEN), f16, HEADS)
        add(p + "self_attn.k_proj.weight", b + "attn_k.weight", (KV_HEADS * HEAD_DIM, HIDDEN), f16, KV_HEADS)
        add(p + "self_attn.v_proj.weight", b + "attn_v.weight", (KV_HEADS * HEAD_DIM, HIDDEN), f16)
        add(p + "self_attn.o_proj.weight", b + "attn_output.weight", (HIDDEN, HEADS * HEAD_DIM), f16)
        add(p + "post_attention_layernorm.weight", b + "ffn_norm.weight", (HIDDEN,), False)
        add(p + "mlp.gate_proj.weight", b + "ffn_gate.weight", (INTER, HIDDEN), f16)
        add(p + "mlp.up_proj.weight", b + "ffn_up.weight", (INTER, HIDDEN), f16)
        add(p + "mlp.down_proj.weight", b + "ffn_down.weight", (HIDDEN, INTER), f16)
    add("model.norm.weight", "output_norm.weight", (HIDDEN,), False)
    if untied:
        add("lm_head.weight", "output.weight", (VOCAB, HIDDEN), True)
    if rope_freqs is not None:
        tensors.append(("rope_freqs.weight", rope_freqs))

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny")
    w.add_context_length(CTX)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTER)
    w.add_block_count(LAYERS)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(EPS)
    w.add_vocab_size(VOCAB)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if scaling is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType(scaling[0]))
        w.add_rope_scaling_factor(scaling[1])
    for name, t in tensors:
        w.add_tensor(name, t.astype(np.int8) if name == int8 else t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


def write_bare(path: Path, arch: str) -> Path:
    """A GGUF of general.architecture `arch` holding only a token embedding table: enough for a reader
    to refuse an architecture by name."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def f32(v):
    """`v` with every float in it rounded to float32."""
    if isinstance(v, dict):
        return {k: f32(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [f32(x) for x in v]
    return float(np.float32(v)) if isinstance(v, float) else v


def scale_layers(folder: Path) -> None:
    """Give Gemma 4's layer scalars (1 in a fresh model) values of their own, so that reading them wrong shows."""
    from safetensors.numpy import load_file, save_file

    state = load_file(str(folder / "model.safetensors"))
    for name in state:
        if name.endswith("layer_scalar"):
            state[name] = np.array([0.5 + int(name.split(".")[2]) / 8], np.float32)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


def check_gguf_export_matches_transformers(file: Path, folder: Path, out: Path, model_type: str) -> None:
    """Export `file` (load_checkpoint, tokenizer included) and hold the torch backend's fp32 logits to
    within 1e-3 of transformers' model of `folder`, the checkpoint the file was converted from."""
    import llama_ane
    from llama_ane.api import export_model
    from transformers import AutoModelForCausalLM

    out = export_model(file, out, context_length=128, prefill_length=32, layers_per_chunk=2,
                       precision="fp32", progress=False, verify=False)
    model = llama_ane.load(out, backend="torch", precision="fp32")
    assert model.manifest["config"]["model_type"] == model_type and model.manifest["source"]["kind"] == "gguf"
    ref = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ids = [int(i) for i in np.random.default_rng(1).integers(3, ref.config.vocab_size, 100)]
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0].numpy()
    got = model.score(ids)
    model.close()
    assert got.shape == want.shape and np.abs(want).max() > 1.0
    assert float(np.abs(got - want).max()) <= 1e-3
