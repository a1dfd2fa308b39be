"""The Mamba-2 mixer (Falcon-H1's `mamba`, a selective state-space layer) in the ANE layout: the torch module
and, below each piece, its MIL builder, op for op.

    ssd              c, b (G,1,N,S), u (G,R,P,S), a (G,R,1,S), state (G,R,N,P)
                     -> o (G,R,P,S), state after the window (G,R,N,P)
    Mamba2Mixer      x (1,C,1,S), conv_state (1,Q,1,W), state (1,H*N,1,P), n
                     -> y (1,C,1,S), mixed (1,Q,1,S), state_new (1,H*N,1,P)
    n = None         the cascade's branches: S columns, each the next token of its own sequence, with
                     its own states: conv_state (1,Q,S,W), state (S,H*N,1,P) -> state_new (S,H*N,1,P)

C = hidden size; H heads of P channels (I = H*P, transformers' mamba_d_ssm), G groups of B and C
(mamba_n_groups), each serving R = H/G consecutive heads; N the state size (mamba_d_state);
Q = I + 2*G*N, the channels the causal depthwise convolution (kernel K, with a bias) runs over;
S = the window, n <= S its real tokens. The layer: in_proj -> z (I), xBC (Q), dt (H);
xBC -> convolution -> SiLU -> x (I), B (G*N), C (G*N); dt = softplus(dt + dt_bias); per head
    a = -exp(A_log) * dt;  h = exp(a) h + B (x) (dt * x);  y = h^T C + D * x
then y goes through the gate: y * silu(z) (no norm), norm(y) * silu(z) (`gate` "before") or
norm(y * silu(z)) (`gate` "after"), the norm an RMSNorm over each group's I/G channels with one
weight of I; and out_proj. transformers' muP multipliers (its mup_vector over in_proj's rows and
ssm_in_multiplier) are folded into in_proj's rows by the family's mapping, so the layer has none.

The convolution's state is LFM2's (short_conv): the last K-1 values of xBC before the convolution,
kept W wide and right-aligned; `mixed` are the window's values the next state is taken from
(short_conv.conv_state_after, at the window's real tokens).

A window runs the recurrence without a loop over its tokens (the SSD form): with D_tj the sum of
a over tokens j < i <= t, L_tj = exp(D_tj) for j <= t,
    o_t = exp(G_t) h0^T C_t + sum_{j<=t} L_tj (C_t . B_j) dt_j x_j,
    h   = exp(G_S) h0 + sum_j L_Sj B_j (dt_j x_j)^T,
with G_t = D_t,-1, the sum up to t. It is the delta rule's chunked form (delta_net.gated_delta) with
no system to solve: the updates u = dt * x do not read the state. D is summed from the decays
themselves with two triangular 0/1 matrices (delta_net.triangles), every exp is of a sum of
non-positive terms, so nothing overflows in fp16. Padded tokens get dt = 0: a = 0 and u = 0, so they
leave the state as the last real token left it, in the graph, whatever S. Decoding is the same
program over one column.

States. The mixer keeps two, of the shapes the Gated DeltaNet keeps (delta_net), so they carry by
the same rules: its conv state is a row of its chunk's conv_state (L_c,Q,1,W), `mixed` its window
values (conv_new); its recurrent state (per head N x P, transformers' (P x N) transposed) is a row
of delta_state (L_d,H*N,1,P), the state after the window's real tokens coming back whole as
delta_new (the cascade: delta_branches -> delta_new per branch). `Mamba2Shape.as_delta` gives the
DeltaShape of the same states: G key heads of width N, H value heads of width P, Q conv channels.

Costs. `Mamba2Shape.state_bytes` is a layer's recurrent state, read and written whole every step
(as the delta rule's); contract/layer_costs.Mamba2 counts the window's matmuls; the projections,
the convolution and the gate's norm are weights, counted as the device model counts weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ...config import LlamaConfig
from .delta_net import (DeltaShape, columns, columns_mil, decayed_updates, decayed_updates_mil, heads, heads_mil,
                        real_tokens, real_tokens_mil, window_decays, window_decays_mil)
from .ops import Graph, RMSNorm, conv1x1, conv_mil, mb, rms_norm_mil, silu_mil, softplus_mil

GATES = (None, "before", "after")  # no norm; norm then gate (norm_before_gate); gate then norm


@dataclass(frozen=True)
class Mamba2Shape:
    """A Mamba-2 mixer's sizes: H heads of width P, G groups, state size N, the convolution's kernel
    K, the gated norm's eps and where the norm sits (`gate`, one of GATES), and which projections
    have biases."""

    heads: int
    head_dim: int
    groups: int
    state: int
    kernel: int
    eps: float
    gate: str | None = None
    conv_bias: bool = True
    proj_bias: bool = False
    out_bias: bool = False

    @property
    def inner(self) -> int:
        """I = H*P: x's and z's channels."""
        return self.heads * self.head_dim

    @property
    def conv_channels(self) -> int:
        """Q: the channels of xBC, x (I) then B and C (G*N each)."""
        return self.inner + 2 * self.groups * self.state

    @property
    def in_channels(self) -> int:
        """in_proj's rows: z (I), xBC (Q), dt (H)."""
        return self.inner + self.conv_channels + self.heads

    @property
    def state_shape(self) -> tuple[int, int, int, int]:
        """A layer's recurrent state as carried: (1, H*N, 1, P)."""
        return (1, self.heads * self.state, 1, self.head_dim)

    @property
    def as_delta(self) -> DeltaShape:
        """The Gated DeltaNet shape whose states are this mixer's: its conv channels (2*G*N + H*P) and
        its recurrent state (1, H*N, 1, P)."""
        return DeltaShape(self.groups, self.heads, self.state, self.head_dim, self.kernel, self.eps)

    def state_bytes(self, itemsize: int = 2) -> int:
        """The recurrent state's bytes, read and written whole every step."""
        return self.heads * self.state * self.head_dim * itemsize


def mamba_shape(cfg: LlamaConfig) -> Mamba2Shape:
    """The Mamba-2 mixers' sizes of a config (Falcon-H1's: LlamaConfig.mamba_layers)."""
    return Mamba2Shape(cfg.delta_value_heads, cfg.delta_value_dim, cfg.delta_key_heads, cfg.delta_key_dim,
                       cfg.conv_kernel, cfg.rms_norm_eps, cfg.mamba_gate, conv_bias=cfg.conv_bias)


def ssd(c: torch.Tensor, b: torch.Tensor, u: torch.Tensor, a: torch.Tensor,
        state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The selective scan over one window in its SSD form (see the module docstring).

    c, b: (G,1,N,S); u = dt * x: (G,R,P,S); a = dt * A: (G,R,1,S), both 0 at padded tokens;
    state: (G,R,N,P) -> o (G,R,P,S) (without the D skip), the state after the window (G,R,N,P)
    """
    _, cum, decays = window_decays(a)  # the decay summed up to t (G,R,1,S); L_tj (G,R,S,S)
    cb = torch.matmul(c.transpose(2, 3), b)  # (G,1,S,S): C_t . B_j
    return decayed_updates(c, b, u, decays, cb, torch.exp(cum), state)


def ssd_mil(g: Graph, c, b, u, a, state, shape: tuple[int, int, int, int, int], name: str):
    """ssd. c, b: (G,1,N,S); u: (G,R,P,S); a: (G,R,1,S); state: (G,R,N,P); shape: (G, R, N, P, S);
    name: a prefix for its consts -> o (G,R,P,S), state (G,R,N,P)"""
    gk, r, _, _, s = shape
    _, cum, decays = window_decays_mil(g, a, (gk, r, s), name)
    cb = mb.matmul(x=c, y=b, transpose_x=True)  # (G,1,S,S)
    return decayed_updates_mil(g, c, b, u, decays, cb, mb.exp(x=cum), state, (gk, r, s))


class Mamba2Mixer(nn.Module):
    """transformers' FalconH1Mixer (Mamba-2) over (1, C, 1, S) with its conv state and recurrent state
    carried outside, its muP multipliers folded into in_proj. Parameter names follow the checkpoint's;
    the Linear weights are 1x1 convs and the depthwise Conv1d's (Q, 1, K) weight is (Q, 1, 1, K)."""

    def __init__(self, channels: int, net: Mamba2Shape):
        super().__init__()
        self.net = net
        self.in_proj = conv1x1(channels, net.in_channels, net.proj_bias)
        self.conv1d = nn.Conv2d(net.conv_channels, net.conv_channels, kernel_size=(1, net.kernel),
                                groups=net.conv_channels, bias=net.conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(net.heads))
        self.A_log = nn.Parameter(torch.zeros(net.heads))
        self.D = nn.Parameter(torch.ones(net.heads))
        if net.gate is not None:
            self.norm = RMSNorm(net.inner, net.eps)
        self.out_proj = conv1x1(net.inner, channels, net.out_bias)

    def gated(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """The gate and its norm over (1, I, 1, S)."""
        net, s = self.net, y.shape[3]
        gate = nn.functional.silu(z)
        if net.gate is None:
            return y * gate
        if net.gate == "after":
            y = y * gate
        per = net.inner // net.groups
        normed = RMSNorm(per, net.eps, scale=False)(y.reshape(net.groups, per, 1, s)).reshape(1, net.inner, 1, s)
        normed = normed * self.norm.weight.view(1, -1, 1, 1)
        return normed * gate if net.gate == "before" else normed

    def forward(self, x: torch.Tensor, conv_state: torch.Tensor, state: torch.Tensor, n: torch.Tensor | int | None):
        """x: (1,C,1,S); conv_state: (1,Q,1,W); state: (1,H*N,1,P); n: the real tokens
        -> y (1,C,1,S), mixed (1,Q,1,S), the state after the n tokens (1,H*N,1,P).

        With n None, each of the S columns is the next token of its own sequence (cascade
        branches): conv_state (1,Q,S,W) and state (S,H*N,1,P) hold each one's, and the states
        after their token come back (S,H*N,1,P)."""
        net, s, branches = self.net, x.shape[3], n is None
        h, p, gk, ns, i, q_ch = net.heads, net.head_dim, net.groups, net.state, net.inner, net.conv_channels
        r = h // gk
        conv_state = conv_state[..., conv_state.shape[-1] - (net.kernel - 1):].to(x.dtype)
        zxbcdt = self.in_proj(x)  # (1, I+Q+H, 1, S)
        z, mixed, dt = zxbcdt[:, :i], zxbcdt[:, i:i + q_ch], zxbcdt[:, i + q_ch:]
        if branches:  # one sequence per row: the window is the row
            xbc = self.conv1d(torch.cat([conv_state, mixed.reshape(1, -1, s, 1)], dim=3)).reshape(1, -1, 1, s)
        else:
            xbc = self.conv1d(torch.cat([conv_state, mixed], dim=3))
        xbc = nn.functional.silu(xbc)
        xs = xbc[:, :i]  # (1,I,1,S)
        b = heads(xbc[:, i:i + gk * ns], gk, 1, ns, branches)
        c = heads(xbc[:, i + gk * ns:], gk, 1, ns, branches)
        dt = nn.functional.softplus(dt + self.dt_bias.view(1, h, 1, 1))  # (1,H,1,S)
        if not branches:  # padded tokens leave the state as it is
            dt = dt * real_tokens(n, s, x.dtype)
        a = -torch.exp(self.A_log).view(1, h, 1, 1) * dt
        u = xs * dt.repeat_interleave(p, dim=1)  # (1,I,1,S)
        state = state.to(x.dtype).reshape(-1, r, ns, p)  # (G,R,N,P), or (S*G,R,N,P)
        o, new = ssd(c, b, heads(u, gk, r, p, branches), heads(a, gk, r, 1, branches), state)
        y = columns(o, i, s, branches) + xs * self.D.repeat_interleave(p).view(1, i, 1, 1)
        return self.out_proj(self.gated(y, z)), mixed, new.reshape(-1, h * ns, 1, p)


def gated_mil(g: Graph, y, z, prefix: str, net: Mamba2Shape, s: int):
    """Mamba2Mixer.gated. y, z: (1,I,1,S)"""
    gate = silu_mil(g, z)
    if net.gate is None:
        return mb.mul(x=y, y=gate)
    if net.gate == "after":
        y = mb.mul(x=y, y=gate)
    per = net.inner // net.groups
    normed = rms_norm_mil(g, mb.reshape(x=y, shape=[net.groups, per, 1, s]), None, net.eps, per)
    normed = mb.mul(x=mb.reshape(x=normed, shape=[1, net.inner, 1, s]),
                    y=mb.reshape(x=g.weight(f"{prefix}norm.weight"), shape=[1, net.inner, 1, 1]))
    return mb.mul(x=normed, y=gate) if net.gate == "before" else normed


def mamba2_mixer_mil(g: Graph, x, conv_state, state, n, prefix: str, net: Mamba2Shape, s: int):
    """Mamba2Mixer of the parameters under `prefix` ("layers.0.mamba."). x: (1,C,1,S);
    conv_state: (1,Q,1,W); state: (1,H*N,1,P); n: (1,) int32 -> y, mixed, state_new. With n
    None, the cascade's branches: conv_state (1,Q,S,W), state (S,H*N,1,P)."""
    h, p, gk, ns, i, q_ch, kernel = net.heads, net.head_dim, net.groups, net.state, net.inner, net.conv_channels, \
        net.kernel
    r, branches = h // gk, n is None
    rows, width = conv_state.shape[2], conv_state.shape[3]
    if width > kernel - 1:
        conv_state = g.slice(conv_state, [0, 0, 0, width - kernel + 1], [1, q_ch, rows, width])
    zxbcdt = conv_mil(g, x, f"{prefix}in_proj.weight", f"{prefix}in_proj.bias" if net.proj_bias else None)
    z = g.slice(zxbcdt, [0, 0, 0, 0], [1, i, 1, s])
    mixed = g.slice(zxbcdt, [0, i, 0, 0], [1, i + q_ch, 1, s])
    dt = g.slice(zxbcdt, [0, i + q_ch, 0, 0], [1, i + q_ch + h, 1, s])
    window = mb.concat(values=[conv_state, mb.reshape(x=mixed, shape=[1, q_ch, s, 1]) if branches else mixed], axis=3)
    extra = {"bias": g.weight(f"{prefix}conv1d.bias")} if net.conv_bias else {}
    xbc = mb.conv(x=window, weight=g.weight(f"{prefix}conv1d.weight"), groups=q_ch, pad_type="valid", **extra)
    xbc = silu_mil(g, mb.reshape(x=xbc, shape=[1, q_ch, 1, s]) if branches else xbc)
    xs = g.slice(xbc, [0, 0, 0, 0], [1, i, 1, s])
    b = heads_mil(g.slice(xbc, [0, i, 0, 0], [1, i + gk * ns, 1, s]), gk, 1, ns, s, branches)
    c = heads_mil(g.slice(xbc, [0, i + gk * ns, 0, 0], [1, q_ch, 1, s]), gk, 1, ns, s, branches)
    dt = softplus_mil(g, mb.add(x=dt, y=mb.reshape(x=g.weight(f"{prefix}dt_bias"), shape=[1, h, 1, 1])))
    if not branches:
        dt = mb.mul(x=dt, y=real_tokens_mil(g, n, s))
    rate = mb.mul(x=mb.exp(x=mb.reshape(x=g.weight(f"{prefix}A_log"), shape=[1, h, 1, 1])), y=g.scalar(-1.0))
    a = mb.mul(x=rate, y=dt)
    u = mb.mul(x=mb.reshape(x=xs, shape=[1, h, p, s]), y=mb.reshape(x=dt, shape=[1, h, 1, s]))
    batch = s * gk if branches else gk
    o, new = ssd_mil(g, c, b, heads_mil(mb.reshape(x=u, shape=[1, i, 1, s]), gk, r, p, s, branches),
                     heads_mil(a, gk, r, 1, s, branches), mb.reshape(x=state, shape=[batch, r, ns, p]),
                     (batch, r, ns, p, 1 if branches else s), prefix.replace(".", "_"))
    skip = mb.mul(x=mb.reshape(x=xs, shape=[1, h, p, s]), y=mb.reshape(x=g.weight(f"{prefix}D"), shape=[1, h, 1, 1]))
    y = mb.add(x=columns_mil(o, i, s, branches), y=mb.reshape(x=skip, shape=[1, i, 1, s]))
    z_gated = gated_mil(g, y, z, prefix, net, s)
    out = conv_mil(g, z_gated, f"{prefix}out_proj.weight", f"{prefix}out_proj.bias" if net.out_bias else None)
    return out, mixed, mb.reshape(x=new, shape=[s if branches else 1, h * ns, 1, p])
