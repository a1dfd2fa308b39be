"""LFM2's short convolution, the operator of its conv layers (and LFM3's), in the ANE layout: the torch module and,
below it, its MIL builder, op for op.

    ShortConv        x (1,C,1,S), conv_state (1,C,1,W) -> y (1,C,1,S), gated (1,C,1,S)
    ConvLayer        the whole decoder layer around it (LFM3's with sandwich norms): x, conv_state
                     -> x_out (1,C,1,S), gated
    ConvLayer.branches  B sequences of one token each (the cascade): x (1,C,1,B), their states
                     (1,C,B,K-1) -> x_out (1,C,1,B), gated (1,C,1,B)
    conv_state_after conv_state (1,C,1,W), gated (1,C,1,S), n -> the next conv_state (1,C,1,W)

C = hidden size, K = the kernel (LFM2's `conv_L_cache`, 3), S = the window. `in_proj` splits into
three gates B, C', x; the depthwise causal convolution runs over `B * x`, and `C' * conv` goes through
`out_proj`. The conv state is what the convolution still needs of the past: the last K-1 values of
`B * x`, zeros before the first token. A window reads the state in front of its own values, so the
convolution is "valid" over K-1+S columns and needs no padding.

A window holds n <= S real tokens (a last prefill window is padded at its end). The causal conv keeps
the padding out of the real columns, but the next state must end at the last real one: column n-1 of
the window, not S-1. `conv_state_after` takes those K-1 columns with a one-hot matmul on n (no
dynamic index), so it runs in the graph (state caches) as well as on the host. The state does not
depend on the context length, and it cannot be rewound: going back means running from the start.

W is the state's width: K-1 values are all the convolution needs, but an export keeps W = K-1
rounded up to the cache multiple (functions.conv_state_width), right-aligned, since the ANE lays
out a state's last axis in such multiples; the modules read its last K-1 columns.

States. A conv layer's state is one row of its chunk's conv_state (L_c,C,1,W), read after the
chunk's other inputs; the window functions return the window's values, conv_new (L_c,C,1,S) (their
specs: chunk._conv_io), and the cascade reads each branch's, conv_branches (L_c,C,B,W), and returns
its token's values. Carried over a window: with input caches the host keeps the state
`conv_state_after` takes from [conv_state, conv_new] at the window's real tokens (the runtime's
Pipeline.carry_states, as a slice); with state caches the chunk writes `conv_state_after_mil` of
them into its state itself, at `window_tokens`.

Costs: `contract.layer_costs.ShortConv` (the states' bytes, read whole every step, and their
write: conv_new, or with states the one-hot write, which reads and rewrites the state). The
projections and the convolution's C x K taps are weights.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from .ops import MLP, Graph, RMSNorm, conv1x1, conv_mil, mb, mlp_mil, rms_norm_mil


class ShortConv(nn.Module):
    """LFM2's `Lfm2ShortConv` over (1, C, 1, S) with its conv state carried outside.

    Parameter names and shapes follow the checkpoint's (`in_proj`, `conv`, `out_proj`), the Linear
    weights as 1x1 convs and the depthwise Conv1d's (C, 1, K) weight as (C, 1, 1, K).
    """

    def __init__(self, channels: int, kernel: int, bias: bool = False):
        super().__init__()
        self.channels, self.kernel = channels, kernel
        self.in_proj = conv1x1(channels, 3 * channels, bias)
        self.conv = nn.Conv2d(channels, channels, kernel_size=(1, kernel), groups=channels, bias=bias)
        self.out_proj = conv1x1(channels, channels, bias)

    def forward(self, x: torch.Tensor, conv_state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: (1,C,1,S); conv_state: (1,C,1,K-1) -> y (1,C,1,S), gated (1,C,1,S), the window's `B * x`
        from which `conv_state_after` takes the next state. With conv_state (1,C,S,K-1), each of
        the S columns is the next token of its own sequence (cascade branches), with its own state."""
        c = self.channels
        conv_state = conv_state[..., conv_state.shape[-1] - (self.kernel - 1):]  # a wider state: its last K-1
        bcx = self.in_proj(x)
        b, gate, v = bcx[:, :c], bcx[:, c:2 * c], bcx[:, 2 * c:]
        gated = b * v
        if conv_state.shape[2] > 1:  # one state per column, each column one token: the window is the row
            b = gated.shape[3]
            conv = self.conv(torch.cat([conv_state.to(gated.dtype), gated.reshape(1, c, b, 1)], dim=3))
            conv = conv.reshape(1, c, 1, b)
        else:
            conv = self.conv(torch.cat([conv_state.to(gated.dtype), gated], dim=3))  # valid: (1,C,1,S)
        return self.out_proj(gate * conv), gated


def short_conv_mil(g: Graph, x, conv_state, prefix: str, channels: int, kernel: int, s: int, bias: bool = False):
    """ShortConv of the parameters under `prefix` ("layers.0.conv."). x: (1,C,1,S); conv_state:
    (1,C,1,K-1) -> y (1,C,1,S), gated (1,C,1,S)"""
    c = channels
    bcx = conv_mil(g, x, f"{prefix}in_proj.weight", f"{prefix}in_proj.bias" if bias else None)
    b, gate, v = (g.slice(bcx, [0, i * c, 0, 0], [1, (i + 1) * c, 1, s]) for i in range(3))
    gated = mb.mul(x=b, y=v)
    rows, width = conv_state.shape[2], conv_state.shape[3]  # rows 1, or S: one sequence per column (ShortConv.forward)
    if width > kernel - 1:  # a wider state: its last K-1 columns
        conv_state = g.slice(conv_state, [0, 0, 0, width - kernel + 1], [1, c, rows, width])
    window = mb.concat(values=[conv_state, gated if rows == 1 else mb.reshape(x=gated, shape=[1, c, s, 1])], axis=3)
    extra = {"bias": g.weight(f"{prefix}conv.bias")} if bias else {}
    conv = mb.conv(x=window, weight=g.weight(f"{prefix}conv.weight"), groups=c, pad_type="valid", **extra)
    conv = conv if rows == 1 else mb.reshape(x=conv, shape=[1, c, 1, s])
    y = conv_mil(g, mb.mul(x=gate, y=conv), f"{prefix}out_proj.weight", f"{prefix}out_proj.bias" if bias else None)
    return y, gated


def conv_state_after(conv_state: torch.Tensor, gated: torch.Tensor, n: torch.Tensor | int) -> torch.Tensor:
    """The conv state after the window's first n (real) tokens: columns n .. n+W-1 of
    [conv_state, gated], picked by a one-hot (W+S, W) matmul. W is the state's width: K-1, or more
    (a state kept wider, its values right-aligned), the last W values either way.

    conv_state: (..., W); gated: (..., S); n: 0 <= n <= S -> (..., W)
    """
    keep, s = conv_state.shape[-1], gated.shape[-1]
    n = torch.as_tensor(n, dtype=torch.int32, device=gated.device).view(1, 1)
    columns = torch.arange(keep + s, dtype=torch.int32, device=gated.device).view(-1, 1)
    onehot = (columns == n + torch.arange(keep, dtype=torch.int32, device=gated.device).view(1, -1))
    window = torch.cat([conv_state.to(gated.dtype), gated], dim=-1)
    return torch.matmul(window, onehot.to(gated.dtype))


def conv_state_after_mil(g: Graph, conv_state, gated, n, kernel: int, s: int):
    """conv_state_after. conv_state: (..., W); gated: (..., S); n: (1,) int32 -> (..., W)"""
    keep = conv_state.shape[-1]
    columns = np.arange(keep + s, dtype=np.int32).reshape(-1, 1)
    onehot = g.cast(mb.equal(x=columns, y=mb.add(x=mb.reshape(x=n, shape=[1, 1]),
                                                 y=np.arange(keep, dtype=np.int32).reshape(1, -1))))
    return mb.matmul(x=mb.concat(values=[conv_state, gated], axis=-1), y=onehot)


class ConvLayer(nn.Module):
    """An LFM2 conv layer: norm, ShortConv, residual, norm, SwiGLU MLP, residual. The norms and the
    MLP take the names of the attention layers' (`input_layernorm`, `post_attention_layernorm`,
    `mlp.*`), so one mapping renames LFM2's `operator_norm`, `ffn_norm` and `feed_forward.w1/w3/w2`
    for both kinds of layer.

    With `sandwich` (LFM3), the ShortConv's and the MLP's outputs are normalized too before their
    residual adds, with the names of DecoderLayer's sandwich norms: `input_layernorm`, ShortConv,
    `post_attention_layernorm`, residual, `pre_feedforward_layernorm`, MLP,
    `post_feedforward_layernorm`, residual."""

    def __init__(self, channels: int, intermediate: int, kernel: int, eps: float, bias: bool = False,
                 sandwich: bool = False):
        super().__init__()
        self.sandwich = sandwich
        self.input_layernorm = RMSNorm(channels, eps)
        self.conv = ShortConv(channels, kernel, bias)
        self.post_attention_layernorm = RMSNorm(channels, eps)
        if sandwich:
            self.pre_feedforward_layernorm = RMSNorm(channels, eps)
            self.post_feedforward_layernorm = RMSNorm(channels, eps)
        self.mlp = MLP(channels, intermediate)

    def forward(self, x: torch.Tensor, conv_state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: (1,C,1,S); conv_state: (1,C,1,K-1) -> x_out (1,C,1,S), gated (1,C,1,S)"""
        y, gated = self.conv(self.input_layernorm(x), conv_state)
        if self.sandwich:
            x = x + self.post_attention_layernorm(y)
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x))), gated
        x = x + y
        return x + self.mlp(self.post_attention_layernorm(x)), gated


def conv_layer_mil(g: Graph, x, conv_state, prefix: str, channels: int, kernel: int, eps: float, s: int,
                   bias: bool = False, sandwich: bool = False):
    """ConvLayer of the parameters under `prefix` ("layers.0."). x: (1,C,1,S); conv_state: (1,C,1,K-1)
    -> x_out (1,C,1,S), gated (1,C,1,S)"""
    norm = lambda v, name: rms_norm_mil(g, v, f"{prefix}{name}.weight", eps, channels)  # noqa: E731
    y, gated = short_conv_mil(g, norm(x, "input_layernorm"), conv_state, f"{prefix}conv.", channels, kernel, s, bias)
    if sandwich:
        x = mb.add(x=x, y=norm(y, "post_attention_layernorm"))
        y = mlp_mil(g, norm(x, "pre_feedforward_layernorm"), f"{prefix}mlp.")
        return mb.add(x=x, y=norm(y, "post_feedforward_layernorm")), gated
    x = mb.add(x=x, y=y)
    return mb.add(x=x, y=mlp_mil(g, norm(x, "post_attention_layernorm"), f"{prefix}mlp.")), gated
