"""LFM3's layer variants held to transformers' Lfm3DecoderLayer: the conv layer with norms on both
sides of its operator and its MLP (model.layers.short_conv.ConvLayer with sandwich), and the
attention output gate, one sigmoid a query head (model.layers.attention.DecoderLayer with
attn_head_gate), each in torch and as its MIL builder run by the MIL executor."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llama_ane.config import LlamaConfig
from llama_ane.model.layers import Graph
from llama_ane.model.layers.attention import DecoderLayer, gated_mil
from llama_ane.model.layers.short_conv import ConvLayer, conv_layer_mil, conv_state_after

transformers = pytest.importorskip("transformers")
from transformers import Lfm3Config  # noqa: E402
from transformers.models.lfm3.modeling_lfm3 import Lfm3DecoderLayer  # noqa: E402
from conftest import convert_to  # noqa: E402
from support.conv import channels_first, conv_pair, random_layer, with_weights_of  # noqa: E402

C, K, EPS, TOKENS = 16, 3, 1e-5, 11
# LFM3's names inside a conv layer -> ConvLayer's (sandwich): the norms as DecoderLayer's sandwich norms
RENAMED = {"operator_norm.": "input_layernorm.", "post_operator_norm.": "post_attention_layernorm.",
           "ffn_norm.": "pre_feedforward_layernorm.", "post_ffn_norm.": "post_feedforward_layernorm.",
           "feed_forward.w1.": "mlp.gate_proj.", "feed_forward.w3.": "mlp.up_proj.", "feed_forward.w2.": "mlp.down_proj."}


def reference(bias: bool) -> tuple[Lfm3Config, Lfm3DecoderLayer]:
    cfg = Lfm3Config(hidden_size=C, num_hidden_layers=2, layer_types=["conv", "full_attention"], num_attention_heads=2,
                     num_key_value_heads=1, head_dim=8, vocab_size=32, intermediate_size=40, conv_L_cache=K,
                     conv_bias=bias, norm_eps=EPS, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return cfg, random_layer(Lfm3DecoderLayer, cfg)


def ours(hf: Lfm3DecoderLayer, bias: bool) -> ConvLayer:
    """ConvLayer (sandwich) with hf's weights: the four norms, the conv and the MLP, no other."""
    return with_weights_of(ConvLayer(C, hf.feed_forward.w1.out_features, K, EPS, bias, sandwich=True).eval(), hf,
                           RENAMED)


@pytest.fixture(scope="module", params=[False, True], ids=["no_bias", "bias"])
def pair(request):
    cfg, hf = reference(request.param)
    return conv_pair(cfg, hf, ours(hf, request.param), TOKENS)


def test_sandwich_conv_layer_matches_transformers(pair):
    """The whole sequence, then the same tokens as a prefill window and token-by-token decoding
    carrying the conv state: transformers' outputs and its conv state."""
    hf, module, x, y_ref, hf_state = pair
    with torch.no_grad():
        y, gated = module(channels_first(x), torch.zeros(1, C, 1, K - 1))
        state, outputs = conv_state_after(torch.zeros(1, C, 1, K - 1), gated[..., :6], 6), [y[..., :6]]
        for t in range(6, TOKENS):
            step, g = module(channels_first(x)[..., t:t + 1], state)
            outputs.append(step)
            state = conv_state_after(state, g, 1)
    torch.testing.assert_close(y, channels_first(y_ref), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat(outputs, dim=3), channels_first(y_ref), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state.reshape(C, K - 1), hf_state[0, :, 1:], rtol=1e-5, atol=1e-6)


def test_the_sandwich_norms_change_the_layer(pair):
    """The same weights without the sandwich (LFM2's layer, ffn_norm before the MLP) give other
    outputs: the test above sees the two norms it adds."""
    hf, module, x, y_ref, _ = pair
    plain = ConvLayer(C, hf.feed_forward.w1.out_features, K, EPS, module.conv.conv.bias is not None).eval()
    state = {k: v for k, v in module.state_dict().items() if "feedforward" not in k}
    state["post_attention_layernorm.weight"] = module.state_dict()["pre_feedforward_layernorm.weight"]
    plain.load_state_dict(state)
    with torch.no_grad():
        y, _ = plain(channels_first(x), torch.zeros(1, C, 1, K - 1))
    assert (y - channels_first(y_ref)).abs().max() > 0.1


def run_mil(tmp_path, name, prog, feeds):
    from llama_ane.mil import PackageExecutor
    import coremltools as ct

    convert_to(prog, tmp_path / f"{name}.mlpackage", compute_precision=ct.precision.FLOAT32)
    return list(PackageExecutor(tmp_path / f"{name}.mlpackage", precision="fp32").run("main", feeds).values())


@pytest.mark.export
def test_sandwich_conv_layer_mil_matches_torch(pair, tmp_path):
    ct = pytest.importorskip("coremltools")
    from coremltools.converters.mil import Builder as mb

    _, module, _, _, _ = pair
    bias = module.conv.conv.bias is not None
    params = {name: t.numpy() for name, t in module.state_dict().items()}
    g, s = Graph(np.float32, lambda name: params[name]), 4

    @mb.program(input_specs=[mb.TensorSpec(shape=(1, C, 1, s)), mb.TensorSpec(shape=(1, C, 1, K - 1))],
                opset_version=ct.target.iOS18)
    def prog(x, conv_state):
        return conv_layer_mil(g, x, conv_state, "", C, K, EPS, s, bias, sandwich=True)

    rng = np.random.default_rng(2)
    feeds = {"x": rng.standard_normal((1, C, 1, s)).astype(np.float32),
             "conv_state": rng.standard_normal((1, C, 1, K - 1)).astype(np.float32)}
    got = run_mil(tmp_path, "conv_layer", prog, feeds)
    with torch.no_grad():
        y, gated = module(torch.from_numpy(feeds["x"]), torch.from_numpy(feeds["conv_state"]))
    np.testing.assert_allclose(got[0], y.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[1], gated.numpy(), rtol=1e-5, atol=1e-5)


# --- the attention output gate, one a query head ------------------------------------------------

HEADS, KV, D, S = 4, 2, 8, 5
GATED = LlamaConfig(vocab_size=32, hidden_size=C, intermediate_size=32, num_hidden_layers=1, num_attention_heads=HEADS,
                    num_key_value_heads=KV, head_dim=D, attn_head_gate=True)


@pytest.fixture(scope="module")
def gate():
    torch.manual_seed(3)
    layer = DecoderLayer(GATED, 32).eval()
    h = torch.randn(1, C, 1, S)
    heads = torch.randn(KV, HEADS // KV, D, S)
    return layer, h, heads


def test_head_gate_scales_each_head_as_transformers(gate):
    """transformers' Lfm3Attention: attn_output (S, H, D) * sigmoid(g_proj(h)) (S, H, 1), query head
    q = g * R + r of kv head g (repeat_kv's order), as DecoderLayer.gated does on (G, R, D, S)."""
    layer, h, heads = gate
    w = layer.g_proj.weight[:, :, 0, 0]  # (H, C)
    theirs = heads.reshape(HEADS, D, S).permute(2, 0, 1)  # (S, H, D)
    want = theirs * torch.sigmoid(h[0, :, 0].T @ w.T).unsqueeze(-1)
    with torch.no_grad():
        got = layer.gated(h, heads)
    torch.testing.assert_close(got.reshape(HEADS, D, S).permute(2, 0, 1), want)
    assert not torch.allclose(got, heads)


@pytest.mark.export
def test_head_gate_mil_matches_torch(gate, tmp_path):
    ct = pytest.importorskip("coremltools")
    from coremltools.converters.mil import Builder as mb

    layer, h, heads = gate
    params = {f"layers.0.{name}": t.detach().numpy() for name, t in layer.state_dict().items()}
    g = Graph(np.float32, lambda name: params[name])

    @mb.program(input_specs=[mb.TensorSpec(shape=(1, C, 1, S)), mb.TensorSpec(shape=(KV, HEADS // KV, D, S))],
                opset_version=ct.target.iOS18)
    def prog(hn, heads):
        return gated_mil(g, GATED, "layers.0.", hn, heads, S)

    got = run_mil(tmp_path, "gate", prog, {"hn": h.numpy(), "heads": heads.numpy()})
    with torch.no_grad():
        want = layer.gated(h, heads)
    np.testing.assert_allclose(got[0], want.numpy(), rtol=1e-5, atol=1e-6)


def test_the_head_gate_is_left_uncompressed():
    """Its (heads, C) weight has too few rows for a LUT group (and is a few KB): kept as it is."""
    from llama_ane.contract.sizing import weight_part

    assert weight_part("layers.1.g_proj.weight") is None
    assert weight_part("layers.1.q_proj.weight") == weight_part("layers.0.conv.in_proj.weight") == "attention"


# --- the family: its config and tensors as transformers builds them, and GGUF ----------------------

def test_lfm3_config_and_tensors_as_transformers_builds_them():
    """Lfm3Config's defaults (its layer layout, its RoPE per layer type, the kernel, the gate, tied
    embeddings) read as transformers reads them, written back as an equal Lfm3Config, and every
    tensor of its model (the gate as its checkpoints store it) expected at its shape."""
    import json

    from transformers import AutoConfig, AutoModelForCausalLM

    from llama_ane.checkpoint.mapping import expected_shape, expected_tensors
    from llama_ane.families.lfm3 import STORED
    from llama_ane.testing import TINY_CONFIG

    d = {k: v for k, v in TINY_CONFIG.items() if k not in ("tie_word_embeddings", "rope_theta")}  # theirs by default
    d.update(vocab_size=320, model_type="lfm3", num_hidden_layers=6, head_dim=32, pad_token_id=0, bos_token_id=1,
             eos_token_id=2)
    cfg, hf = LlamaConfig.from_hf_dict(d), AutoConfig.for_model(**d)
    assert [("conv" if cfg.convolves(n) else "sliding_attention" if cfg.slides(n) else "full_attention")
            for n in range(6)] == hf.layer_types == ["conv", "conv", "full_attention", "conv", "sliding_attention", "conv"]
    full, local = hf.rope_parameters["full_attention"], hf.rope_parameters["sliding_attention"]
    assert (cfg.rope_theta, cfg.rope_proportion, cfg.rope_scaling) == (full["rope_theta"], 0.5, None)
    assert cfg.rope_local_theta == local["rope_theta"] and cfg.sliding_window == hf.sliding_window == 256
    assert (cfg.conv_kernel, cfg.attn_head_gate, cfg.sandwich_norms, cfg.tie_word_embeddings) == (7, True, True, hf.tie_word_embeddings)
    assert hf.tie_word_embeddings
    assert LlamaConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg  # the manifest's copy
    rebuilt = cfg.transformers_config()
    assert (rebuilt.layer_types, rebuilt.rope_parameters, rebuilt.conv_L_cache) == (
        hf.layer_types, hf.rope_parameters, hf.conv_L_cache)
    rebuilt.pad_token_id = 0  # Lfm3Config's default is outside this vocabulary
    model = AutoModelForCausalLM.from_config(rebuilt)
    theirs = {}
    for name, p in model.named_parameters():
        for module, stored in STORED.items():
            name = name.replace(module, stored)
        theirs[name] = tuple(p.shape)
    ours = {name: expected_shape(cfg, name, dims) for name, dims in expected_tensors(cfg).items()}
    assert ours == theirs


def test_an_lfm3_gguf_is_refused_by_name(tmp_path):
    """llama.cpp has no LFM3 architecture; a file that says it holds one is refused by that name."""
    pytest.importorskip("gguf")
    from llama_ane.checkpoint.loader import load_checkpoint
    from llama_ane.errors import LlamaANEError
    from support.gguf import write_bare

    path = write_bare(tmp_path / "lfm3.gguf", "lfm3")
    with pytest.raises(LlamaANEError, match="'lfm3' model, which llama-ane does not export; supported: "
                                            "general.architecture"):
        load_checkpoint(path)
