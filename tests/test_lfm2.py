"""LFM2's conv layer (llama_ane.model.short_conv) held to transformers' Lfm2DecoderLayer: a whole
sequence, padded prefill windows and token-by-token decoding carrying the conv state, and the MIL
builder run by the MIL executor on a padded window."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llama_ane.model.layers import Graph
from llama_ane.model.short_conv import ConvLayer, conv_layer_mil, conv_state_after, conv_state_after_mil

transformers = pytest.importorskip("transformers")
from transformers import DynamicCache, Lfm2Config  # noqa: E402
from transformers.models.lfm2.modeling_lfm2 import Lfm2DecoderLayer  # noqa: E402

C, K, EPS, TOKENS = 16, 3, 1e-5, 11
RENAMED = {"operator_norm.": "input_layernorm.", "ffn_norm.": "post_attention_layernorm.",
           "feed_forward.w1.": "mlp.gate_proj.", "feed_forward.w3.": "mlp.up_proj.", "feed_forward.w2.": "mlp.down_proj."}


def reference(bias: bool) -> tuple[Lfm2Config, Lfm2DecoderLayer]:
    cfg = Lfm2Config(hidden_size=C, num_hidden_layers=2, layer_types=["conv", "full_attention"], num_attention_heads=2,
                     num_key_value_heads=1, vocab_size=32, intermediate_size=48, conv_L_cache=K, conv_bias=bias,
                     norm_eps=EPS, block_multiple_of=8)
    torch.manual_seed(0)
    module = Lfm2DecoderLayer(cfg, 0).eval()
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(1.0 if p.dim() == 1 else 0.0, 0.3)
    return cfg, module


def ours(hf: Lfm2DecoderLayer, bias: bool) -> ConvLayer:
    """ConvLayer with hf's weights, renamed and reshaped."""
    intermediate = hf.feed_forward.w1.out_features
    module = ConvLayer(C, intermediate, K, EPS, bias).eval()
    shapes = {name: t.shape for name, t in module.state_dict().items()}
    state = {}
    for name, t in hf.state_dict().items():
        for theirs, our in RENAMED.items():
            name = name.replace(theirs, our)
        state[name] = t.reshape(shapes[name])
    module.load_state_dict(state)
    return module


def channels_first(x: torch.Tensor) -> torch.Tensor:
    """(1, S, C) -> (1, C, 1, S)"""
    return x.transpose(1, 2).unsqueeze(2)


@pytest.fixture(scope="module", params=[False, True], ids=["no_bias", "bias"])
def pair(request):
    cfg, hf = reference(request.param)
    x = torch.randn(1, TOKENS, C, generator=torch.Generator().manual_seed(1))
    cache = DynamicCache(config=cfg)
    with torch.no_grad():
        y = hf(x, cache=cache)
    return hf, ours(hf, request.param), x, y, cache.get_conv_state(0, state_idx=0)


def test_whole_sequence_and_state_match_transformers(pair):
    hf, module, x, y_ref, hf_state = pair
    with torch.no_grad():
        y, gated = module(channels_first(x), torch.zeros(1, C, 1, K - 1))
        state = conv_state_after(torch.zeros(1, C, 1, K - 1), gated, TOKENS)
    torch.testing.assert_close(y, channels_first(y_ref), rtol=1e-5, atol=1e-5)
    # transformers keeps the last K inputs; the convolution needs only the last K-1 of them
    torch.testing.assert_close(state.reshape(C, K - 1), hf_state[0, :, 1:], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("window", [1, 4, 8])
def test_padded_windows_then_decode_carry_the_state(pair, window):
    """Prefill windows of `window` columns, the last one padded with garbage, then decode one token at
    a time: the real columns equal the whole sequence's, and the state ends at the last real token."""
    hf, module, x, y_ref, hf_state = pair
    xs, prefill = channels_first(x), 7
    state, outputs = torch.zeros(1, C, 1, K - 1), []
    with torch.no_grad():
        for start in range(0, prefill, window):
            n = min(window, prefill - start)
            part = torch.cat([xs[..., start:start + n], torch.full((1, C, 1, window - n), 5.0)], dim=3)
            y, gated = module(part, state)
            outputs.append(y[..., :n])
            state = conv_state_after(state, gated, n)
        for t in range(prefill, TOKENS):
            y, gated = module(xs[..., t:t + 1], state)
            outputs.append(y)
            state = conv_state_after(state, gated, 1)
    torch.testing.assert_close(torch.cat(outputs, dim=3), channels_first(y_ref), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state.reshape(C, K - 1), hf_state[0, :, 1:], rtol=1e-5, atol=1e-6)


@pytest.mark.export
def test_mil_builder_matches_torch_on_a_padded_window(pair, tmp_path):
    ct = pytest.importorskip("coremltools")
    from coremltools.converters.mil import Builder as mb
    from llama_ane.mil import PackageExecutor

    hf, module, x, _, _ = pair
    bias = module.conv.conv.bias is not None
    params = {name: t.numpy() for name, t in module.state_dict().items()}
    g = Graph(np.float32, lambda name: params[name])
    s, n = 4, 3
    int32 = ct.converters.mil.mil.types.int32

    @mb.program(input_specs=[mb.TensorSpec(shape=(1, C, 1, s)), mb.TensorSpec(shape=(1, C, 1, K - 1)),
                             mb.TensorSpec(shape=(1,), dtype=int32)],
                opset_version=ct.target.iOS18)
    def prog(x, conv_state, n):
        y, gated = conv_layer_mil(g, x, conv_state, "", C, K, EPS, s, bias)
        return y, conv_state_after_mil(g, conv_state, gated, n, K, s)

    model = ct.convert(prog, minimum_deployment_target=ct.target.iOS18, compute_precision=ct.precision.FLOAT32)
    model.save(str(tmp_path / "conv_layer.mlpackage"))
    rng = np.random.default_rng(2)
    feeds = {"x": rng.standard_normal((1, C, 1, s)).astype(np.float32),
             "conv_state": rng.standard_normal((1, C, 1, K - 1)).astype(np.float32), "n": np.array([n], np.int32)}
    got = list(PackageExecutor(tmp_path / "conv_layer.mlpackage", precision="fp32").run("main", feeds).values())
    with torch.no_grad():
        y, gated = module(torch.from_numpy(feeds["x"]), torch.from_numpy(feeds["conv_state"]))
        state = conv_state_after(torch.from_numpy(feeds["conv_state"]), gated, n)
    np.testing.assert_allclose(got[0], y.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[1], state.numpy(), rtol=1e-5, atol=1e-6)
