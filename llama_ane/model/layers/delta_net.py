"""Qwen3.5's and OLMo-Hybrid's linear-attention layers (Gated DeltaNet) in the ANE layout: the torch module and, below
each piece, its MIL builder, op for op.

    gated_delta      q, k (G,1,Dk,S), v (G,R,Dv,S), g, beta (G,R,1,S), state (G,R,Dk,Dv)
                     -> o (G,R,Dv,S), state after the window (G,R,Dk,Dv)
    GatedDeltaNet    x (1,C,1,S), conv_state (1,Q,1,W), state (1,H*Dk,1,Dv), n
                     -> y (1,C,1,S), mixed (1,Q,1,S), state_new (1,H*Dk,1,Dv)
    DeltaLayer       the decoder layer around it: norm, GatedDeltaNet, residual, norm, MLP, residual
    n = None         the cascade's branches: S columns, each the next token of its own sequence, with
                     its own states: conv_state (1,Q,S,W), state (S,H*Dk,1,Dv) -> state_new (S,H*Dk,1,Dv)

C = hidden size; G key heads, R value heads per key head, H = G*R value heads; Dk, Dv their widths;
Q = 2*G*Dk + H*Dv, the channels of in_proj_qkv that the causal depthwise convolution runs over;
S = the window, n <= S its real tokens. The layer: in_proj_qkv -> convolution (kernel K, SiLU) ->
q, k, v; q and k l2-normalized per head, q also scaled by 1/sqrt(Dk); beta = sigmoid(in_proj_b)
(times DeltaShape.beta_scale: OLMo-Hybrid's 2, beta in [0, 2]), the decay
g = -exp(A_log) * softplus(in_proj_a + dt_bias); per value head the state (Dk x Dv) goes
    S = S * exp(g);  S += k (x) beta * (v - S^T k);  o = S^T q
and o goes through a norm gated by silu(in_proj_z) (per value head, over Dv; its eps
DeltaShape.gate_eps) and out_proj. Key heads serve R consecutive value heads (transformers repeats
them; here they broadcast). OLMo-Hybrid's layer is this one: its q, k and v projections are the
rows of in_proj_qkv, its gate projection in_proj_z (its family names them).

The convolution's state is LFM2's (short_conv): the last K-1 values of in_proj_qkv's output, kept
W wide and right-aligned, and `mixed` are the window's values the next state is taken from
(short_conv.conv_state_after, at the window's real tokens).

A window runs the recurrence without a loop over its tokens (the chunked form of the delta rule).
With G_t the decay summed up to token t and D_tj = G_t - G_j, the deltas u_t = beta_t * (v_t - S_{t-1}'^T k_t)
solve a lower-triangular system
    (I + A) U^T = B^T,   A_tj = beta_t exp(D_tj) (k_t . k_j) for j < t,   B_t = beta_t (v_t - exp(G_t) S0^T k_t),
whose inverse, A being strictly lower triangular (N = -A nilpotent), is (I+N)(I+N^2)(I+N^4)...: log2(S)
squarings. Then o_t = exp(G_t) S0^T q_t + sum_{j<=t} exp(D_tj) (q_t . k_j) u_j, and the state after
the window is exp(G_S) S0 + sum_j exp(D_Sj) k_j u_j^T. D is summed from the decays themselves
(L @ (g * M), two triangular 0/1 matrices), not taken as G_t - G_j: in fp16 the difference of two
large sums would lose the small D that matter. A window's padded tokens get beta = 0 and g = 0,
so they leave the state as the last real token left it: the state returned is the state after n
tokens, in the graph, whatever S. Decoding (S = 1) is the same program with one token.

States. A linear-attention layer keeps two. Its conv state is one row of its chunk's conv_state
(L_c,Q,1,W), beside the conv layers', with `mixed` as its window values (conv_new), carried as
short_conv's. Its recurrent state is one row of delta_state (L_d,H*Dk,1,Dv)
(`DeltaShape.state_shape`), read last, with window_tokens where the caches are inputs (their specs:
chunk._delta_io). The state after the window's real tokens comes back whole as delta_new and is
carried as it is: the host keeps it (input caches), or the chunk writes it into its state. The
cascade reads each branch's, delta_branches (L_d*B,H*Dk,1,Dv), and returns them after its token as
delta_new. Neither state depends on the context length.

Costs: `contract.layer_costs.DeltaNet` (the recurrent states' bytes, read and written whole every
step, and the delta rule's matmuls, `gated_delta`'s inverse taking `squarings` steps); the conv
state is costed as the conv layers' (`ShortConv`). The projections, the convolution and the gated
norm are weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from ...config import LlamaConfig
from ..functions import DELTA_BRANCHES, DELTA_NEW, DELTA_STATE, squarings  # noqa: F401 (the layer's names)
from ..functions import SPAN, delta_span  # noqa: F401 (SPAN: the span's length, for its tests)
from .ops import MLP, Graph, RMSNorm, conv1x1, conv_mil, mb, mlp_mil, rms_norm_mil, silu_mil, softplus_mil

L2_EPS = 1e-6  # transformers' l2norm (the FLA kernels' eps)
# A chunk's linear-attention layers' recurrent states (L_d, H*Dk, 1, Dv), and the states after its
# window it returns (with state caches, writes); the cascade's per-branch states (L_d*B, H*Dk, 1, Dv)


def triangles(s: int) -> tuple[np.ndarray, np.ndarray]:
    """(S,S) 0/1 matrices: `lower` [j <= t] and `strict` [j < t] (row t, column j)."""
    t, j = np.arange(s).reshape(-1, 1), np.arange(s).reshape(1, -1)
    return (j <= t).astype(np.float32), (j < t).astype(np.float32)


def l2_normed(x: torch.Tensor, heads: int, d: int) -> torch.Tensor:
    """x / |x| per head of d channels, fp16-safe. x: (1, heads*d, 1, S) -> (heads, d, 1, S).

    x * rsqrt(sum(x^2) + eps) = rmsnorm(x, eps/d) / sqrt(d), and RMSNorm pre-scales by max|x|.
    """
    return RMSNorm(d, L2_EPS / d, scale=False)(x.reshape(heads, d, 1, -1)) * d ** -0.5


def l2_normed_mil(g: Graph, x, heads: int, d: int, s: int):
    """l2_normed. x: (1, heads*d, 1, S) -> (heads, d, 1, S)"""
    y = rms_norm_mil(g, mb.reshape(x=x, shape=[heads, d, 1, s]), None, L2_EPS / d, d)
    return mb.mul(x=y, y=g.scalar(d ** -0.5))


def gated_delta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                state: torch.Tensor, span: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over one window, chunked (see the module docstring); with `span`, over
    consecutive spans of that many tokens, each from the state the one before left (DeltaShape.span).

    q, k: (G,1,Dk,S), q already scaled; v: (G,R,Dv,S); g, beta: (G,R,1,S), both 0 at padded tokens;
    state: (G,R,Dk,Dv) -> o (G,R,Dv,S), the state after the window (G,R,Dk,Dv)
    """
    s, dtype = q.shape[-1], q.dtype
    if span and s > span:
        outs = []
        for a in range(0, s, span):
            o, state = gated_delta(*(t[..., a:a + span] for t in (q, k, v, g, beta)), state)
            outs.append(o)
        return torch.cat(outs, dim=3), state
    strict, cum, decays = window_decays(g)
    kk = torch.matmul(k.transpose(2, 3), k)  # (G,1,S,S): k_t . k_j
    qk = torch.matmul(q.transpose(2, 3), k)  # (G,1,S,S): q_t . k_j
    n = -(beta.transpose(2, 3) * decays * kk * strict)  # (G,R,S,S): -A
    inverse, power = torch.eye(s, dtype=dtype) + n, n
    for _ in range(squarings(s) - 1):
        power = torch.matmul(power, power)
        inverse = inverse + torch.matmul(inverse, power)
    grown = torch.exp(cum)  # (G,R,1,S)
    b = beta * (v - grown * torch.matmul(state.transpose(2, 3), k))  # (G,R,Dv,S)
    u = torch.matmul(b, inverse.transpose(2, 3))  # (G,R,Dv,S): the deltas
    return decayed_updates(q, k, u, decays, qk, grown, state)


def window_decays(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A window's decays g (...,1,S) as the chunked forms read them: the strict triangle (S,S), the
    decay summed up to each token G_t (...,1,S) and exp(D_tj) for j <= t (...,S,S), D summed from
    the decays themselves (see the module docstring)."""
    lower, strict = (torch.from_numpy(m).to(g.dtype) for m in triangles(g.shape[-1]))
    cum = torch.matmul(g, lower.t())  # (G,R,1,S): G_t
    decays = torch.exp(torch.matmul(lower, g.transpose(2, 3) * strict)) * lower  # (G,R,S,S): exp(D_tj), j <= t
    return strict, cum, decays


def decayed_updates(q, k, u, decays, qk, grown, state) -> tuple[torch.Tensor, torch.Tensor]:
    """The outputs and the state after a window of updates u (G,R,Dv,S) written at keys k (G,1,Dk,S)
    and read at q (G,1,Dk,S), qk = q_t . k_j (G,1,S,S), under the decays (window_decays) with
    grown = exp(G_t) (G,R,1,S), from state (G,R,Dk,Dv) -> o (G,R,Dv,S), state (G,R,Dk,Dv)"""
    s = q.shape[-1]
    o = grown * torch.matmul(state.transpose(2, 3), q) + torch.matmul(u, (decays * qk).transpose(2, 3))
    last = decays[..., s - 1:, :]  # (G,R,1,S): exp(D_Sj)
    new = grown[..., s - 1:] * state + torch.matmul(k * last, u.transpose(2, 3))  # (G,R,Dk,Dv)
    return o, new


def gated_delta_mil(g: Graph, q, k, v, decay, beta, state, shape: tuple[int, int, int, int, int], name: str,
                    span: int = 0):
    """gated_delta. q, k: (G,1,Dk,S); v: (G,R,Dv,S); decay, beta: (G,R,1,S); state: (G,R,Dk,Dv);
    shape: (G, R, Dk, Dv, S); name: a prefix for its consts -> o (G,R,Dv,S), state (G,R,Dk,Dv)"""
    gk, r, dk, dv, s = shape
    if span and s > span:
        outs = []
        for a in range(0, s, span):
            e = min(a + span, s)
            part = [g.slice(t, [0, 0, 0, a], [gk, rows, width, e])
                    for t, rows, width in ((q, 1, dk), (k, 1, dk), (v, r, dv), (decay, r, 1), (beta, r, 1))]
            o, state = gated_delta_mil(g, *part, state, (gk, r, dk, dv, e - a), f"{name}span{a}_")
            outs.append(o)
        return mb.concat(values=outs, axis=3), state
    strict_c, cum, decays = window_decays_mil(g, decay, (gk, r, s), name)
    kk = mb.matmul(x=k, y=k, transpose_x=True)  # (G,1,S,S)
    qk = mb.matmul(x=q, y=k, transpose_x=True)
    a = mb.mul(x=mb.mul(x=mb.mul(x=mb.reshape(x=beta, shape=[gk, r, s, 1]), y=decays), y=kk), y=strict_c)
    n = mb.mul(x=a, y=g.scalar(-1.0))
    inverse, power = mb.add(x=n, y=g.const(np.eye(s), f"{name}eye")), n
    for _ in range(squarings(s) - 1):
        power = mb.matmul(x=power, y=power)
        inverse = mb.add(x=inverse, y=mb.matmul(x=inverse, y=power))
    grown = mb.exp(x=cum)
    b = mb.mul(x=beta, y=mb.sub(x=v, y=mb.mul(x=grown, y=mb.matmul(x=state, y=k, transpose_x=True))))
    u = mb.matmul(x=b, y=inverse, transpose_y=True)
    return decayed_updates_mil(g, q, k, u, decays, qk, grown, state, (gk, r, s))


def window_decays_mil(g: Graph, decay, shape: tuple[int, int, int], name: str):
    """window_decays. decay: (G,R,1,S); shape: (G, R, S); name: a prefix for its consts
    -> the strict triangle (a const), G_t (G,R,1,S), exp(D_tj) (G,R,S,S)"""
    gk, r, s = shape
    lower, strict = triangles(s)
    lower_c, strict_c = g.const(lower, f"{name}lower"), g.const(strict, f"{name}strict")
    cum = mb.matmul(x=decay, y=g.const(lower.T, f"{name}upper"))
    d = mb.matmul(x=lower_c, y=mb.mul(x=mb.reshape(x=decay, shape=[gk, r, s, 1]), y=strict_c))
    return strict_c, cum, mb.mul(x=mb.exp(x=d), y=lower_c)


def decayed_updates_mil(g: Graph, q, k, u, decays, qk, grown, state, shape: tuple[int, int, int]):
    """decayed_updates. shape: (G, R, S)"""
    gk, r, s = shape
    o = mb.add(x=mb.mul(x=grown, y=mb.matmul(x=state, y=q, transpose_x=True)),
               y=mb.matmul(x=u, y=mb.mul(x=decays, y=qk), transpose_y=True))
    last = g.slice(decays, [0, 0, s - 1, 0], [gk, r, s, s])
    grown_last = g.slice(grown, [0, 0, 0, s - 1], [gk, r, 1, s])
    new = mb.add(x=mb.mul(x=grown_last, y=state), y=mb.matmul(x=mb.mul(x=k, y=last), y=u, transpose_y=True))
    return o, new


def real_tokens(n: torch.Tensor | int, s: int, dtype: torch.dtype) -> torch.Tensor:
    """(1,1,1,S): 1 at the window's first n columns, 0 at its padding."""
    n = torch.as_tensor(n, dtype=torch.int32).view(1, 1, 1, 1)
    return (torch.arange(s, dtype=torch.int32).view(1, 1, 1, s) < n).to(dtype)


def real_tokens_mil(g: Graph, n, s: int):
    """real_tokens. n: (1,) int32 -> (1,1,1,S)"""
    return g.cast(mb.less(x=np.arange(s, dtype=np.int32).reshape(1, 1, 1, s), y=mb.reshape(x=n, shape=[1, 1, 1, 1])))


@dataclass(frozen=True)
class DeltaShape:
    """A linear-attention layer's sizes: G key heads, H value heads, their widths Dk and Dv, the
    convolution's kernel K and the norms' eps."""

    k_heads: int
    v_heads: int
    dk: int
    dv: int
    kernel: int
    eps: float
    beta_scale: float = 1.0  # beta = beta_scale * sigmoid(in_proj_b): OLMo-Hybrid's 2, for beta in [0, 2]
    norm_eps: float | None = None  # the gated norm's eps, where not `eps` (OLMo-Hybrid's 1e-5)

    @property
    def span(self) -> int:
        """Tokens per span of the chunked delta rule (gated_delta; 0: a window is one span). With beta
        up to 2 the entries of N (-A) reach 2 in size, and the inverse's powers N^(2^i) over a whole
        window grow past fp16's range (65504) long before their sum settles (the tiny OLMo-Hybrid
        test checkpoint's fp16 logits held NaN), and in range they still cancel away fp16's
        precision. In spans of SPAN = 4 tokens the only power taken, N^2, stays within 2^2 * 2 = 8,
        and the fp16 rule stays within 1% of the token loop where whole windows and spans of 8 do
        not (tests/test_olmo_hybrid.py, keys that nearly agree)."""
        return delta_span(self.beta_scale)

    @property
    def gate_eps(self) -> float:
        """The eps of the norm gated by silu(in_proj_z)."""
        return self.eps if self.norm_eps is None else self.norm_eps

    @property
    def conv_channels(self) -> int:
        """Q: the channels of in_proj_qkv, q and k (G*Dk each) then v (H*Dv)."""
        return 2 * self.k_heads * self.dk + self.v_heads * self.dv

    @property
    def state_shape(self) -> tuple[int, int, int, int]:
        """A layer's recurrent state as carried: (1, H*Dk, 1, Dv)."""
        return (1, self.v_heads * self.dk, 1, self.dv)


def heads(t: torch.Tensor, groups: int, per: int, width: int, branches: bool) -> torch.Tensor:
    """(1, groups*per*width, 1, S) as the delta rule reads it: (groups, per, width, S) over a window;
    with `branches` (each column its own sequence, one token each) (S*groups, per, width, 1)."""
    s = t.shape[3]
    if not branches:
        return t.reshape(groups, per, width, s)
    return t.reshape(-1, s).t().reshape(s * groups, per, width, 1)


def heads_mil(t, groups: int, per: int, width: int, s: int, branches: bool):
    """heads."""
    if not branches:
        return mb.reshape(x=t, shape=[groups, per, width, s])
    return mb.reshape(x=mb.transpose(x=mb.reshape(x=t, shape=[-1, s]), perm=[1, 0]), shape=[s * groups, per, width, 1])


def columns(o: torch.Tensor, channels: int, s: int, branches: bool) -> torch.Tensor:
    """The inverse of `heads`: -> (1, channels, 1, S)."""
    return o.reshape(s, channels).t().reshape(1, channels, 1, s) if branches else o.reshape(1, channels, 1, s)


def columns_mil(o, channels: int, s: int, branches: bool):
    """columns."""
    if not branches:
        return mb.reshape(x=o, shape=[1, channels, 1, s])
    return mb.reshape(x=mb.transpose(x=mb.reshape(x=o, shape=[s, channels]), perm=[1, 0]), shape=[1, channels, 1, s])


def delta_shape(cfg: LlamaConfig) -> DeltaShape:
    """The linear-attention layers' sizes of a config, and their variant (beta's scale, the gated norm's eps)."""
    return DeltaShape(cfg.delta_key_heads, cfg.delta_value_heads, cfg.delta_key_dim, cfg.delta_value_dim,
                      cfg.conv_kernel, cfg.rms_norm_eps, cfg.delta_beta_scale, cfg.delta_norm_eps)


def delta_rows(cfg: LlamaConfig, layers: list[int]) -> list[int]:
    """The chunk-local indices of the layers with a recurrent state among decoder layers `layers` (the
    linear-attention layers, and Falcon-H1's Mamba-2 mixers, whose states are of the same shapes):
    their rows in the chunk's recurrent states."""
    return [i for i, n in enumerate(layers) if cfg.recurrent(n)]


class GatedDeltaNet(nn.Module):
    """transformers' Qwen3_5GatedDeltaNet over (1, C, 1, S) with its conv state and recurrent state
    carried outside. Parameter names follow the checkpoint's; the Linear weights are 1x1 convs and
    the depthwise Conv1d's (Q, 1, K) weight is (Q, 1, 1, K)."""

    def __init__(self, channels: int, net: DeltaShape):
        super().__init__()
        self.net = net
        k_heads, v_heads, dv, kernel = net.k_heads, net.v_heads, net.dv, net.kernel
        self.conv_channels = net.conv_channels
        self.in_proj_qkv = conv1x1(channels, self.conv_channels)
        self.in_proj_z = conv1x1(channels, v_heads * dv)
        self.in_proj_b = conv1x1(channels, v_heads)
        self.in_proj_a = conv1x1(channels, v_heads)
        self.conv1d = nn.Conv2d(self.conv_channels, self.conv_channels, kernel_size=(1, kernel),
                                groups=self.conv_channels, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(v_heads))
        self.A_log = nn.Parameter(torch.zeros(v_heads))
        self.norm = RMSNorm(dv, net.gate_eps)
        self.out_proj = conv1x1(v_heads * dv, channels)

    def forward(self, x: torch.Tensor, conv_state: torch.Tensor, state: torch.Tensor, n: torch.Tensor | int | None):
        """x: (1,C,1,S); conv_state: (1,Q,1,W); state: (1,H*Dk,1,Dv); n: the real tokens
        -> y (1,C,1,S), mixed (1,Q,1,S), the state after the n tokens (1,H*Dk,1,Dv).

        With n None, each of the S columns is the next token of its own sequence (cascade
        branches): conv_state (1,Q,S,W) and state (S,H*Dk,1,Dv) hold each one's, and the states
        after their token come back (S,H*Dk,1,Dv)."""
        net, s, branches = self.net, x.shape[3], n is None
        gk, h, dk, dv = net.k_heads, net.v_heads, net.dk, net.dv
        r, keys = h // gk, gk * dk
        conv_state = conv_state[..., conv_state.shape[-1] - (net.kernel - 1):].to(x.dtype)
        mixed = self.in_proj_qkv(x)  # (1,Q,1,S)
        if branches:  # one sequence per row: the window is the row
            qkv = self.conv1d(torch.cat([conv_state, mixed.reshape(1, -1, s, 1)], dim=3)).reshape(1, -1, 1, s)
        else:
            qkv = self.conv1d(torch.cat([conv_state, mixed], dim=3))
        qkv = nn.functional.silu(qkv)
        q = heads(l2_normed(qkv[:, :keys], gk, dk).reshape(1, keys, 1, s), gk, 1, dk, branches) * dk ** -0.5
        k = heads(l2_normed(qkv[:, keys:2 * keys], gk, dk).reshape(1, keys, 1, s), gk, 1, dk, branches)
        v = heads(qkv[:, 2 * keys:], gk, r, dv, branches)
        beta = torch.sigmoid(self.in_proj_b(x))
        if net.beta_scale != 1.0:
            beta = beta * net.beta_scale
        decay = -torch.exp(self.A_log).view(1, h, 1, 1) * nn.functional.softplus(
            self.in_proj_a(x) + self.dt_bias.view(1, h, 1, 1))
        if not branches:  # padded tokens leave the state as it is
            real = real_tokens(n, s, x.dtype)
            beta, decay = beta * real, decay * real
        state = state.to(x.dtype).reshape(-1, r, dk, dv)  # (G,R,Dk,Dv), or (S*G,R,Dk,Dv)
        o, new = gated_delta(q, k, v, heads(decay, gk, r, 1, branches), heads(beta, gk, r, 1, branches), state,
                             net.span)
        z = self.in_proj_z(x).reshape(h, dv, 1, s)
        o = self.norm(columns(o, h * dv, s, branches).reshape(h, dv, 1, s)) * nn.functional.silu(z)
        return self.out_proj(o.reshape(1, h * dv, 1, s)), mixed, new.reshape(-1, h * dk, 1, dv)


def gated_delta_net_mil(g: Graph, x, conv_state, state, n, prefix: str, net: DeltaShape, s: int):
    """GatedDeltaNet of the parameters under `prefix` ("layers.0.linear_attn."). x: (1,C,1,S);
    conv_state: (1,Q,1,W); state: (1,H*Dk,1,Dv); n: (1,) int32 -> y, mixed, state_new. With n
    None, the cascade's branches: conv_state (1,Q,S,W), state (S,H*Dk,1,Dv)."""
    gk, h, dk, dv, kernel = net.k_heads, net.v_heads, net.dk, net.dv, net.kernel
    r, keys, q_ch, branches = h // gk, gk * dk, net.conv_channels, n is None
    rows, width = conv_state.shape[2], conv_state.shape[3]
    if width > kernel - 1:
        conv_state = g.slice(conv_state, [0, 0, 0, width - kernel + 1], [1, q_ch, rows, width])
    mixed = conv_mil(g, x, f"{prefix}in_proj_qkv.weight")
    window = mb.concat(values=[conv_state, mb.reshape(x=mixed, shape=[1, q_ch, s, 1]) if branches else mixed], axis=3)
    qkv = mb.conv(x=window, weight=g.weight(f"{prefix}conv1d.weight"), groups=q_ch, pad_type="valid")
    qkv = silu_mil(g, mb.reshape(x=qkv, shape=[1, q_ch, 1, s]) if branches else qkv)
    q = l2_normed_mil(g, g.slice(qkv, [0, 0, 0, 0], [1, keys, 1, s]), gk, dk, s)
    q = mb.mul(x=heads_mil(mb.reshape(x=q, shape=[1, keys, 1, s]), gk, 1, dk, s, branches), y=g.scalar(dk ** -0.5))
    k = l2_normed_mil(g, g.slice(qkv, [0, keys, 0, 0], [1, 2 * keys, 1, s]), gk, dk, s)
    k = heads_mil(mb.reshape(x=k, shape=[1, keys, 1, s]), gk, 1, dk, s, branches)
    v = heads_mil(g.slice(qkv, [0, 2 * keys, 0, 0], [1, q_ch, 1, s]), gk, r, dv, s, branches)
    beta = mb.sigmoid(x=conv_mil(g, x, f"{prefix}in_proj_b.weight"))
    if net.beta_scale != 1.0:
        beta = mb.mul(x=beta, y=g.scalar(net.beta_scale))
    a = mb.add(x=conv_mil(g, x, f"{prefix}in_proj_a.weight"),
               y=mb.reshape(x=g.weight(f"{prefix}dt_bias"), shape=[1, h, 1, 1]))
    rate = mb.mul(x=mb.exp(x=mb.reshape(x=g.weight(f"{prefix}A_log"), shape=[1, h, 1, 1])), y=g.scalar(-1.0))
    decay = mb.mul(x=rate, y=softplus_mil(g, a))
    if not branches:
        real = real_tokens_mil(g, n, s)
        beta, decay = mb.mul(x=beta, y=real), mb.mul(x=decay, y=real)
    batch = s * gk if branches else gk
    o, new = gated_delta_mil(g, q, k, v, heads_mil(decay, gk, r, 1, s, branches), heads_mil(beta, gk, r, 1, s, branches),
                             mb.reshape(x=state, shape=[batch, r, dk, dv]), (batch, r, dk, dv, 1 if branches else s),
                             prefix.replace(".", "_"), net.span)
    z = mb.reshape(x=conv_mil(g, x, f"{prefix}in_proj_z.weight"), shape=[h, dv, 1, s])
    o = mb.reshape(x=columns_mil(o, h * dv, s, branches), shape=[h, dv, 1, s])
    o = mb.mul(x=rms_norm_mil(g, o, f"{prefix}norm.weight", net.gate_eps, dv), y=silu_mil(g, z))
    y = conv_mil(g, mb.reshape(x=o, shape=[1, h * dv, 1, s]), f"{prefix}out_proj.weight")
    return y, mixed, mb.reshape(x=new, shape=[s if branches else 1, h * dk, 1, dv])


class DeltaLayer(nn.Module):
    """A Qwen3.5 linear-attention decoder layer: norm, GatedDeltaNet, residual, norm, SwiGLU MLP,
    residual. The norms hold (1 + w), as the checkpoint mapping stores Qwen3.5's."""

    def __init__(self, channels: int, intermediate: int, net: DeltaShape):
        super().__init__()
        self.input_layernorm = RMSNorm(channels, net.eps)
        self.linear_attn = GatedDeltaNet(channels, net)
        self.post_attention_layernorm = RMSNorm(channels, net.eps)
        self.mlp = MLP(channels, intermediate)

    def forward(self, x: torch.Tensor, conv_state: torch.Tensor, state: torch.Tensor, n: torch.Tensor | int | None):
        """x: (1,C,1,S); conv_state: (1,Q,1,W); state: (1,H*Dk,1,Dv) -> x_out (1,C,1,S), mixed, state_new
        (n None: the cascade's branches, as GatedDeltaNet.forward)"""
        y, mixed, new = self.linear_attn(self.input_layernorm(x), conv_state, state, n)
        x = x + y
        return x + self.mlp(self.post_attention_layernorm(x)), mixed, new


def delta_layer_mil(g: Graph, x, conv_state, state, n, prefix: str, channels: int, net: DeltaShape, s: int):
    """DeltaLayer of the parameters under `prefix` ("layers.0."). -> x_out, mixed, state_new"""
    h = rms_norm_mil(g, x, f"{prefix}input_layernorm.weight", net.eps, channels)
    y, mixed, new = gated_delta_net_mil(g, h, conv_state, state, n, f"{prefix}linear_attn.", net, s)
    x = mb.add(x=x, y=y)
    h = rms_norm_mil(g, x, f"{prefix}post_attention_layernorm.weight", net.eps, channels)
    return mb.add(x=x, y=mlp_mil(g, h, f"{prefix}mlp.")), mixed, new
