"""The checks a layer with a conv state and a recurrent state is held to against transformers: a Gated
DeltaNet layer (llama_ane.model.layers.delta_net.DeltaLayer) against a decoder layer of its family
(Qwen3.5's, OLMo-Hybrid's), a Mamba-2 mixer (llama_ane.model.layers.mamba2.Mamba2Mixer) against
Falcon-H1's: the whole sequence and its states, padded prefill windows then decoding, fp16, and its MIL
builder run by the MIL executor."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llama_ane.model.layers import Graph
from llama_ane.model.layers.delta_net import DeltaLayer, DeltaShape, delta_layer_mil, gated_delta
from llama_ane.model.layers.mamba2 import Mamba2Shape
from llama_ane.model.layers.short_conv import conv_state_after, conv_state_after_mil

from conftest import convert_to


def channels_first(x: torch.Tensor) -> torch.Tensor:
    """(1, S, C) -> (1, C, 1, S)"""
    return x.transpose(1, 2).unsqueeze(2)


def zero_states(net: DeltaShape) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(1, net.conv_channels, 1, net.kernel - 1), torch.zeros(net.state_shape)


def carried(state: torch.Tensor, net: DeltaShape | Mamba2Shape) -> torch.Tensor:
    """Our (1,H*Dk,1,Dv) state as transformers keeps it, (1,H,Dk,Dv); a Mamba-2 mixer's (1,H*N,1,P)
    as (1,H,P,N)."""
    if isinstance(net, Mamba2Shape):
        return state.reshape(1, net.heads, net.state, net.head_dim).transpose(2, 3)
    return state.reshape(1, net.v_heads, net.dk, net.dv)


def reference_run(cfg, hf, tokens: int, channels: int, **call):
    """transformers' linear-attention decoder layer `hf` over `tokens` random inputs (seed 1) from
    empty states: the inputs, its outputs and its conv and recurrent states after them."""
    from transformers import DynamicCache

    x = torch.randn(1, tokens, channels, generator=torch.Generator().manual_seed(1))
    cache = DynamicCache(config=cfg)
    with torch.no_grad():
        y = hf(x, cache=cache, **call)
    return x, y, (cache.get_conv_state(0, state_idx=0), cache.get_recurrent_state(0, state_idx=0))


def check_chunked_rule(s: int, beta_max: float, span: int = 0) -> None:
    """gated_delta over one window of S tokens (in spans of `span`) from a random state, with beta in
    [0, beta_max], equals transformers' token loop (torch_recurrent_gated_delta_rule)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

    gen = torch.Generator().manual_seed(s)
    gk, r, dk, dv = 2, 3, 16, 8
    q, k = (torch.nn.functional.normalize(torch.randn(1, s, gk, dk, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(1, s, gk * r, dv, generator=gen)
    g = -torch.rand(1, s, gk * r, generator=gen) * 3.0
    beta = beta_max * torch.rand(1, s, gk * r, generator=gen)
    state = torch.randn(1, gk * r, dk, dv, generator=gen)
    o_ref, new_ref = torch_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=state, output_final_state=True)
    o, new = gated_delta((q / dk ** 0.5).permute(2, 0, 3, 1), k.permute(2, 0, 3, 1),
                         v.reshape(1, s, gk, r, dv).permute(2, 3, 4, 1, 0).squeeze(-1),
                         g.reshape(1, s, gk, r).permute(2, 3, 0, 1), beta.reshape(1, s, gk, r).permute(2, 3, 0, 1),
                         state.reshape(gk, r, dk, dv), span)
    torch.testing.assert_close(o.permute(3, 0, 1, 2).reshape(1, s, gk * r, dv), o_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(new.reshape(1, gk * r, dk, dv), new_ref, rtol=1e-4, atol=1e-4)


def check_whole_sequence(module, net: DeltaShape, x, y_ref, conv_ref, state_ref) -> None:
    """The layer over all of `x` (1, T, C) from zero states: transformers' outputs and both its states."""
    conv_state, state = zero_states(net)
    tokens, k = x.shape[1], net.kernel
    with torch.no_grad():
        y, mixed, new = module(channels_first(x), conv_state, state, tokens)
        conv_new = conv_state_after(conv_state, mixed, tokens)
    torch.testing.assert_close(y, channels_first(y_ref), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(carried(new, net), state_ref, rtol=1e-4, atol=1e-4)
    # transformers keeps the last K inputs; the convolution needs only the last K-1 of them
    torch.testing.assert_close(conv_new.reshape(-1, k - 1), conv_ref[0, :, 1:], rtol=1e-5, atol=1e-6)


def check_padded_windows(module, net: DeltaShape, x, y_ref, conv_ref, state_ref, window: int, prefill: int) -> None:
    """Prefill windows of `window` columns over the first `prefill` tokens, the last one padded with
    garbage, then decode the rest one at a time: the real columns equal the whole sequence's and
    both states end at the last real token."""
    xs, channels, k = channels_first(x), x.shape[2], net.kernel
    (conv_state, state), outputs = zero_states(net), []
    with torch.no_grad():
        for start in range(0, prefill, window):
            n = min(window, prefill - start)
            part = torch.cat([xs[..., start:start + n], torch.full((1, channels, 1, window - n), 5.0)], dim=3)
            y, mixed, state = module(part, conv_state, state, n)
            outputs.append(y[..., :n])
            conv_state = conv_state_after(conv_state, mixed, n)
        for t in range(prefill, x.shape[1]):
            y, mixed, state = module(xs[..., t:t + 1], conv_state, state, 1)
            outputs.append(y)
            conv_state = conv_state_after(conv_state, mixed, 1)
    torch.testing.assert_close(torch.cat(outputs, dim=3), channels_first(y_ref), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(carried(state, net), state_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(conv_state.reshape(-1, k - 1), conv_ref[0, :, 1:], rtol=1e-5, atol=1e-6)


def check_fp16_window(module, net: DeltaShape | Mamba2Shape, x, make=None) -> None:
    """The layer over all of `x` in fp16 (the exported precision) stays finite and within 1% of fp32's
    scale (fp16 keeps 11 bits: the residual stream's values near 30 are 0.016 apart). `make` builds an
    empty module of the same kind (default: a DeltaLayer of the module's sizes)."""
    conv_state, state = zero_states(net)
    channels, tokens = x.shape[2], x.shape[1]
    with torch.no_grad():
        y32, _, s32 = module(channels_first(x), conv_state, state, tokens)
        half = (make() if make else DeltaLayer(channels, module.mlp.gate_proj.out_channels, net)).eval()
        half.load_state_dict(module.state_dict())
        y16, _, s16 = half.half()(channels_first(x).half(), conv_state.half(), state.half(), tokens)
    assert torch.isfinite(y16).all() and torch.isfinite(s16).all()
    torch.testing.assert_close(y16.float(), y32, rtol=0, atol=0.01 * y32.abs().max().item())
    torch.testing.assert_close(s16.float(), s32, rtol=0, atol=0.01 * s32.abs().max().item())


def check_mil_builder_on_a_padded_window(module, net: DeltaShape | Mamba2Shape, channels: int, folder, precision: str,
                                         s: int, n: int, builder=None) -> None:
    """delta_layer_mil of the module's weights, converted and run by the MIL executor over a window
    of `s` columns, `n` of them real, from random states (a conv state kept 32 wide): the module's
    outputs, conv state and recurrent state, within 1e-4 (fp32) or 0.03 (fp16). `builder` (g, x,
    conv_state, state, n, s) -> y, mixed, state_new: the MIL builder (default: delta_layer_mil)."""
    ct = pytest.importorskip("coremltools")
    from coremltools.converters.mil import Builder as mb
    from llama_ane.mil import PackageExecutor

    dtype = np.float32 if precision == "fp32" else np.float16
    params = {name: t.numpy().astype(dtype) for name, t in module.state_dict().items()}
    g = Graph(dtype, lambda name: params[name])
    width, types = 32, ct.converters.mil.mil.types
    int32, fp = types.int32, (types.fp32 if precision == "fp32" else types.fp16)

    @mb.program(input_specs=[mb.TensorSpec(shape=(1, channels, 1, s), dtype=fp),
                             mb.TensorSpec(shape=(1, net.conv_channels, 1, width), dtype=fp),
                             mb.TensorSpec(shape=net.state_shape, dtype=fp), mb.TensorSpec(shape=(1,), dtype=int32)],
                opset_version=ct.target.iOS18)
    def prog(x, conv_state, delta_state, n):
        y, mixed, new = (builder(g, x, conv_state, delta_state, n, s) if builder
                         else delta_layer_mil(g, x, conv_state, delta_state, n, "", channels, net, s))
        return y, conv_state_after_mil(g, conv_state, mixed, n, net.kernel, s), new

    convert_to(prog, folder / "delta_layer.mlpackage",
               compute_precision=ct.precision.FLOAT32 if precision == "fp32" else ct.precision.FLOAT16)
    rng = np.random.default_rng(2)
    feeds = {"x": rng.standard_normal((1, channels, 1, s)).astype(dtype),
             "conv_state": rng.standard_normal((1, net.conv_channels, 1, width)).astype(dtype),
             "delta_state": (0.3 * rng.standard_normal(net.state_shape)).astype(dtype), "n": np.array([n], np.int32)}
    got = list(PackageExecutor(folder / "delta_layer.mlpackage", precision=precision).run("main", feeds).values())
    with torch.no_grad():
        t = {name: torch.from_numpy(v.astype(np.float32)) if v.dtype != np.int32 else v for name, v in feeds.items()}
        y, mixed, new = module(t["x"], t["conv_state"], t["delta_state"], n)
        conv_new = conv_state_after(t["conv_state"], mixed, n)
    tol = 1e-4 if precision == "fp32" else 0.03
    np.testing.assert_allclose(got[0][..., :n], y[..., :n].numpy(), rtol=tol, atol=tol)
    np.testing.assert_allclose(got[1], conv_new.numpy(), rtol=tol, atol=tol)
    np.testing.assert_allclose(got[2], new.numpy(), rtol=tol, atol=tol)


# --- an export's carried states -------------------------------------------------------------------

def windows_then_decoding(model, ids: list[int], prompt: int):
    """The model's pipeline after prefilling ids[:prompt] in its windows (the last one padded) and
    decoding the rest one at a time: its caches hold every layer's states after `ids`."""
    pipeline = model.pipeline
    pipeline.reset()
    pipeline.prefill(ids[:prompt])
    for t in ids[prompt:]:
        pipeline.run_window([t])
    return pipeline


def check_mil_states_follow_torch_fp16(out) -> None:
    """The programs' recurrent states after a padded prefill window and decoding (mil, fp16) are the
    torch backend's (fp16) within fp16 rounding."""
    import llama_ane

    ids, states = list(range(7, 47)), {}
    for backend, options in (("mil", {}), ("torch", {"precision": "fp16"})):
        pipeline = llama_ane.load(out, backend=backend, **options).pipeline
        pipeline.reset()
        pipeline.run_window(ids[:20])
        for n in range(20, 30):
            pipeline.run_window(ids[n:n + 1])
        getattr(pipeline.backend, "sync_states", lambda: None)()
        states[backend] = [c["delta"].astype(np.float32) for c in pipeline.cache.caches]
    for mil, torch16 in zip(states["mil"], states["torch"]):
        scale = np.abs(torch16).max()
        assert scale > 0.01
        np.testing.assert_allclose(mil, torch16, rtol=0, atol=0.02 * scale)


def check_prompt_cache_holds_the_states(model, folder) -> None:
    """A prompt-cache file (in `folder`) saves each chunk's states whole: decoding on from the loaded
    file gives the logits of decoding on from the cache it was saved from. `model`: prefill windows of 8."""
    from llama_ane.runtime.kv_cache import load_cache, save_cache

    pipeline, ids = model.pipeline, list(range(5, 19))
    pipeline.reset()
    pipeline.run_window(ids[:8])
    pipeline.run_window(ids[8:13])
    assert all(c["delta"].any() for c in pipeline.cache.caches)
    save_cache(pipeline.cache, model.manifest, folder / "prompt.npz")
    want = pipeline.run_window(ids[13:14])
    pipeline.use(load_cache(folder / "prompt.npz", model.manifest, pipeline.new_cache()))
    np.testing.assert_array_equal(pipeline.run_window(ids[13:14]), want)
