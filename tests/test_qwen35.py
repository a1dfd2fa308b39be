"""Qwen3.5's linear-attention layer (llama_ane.model.delta_net) held to transformers': the chunked
delta rule to torch_recurrent_gated_delta_rule, the whole DeltaLayer to Qwen3_5DecoderLayer over a
sequence, over padded prefill windows then decoding (the same states), and the MIL builder run by
the MIL executor on a padded window."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llama_ane.model.delta_net import DeltaLayer, DeltaShape, delta_layer_mil, gated_delta
from llama_ane.model.layers import Graph
from llama_ane.model.short_conv import conv_state_after, conv_state_after_mil

transformers = pytest.importorskip("transformers")
from transformers import DynamicCache, Qwen3_5TextConfig  # noqa: E402
from transformers.models.qwen3_5.modeling_qwen3_5 import (Qwen3_5DecoderLayer,  # noqa: E402
                                                          torch_recurrent_gated_delta_rule)

C, EPS, TOKENS, K = 32, 1e-6, 23, 4
# (key heads, value heads, Dk, Dv): GQA-style value heads per key head, and one each
SHAPES = {"grouped": (2, 4, 16, 8), "one_each": (3, 3, 8, 16)}
UNIT_OFFSET = ("input_layernorm.weight", "post_attention_layernorm.weight")  # Qwen3.5's (1 + w) norms


def reference(shape: str) -> tuple[Qwen3_5TextConfig, Qwen3_5DecoderLayer]:
    gk, h, dk, dv = SHAPES[shape]
    cfg = Qwen3_5TextConfig(hidden_size=C, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                            num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=32,
                            intermediate_size=48, linear_conv_kernel_dim=K, linear_key_head_dim=dk,
                            linear_value_head_dim=dv, linear_num_key_heads=gk, linear_num_value_heads=h,
                            rms_norm_eps=EPS)
    torch.manual_seed(0)
    module = Qwen3_5DecoderLayer(cfg, 0).eval()
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("A_log"):  # decays from slow to fast, as trained checkpoints hold
                p.copy_(torch.linspace(-2.0, 1.5, h))
            else:
                p.normal_(0.0 if p.dim() > 1 else 0.2, 0.3)
    return cfg, module


def delta_shape(shape: str) -> DeltaShape:
    gk, h, dk, dv = SHAPES[shape]
    return DeltaShape(gk, h, dk, dv, K, EPS)


def ours(hf: Qwen3_5DecoderLayer, shape: str) -> DeltaLayer:
    """DeltaLayer with hf's weights: 1x1 convs, the (1 + w) norms stored as 1 + w."""
    module = DeltaLayer(C, hf.mlp.gate_proj.out_features, delta_shape(shape)).eval()
    shapes = {name: t.shape for name, t in module.state_dict().items()}
    state = {name: (t + 1.0 if name in UNIT_OFFSET else t).reshape(shapes[name]) for name, t in hf.state_dict().items()}
    module.load_state_dict(state)
    return module


def channels_first(x: torch.Tensor) -> torch.Tensor:
    """(1, S, C) -> (1, C, 1, S)"""
    return x.transpose(1, 2).unsqueeze(2)


def zero_states(net: DeltaShape) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(1, net.conv_channels, 1, K - 1), torch.zeros(net.state_shape)


def carried(state: torch.Tensor, net: DeltaShape) -> torch.Tensor:
    """Our (1,H*Dk,1,Dv) state as transformers keeps it, (1,H,Dk,Dv)."""
    return state.reshape(1, net.v_heads, net.dk, net.dv)


@pytest.fixture(scope="module", params=list(SHAPES))
def pair(request):
    cfg, hf = reference(request.param)
    x = torch.randn(1, TOKENS, C, generator=torch.Generator().manual_seed(1))
    cache = DynamicCache(config=cfg)
    with torch.no_grad():
        y = hf(x, position_embeddings=None, cache=cache)
    states = cache.get_conv_state(0, state_idx=0), cache.get_recurrent_state(0, state_idx=0)
    return hf, ours(hf, request.param), delta_shape(request.param), x, y, states


@pytest.mark.parametrize("s", [1, 2, 5, 16, 64])
def test_chunked_rule_matches_the_recurrent_one(s):
    """gated_delta over one window of S tokens from a random state equals transformers' token loop."""
    gen = torch.Generator().manual_seed(s)
    gk, r, dk, dv = 2, 3, 16, 8
    q, k = (torch.nn.functional.normalize(torch.randn(1, s, gk, dk, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(1, s, gk * r, dv, generator=gen)
    g = -torch.rand(1, s, gk * r, generator=gen) * 3.0
    beta = torch.rand(1, s, gk * r, generator=gen)
    state = torch.randn(1, gk * r, dk, dv, generator=gen)
    o_ref, new_ref = torch_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=state, output_final_state=True)
    o, new = gated_delta((q / dk ** 0.5).permute(2, 0, 3, 1), k.permute(2, 0, 3, 1),
                         v.reshape(1, s, gk, r, dv).permute(2, 3, 4, 1, 0).squeeze(-1),
                         g.reshape(1, s, gk, r).permute(2, 3, 0, 1), beta.reshape(1, s, gk, r).permute(2, 3, 0, 1),
                         state.reshape(gk, r, dk, dv))
    torch.testing.assert_close(o.permute(3, 0, 1, 2).reshape(1, s, gk * r, dv), o_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(new.reshape(1, gk * r, dk, dv), new_ref, rtol=1e-4, atol=1e-4)


def test_whole_sequence_and_states_match_transformers(pair):
    hf, module, net, x, y_ref, (conv_ref, state_ref) = pair
    conv_state, state = zero_states(net)
    with torch.no_grad():
        y, mixed, new = module(channels_first(x), conv_state, state, TOKENS)
        conv_new = conv_state_after(conv_state, mixed, TOKENS)
    torch.testing.assert_close(y, channels_first(y_ref), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(carried(new, net), state_ref, rtol=1e-4, atol=1e-4)
    # transformers keeps the last K inputs; the convolution needs only the last K-1 of them
    torch.testing.assert_close(conv_new.reshape(-1, K - 1), conv_ref[0, :, 1:], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("window", [1, 4, 8, 16])
def test_padded_windows_then_decode_carry_the_states(pair, window):
    """Prefill windows of `window` columns, the last one padded with garbage, then decode one token
    at a time: the real columns equal the whole sequence's and both states end at the last real token."""
    hf, module, net, x, y_ref, (conv_ref, state_ref) = pair
    xs, prefill = channels_first(x), 13
    (conv_state, state), outputs = zero_states(net), []
    with torch.no_grad():
        for start in range(0, prefill, window):
            n = min(window, prefill - start)
            part = torch.cat([xs[..., start:start + n], torch.full((1, C, 1, window - n), 5.0)], dim=3)
            y, mixed, state = module(part, conv_state, state, n)
            outputs.append(y[..., :n])
            conv_state = conv_state_after(conv_state, mixed, n)
        for t in range(prefill, TOKENS):
            y, mixed, state = module(xs[..., t:t + 1], conv_state, state, 1)
            outputs.append(y)
            conv_state = conv_state_after(conv_state, mixed, 1)
    torch.testing.assert_close(torch.cat(outputs, dim=3), channels_first(y_ref), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(carried(state, net), state_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(conv_state.reshape(-1, K - 1), conv_ref[0, :, 1:], rtol=1e-5, atol=1e-6)


def test_fp16_window_stays_near_fp32(pair):
    """The same window in fp16 (the exported precision) stays finite and within 1% of fp32's scale
    (fp16 keeps 11 bits: the residual stream's values near 30 are 0.016 apart)."""
    hf, module, net, x, _, _ = pair
    conv_state, state = zero_states(net)
    with torch.no_grad():
        y32, _, s32 = module(channels_first(x), conv_state, state, TOKENS)
        half = DeltaLayer(C, hf.mlp.gate_proj.out_features, net).eval()
        half.load_state_dict(module.state_dict())
        y16, _, s16 = half.half()(channels_first(x).half(), conv_state.half(), state.half(), TOKENS)
    assert torch.isfinite(y16).all() and torch.isfinite(s16).all()
    torch.testing.assert_close(y16.float(), y32, rtol=0, atol=0.01 * y32.abs().max().item())
    torch.testing.assert_close(s16.float(), s32, rtol=0, atol=0.01 * s32.abs().max().item())


@pytest.mark.export
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_mil_builder_matches_torch_on_a_padded_window(pair, tmp_path, precision):
    ct = pytest.importorskip("coremltools")
    from coremltools.converters.mil import Builder as mb
    from llama_ane.mil import PackageExecutor

    hf, module, net, x, _, _ = pair
    dtype = np.float32 if precision == "fp32" else np.float16
    params = {name: t.numpy().astype(dtype) for name, t in module.state_dict().items()}
    g = Graph(dtype, lambda name: params[name])
    s, n, width = 16, 11, 32  # a conv state kept 32 wide, right-aligned
    int32, fp = ct.converters.mil.mil.types.int32, (ct.converters.mil.mil.types.fp32 if precision == "fp32"
                                                    else ct.converters.mil.mil.types.fp16)

    @mb.program(input_specs=[mb.TensorSpec(shape=(1, C, 1, s), dtype=fp),
                             mb.TensorSpec(shape=(1, net.conv_channels, 1, width), dtype=fp),
                             mb.TensorSpec(shape=net.state_shape, dtype=fp), mb.TensorSpec(shape=(1,), dtype=int32)],
                opset_version=ct.target.iOS18)
    def prog(x, conv_state, delta_state, n):
        y, mixed, new = delta_layer_mil(g, x, conv_state, delta_state, n, "", C, net, s)
        return y, conv_state_after_mil(g, conv_state, mixed, n, K, s), new

    model = ct.convert(prog, minimum_deployment_target=ct.target.iOS18,
                       compute_precision=ct.precision.FLOAT32 if precision == "fp32" else ct.precision.FLOAT16)
    model.save(str(tmp_path / "delta_layer.mlpackage"))
    rng = np.random.default_rng(2)
    feeds = {"x": rng.standard_normal((1, C, 1, s)).astype(dtype),
             "conv_state": rng.standard_normal((1, net.conv_channels, 1, width)).astype(dtype),
             "delta_state": (0.3 * rng.standard_normal(net.state_shape)).astype(dtype), "n": np.array([n], np.int32)}
    got = list(PackageExecutor(tmp_path / "delta_layer.mlpackage", precision=precision).run("main", feeds).values())
    with torch.no_grad():
        t = {name: torch.from_numpy(v.astype(np.float32)) if v.dtype != np.int32 else v for name, v in feeds.items()}
        y, mixed, new = module(t["x"], t["conv_state"], t["delta_state"], n)
        conv_new = conv_state_after(t["conv_state"], mixed, n)
    tol = 1e-4 if precision == "fp32" else 0.03
    np.testing.assert_allclose(got[0][..., :n], y[..., :n].numpy(), rtol=tol, atol=tol)
    np.testing.assert_allclose(got[1], conv_new.numpy(), rtol=tol, atol=tol)
    np.testing.assert_allclose(got[2], new.numpy(), rtol=tol, atol=tol)
