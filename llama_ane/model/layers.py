"""Decoder building blocks in the ANE layout: each torch piece (the reference) and, right below it,
its twin written with coremltools' MIL builder (named `*_mil`), op for op.

Every activation is channels-first `(B, C, 1, S)`: B = 1, C = channels, S = query length. Projections
are 1x1 `Conv2d` (the ANE's native matmul), attention is computed per head with einsums over the
channel axis, and nothing below uses a dynamic index, a `cond`, or an in-graph `tril`.

The MIL builders take and return MIL vars in the layouts the torch pieces use; sizes are Python
ints, so every shape is static. Building MIL directly instead of tracing the torch modules lets the
exporter read every weight once, straight from the checkpoint in the export dtype, and share it
between the functions of a package (see `Graph.weight`). coremltools is imported when a builder
first runs, so the torch-only runtime never loads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from ..precision import precision_of

MASK_VALUE = -1.0e4  # large negative but finite: -inf turns a fully masked fp16 row into NaN

Weights = Callable[[str], np.ndarray]  # our parameter name -> array in the export dtype


class _Builder:
    """coremltools' MIL `Builder`, imported on first use: `mb.conv(...)` as in coremltools' own code."""

    def __getattr__(self, name: str) -> Any:
        from coremltools.converters.mil import Builder

        value = getattr(Builder, name)
        setattr(self, name, value)
        return value


mb = _Builder()


@dataclass
class Graph:
    """What every MIL builder needs: the float dtype of the program and where its weights come from.

    `weight(name)` makes a const of parameter `name` whose blob entry is shared by every function
    of the package that uses the same name: its `weight_id` is the name. Each weight is read once
    for all functions (`value`); the exporter's subclass stores some compressed instead.
    """

    dtype: type  # np.float16 or np.float32
    weights: Weights
    _values: dict[str, Any] = field(default_factory=dict)

    def scalar(self, value: float):
        return self.dtype(value)

    def const(self, value: np.ndarray, name: str):
        return mb.const(val=np.asarray(value, self.dtype), name=name)

    def value(self, name: str) -> Any:
        """Parameter `name` as stored in the program, read (and made) once."""
        if name not in self._values:
            self._values[name] = self.load(name)
        return self._values[name]

    def load(self, name: str) -> Any:
        return self.weights(name)

    def weight(self, name: str):
        var = mb.const(val=self.value(name), name=name.replace(".", "_"))
        var.op.weight_id = name
        return var

    def slice(self, x, begin: list[int], end: list[int]):
        return mb.slice_by_index(x=x, begin=np.array(begin, np.int32), end=np.array(end, np.int32))

    def cast(self, x):
        """`x` (bool or int) as the program's float dtype."""
        return mb.cast(x=x, dtype=precision_of(self.dtype).mil)


class Conv1x1(nn.Conv2d):
    """A 1x1 Conv2d over (1, C_in, 1, S) -> (1, C_out, 1, S): the ANE's matmul (with `bias`, plus a
    per-channel bias: Qwen2's q/k/v projections).

    Traced for export it is a conv. Run eagerly (the torch backend), the same weights go through
    `linear`, which torch's CPU kernels run up to 4x faster than a 1x1 conv at the small S of
    (branch) decoding. The arithmetic is the same matrix product.
    """

    def __init__(self, in_channels: int, out_channels: int, bias: bool = False):
        super().__init__(in_channels, out_channels, kernel_size=1, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.jit.is_tracing() or x.shape[0] != 1 or x.shape[2] != 1:
            return super().forward(x)
        c, s = x.shape[1], x.shape[3]
        y = nn.functional.linear(x.reshape(c, s).t(), self.weight.reshape(self.out_channels, c), self.bias)  # (S, C_out)
        return y.t().reshape(1, self.out_channels, 1, s)


def conv1x1(in_channels: int, out_channels: int, bias: bool = False) -> Conv1x1:
    return Conv1x1(in_channels, out_channels, bias)


def conv_mil(g: Graph, x, weight: str, bias: str | None = None):
    """1x1 conv (Conv1x1), with the conv's own per-channel `bias` where the projection has one
    (Qwen2's q/k/v). x: (1, C_in, 1, S) -> (1, C_out, 1, S)"""
    if bias is None:
        return mb.conv(x=x, weight=g.weight(weight))
    return mb.conv(x=x, weight=g.weight(weight), bias=g.weight(bias))


class RMSNorm(nn.Module):
    """RMSNorm over channels that cannot overflow in fp16.

    `x * rsqrt(mean(x^2) + eps)` squares activations that reach thousands in real checkpoints, past
    fp16's 65504. Dividing by `m = max|x|` first keeps every square <= 1, and the identity
    `x * rsqrt(mean(x^2) + eps) = y * rsqrt(mean(y^2) + eps / m^2)` with `y = x / m` leaves the
    result unchanged. The eps term is computed as `(sqrt(eps) / m)^2`: an eps scaled down with its
    stream (LlamaConfig.stream_eps) is below fp16's range, its square root is not, so an all-zero
    input still gets a positive variance rather than 0 * inf.

    x: (B, C, 1, S) -> (B, C, 1, S). Without `scale` it has no weight (Gemma 4's norm of v).
    """

    def __init__(self, channels: int, eps: float, scale: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels)) if scale else None
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inv_m = 1.0 / x.abs().amax(dim=1, keepdim=True).clamp_min(1e-4)
        y = x * inv_m
        root = inv_m * self.eps ** 0.5
        var = (y * y).mean(dim=1, keepdim=True) + root * root
        y = y * torch.rsqrt(var)
        return y if self.weight is None else y * self.weight.view(1, -1, 1, 1)


def rms_norm_mil(g: Graph, x, weight: str | None, eps: float, channels: int):
    """RMSNorm (with no weight where `weight` is None), pre-scaled by 1/max|x| in the same way.
    x: (B, C, 1, S) -> (B, C, 1, S)"""
    m = mb.maximum(x=mb.reduce_max(x=mb.abs(x=x), axes=[1], keep_dims=True), y=g.scalar(1e-4))
    inv_m = mb.inverse(x=m)
    y = mb.mul(x=x, y=inv_m)
    root = mb.mul(x=inv_m, y=g.scalar(eps ** 0.5))
    var = mb.add(x=mb.reduce_mean(x=mb.mul(x=y, y=y), axes=[1], keep_dims=True), y=mb.mul(x=root, y=root))
    w = None if weight is None else mb.reshape(x=g.weight(weight), shape=[1, channels, 1, 1])
    y = mb.mul(x=y, y=mb.rsqrt(x=var))
    return y if w is None else mb.mul(x=y, y=w)


def head_norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """RMSNorm of every head over its head_dim channels (Qwen3's q_norm / k_norm), fp16-safe as RMSNorm.

    x: (H, D, S) -> (H, D, S); `norm` has D channels. The heads become the batch axis of the
    (B, C, 1, S) layout, so the norm reduces over D only.
    """
    h, d = x.shape[0], x.shape[1]
    return norm(x.reshape(h, d, 1, -1)).reshape(h, d, -1)


def head_norm_mil(g: Graph, x, weight: str | None, eps: float, heads: int, d: int, s: int):
    """head_norm. x: (H, D, S) -> (H, D, S)"""
    y = rms_norm_mil(g, mb.reshape(x=x, shape=[heads, d, 1, s]), weight, eps, d)
    return mb.reshape(x=y, shape=[heads, d, s])


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, half: int, rest: int = 0) -> torch.Tensor:
    """Rotary embedding of all heads at once, `x*cos + rotate_half(x)*sin`; `half` = rotary_dim // 2.

    x: (H, D, S); cos, sin: (1, D, S) -> (H, D, S). With partial rotary (Phi-3), the last `rest`
    channels of a head pass unrotated: their cos is 1 and their sin 0 in the tables, so they stay
    as they are. Sizes are Python ints, never read off tensors, so the traced graph holds no shape
    arithmetic.
    """
    rotated = torch.cat([-x[:, half:2 * half], x[:, :half]] + ([x[:, 2 * half:]] if rest else []), dim=1)
    return x * cos + rotated * sin


def apply_rope_mil(g: Graph, x, cos, sin, heads: int, d: int, s: int, rotary_dim: int | None = None):
    """apply_rope of the first `rotary_dim` channels (default: all). x: (H, D, S); cos, sin: (1, D, S) -> (H, D, S)"""
    rot = d if rotary_dim is None else rotary_dim
    half = rot // 2
    upper = g.slice(x, [0, half, 0], [heads, rot, s])
    lower = g.slice(x, [0, 0, 0], [heads, half, s])
    rest = [g.slice(x, [0, rot, 0], [heads, d, s])] if rot < d else []
    rotated = mb.concat(values=[mb.mul(x=upper, y=g.scalar(-1.0)), lower] + rest, axis=1)
    return mb.add(x=mb.mul(x=x, y=cos), y=mb.mul(x=rotated, y=sin))


def activation(x: torch.Tensor, act: str) -> torch.Tensor:
    """The MLP's gate activation: "silu" (SwiGLU) or "gelu_pytorch_tanh" (GeGLU, Gemma)."""
    return nn.functional.silu(x) if act == "silu" else nn.functional.gelu(x, approximate="tanh")


def activation_mil(g: Graph, x, act: str):
    """activation."""
    return silu_mil(g, x) if act == "silu" else mb.gelu(x=x, mode="TANH_APPROXIMATION")


def silu_mil(g: Graph, x):
    """silu(x) written as 0.5 x (1 + tanh(x / 2)), the same function (tanh(x/2) = 2 sigmoid(x) - 1):
    the Neural Engine's own silu is reported ~1e-3 off near 0, about 12% of a small activation.
    In fp16 it gives 0 below about -9, where silu is smaller than 1.2e-3. Programs are saved with
    no graph passes, so nothing fuses it back into a silu op."""
    half = mb.mul(x=x, y=g.scalar(0.5))
    return mb.mul(x=half, y=mb.add(x=mb.tanh(x=half), y=g.scalar(1.0)))


def softplus_mil(g: Graph, x):
    """softplus(x) written as max(x, 0) + log(1 + exp(-|x|)), the same function with no exp to
    overflow: the Neural Engine's fp16 softplus is reported to collapse to 0 above ~10.4. In fp16,
    1 + exp(-|x|) keeps exp(-|x|) to 2^-11, so values below ~5e-4 (x below about -7.6) come out
    within 5e-4 of theirs."""
    tail = mb.exp(x=mb.mul(x=mb.abs(x=x), y=g.scalar(-1.0)))
    return mb.add(x=mb.relu(x=x), y=mb.log(x=mb.add(x=tail, y=g.scalar(1.0))))


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(x / cap) (Gemma 4's final logits), or x where `cap` is None."""
    return x if cap is None else torch.tanh(x / cap) * cap


def softcap_mil(g: Graph, x, cap: float | None):
    """softcap."""
    return x if cap is None else mb.mul(x=mb.tanh(x=mb.mul(x=x, y=g.scalar(1.0 / cap))), y=g.scalar(cap))


class MLP(nn.Module):
    """Gated MLP, SwiGLU or GeGLU (`act`). x: (B, C, 1, S) -> (B, C, 1, S)"""

    def __init__(self, hidden: int, intermediate: int, act: str = "silu"):
        super().__init__()
        self.act = act
        self.gate_proj = conv1x1(hidden, intermediate)
        self.up_proj = conv1x1(hidden, intermediate)
        self.down_proj = conv1x1(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(activation(self.gate_proj(x), self.act) * self.up_proj(x))


def mlp_mil(g: Graph, x, prefix: str, act: str = "silu"):
    """MLP of the parameters under `prefix` ("layers.0.mlp."). x: (1, C, 1, S) -> (1, C, 1, S)"""
    gate = activation_mil(g, conv_mil(g, x, f"{prefix}gate_proj.weight"), act)
    up = conv_mil(g, x, f"{prefix}up_proj.weight")
    return conv_mil(g, mb.mul(x=gate, y=up), f"{prefix}down_proj.weight")


GROUPED_ROWS = 64  # up to this many query rows (R x S), one matmul per kv head (see grouped_attention)


def grouped_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_win: torch.Tensor,
                      v_win: torch.Tensor, mask: torch.Tensor, group: int, cache_length: int) -> torch.Tensor:
    """Softmax attention of all heads over the cache and the current window, grouped for GQA.

    q: (G, R, D, S): R = `group` query heads per kv head, already scaled by 1/sqrt(D);
    k_cache, v_cache: (G, D, T) with T = `cache_length`; k_win, v_win: (G, D, S);
    mask: (1, 1, S, T + S) additive, cache columns first. -> (G, R, D, S).

    The cache is neither transposed nor concatenated: the scores are, and the probabilities are
    split again at T. The exported programs multiply with a broadcast batch dim (G, R); run
    eagerly, torch would copy each kv head R times for that, so a small window (R x S up to
    `GROUPED_ROWS` query rows: decoding, verify windows) stacks its R heads' rows instead: per kv
    head one (R*S, D) x (D, T) product for the scores and one (R*S, T) x (T, D) for the values,
    each reading the cache once (the values as the right-hand side: BLAS runs the few rows of a
    verify window faster that way round than as (D, T) x (T, R*S)). Larger windows (prefill)
    keep the broadcast form, which spreads better over threads. Same arithmetic either way.
    """
    g, r, d, s = q.shape
    if torch.jit.is_tracing() or r * s > GROUPED_ROWS:
        qt = q.transpose(2, 3)  # (G, R, S, D)
        kc, vc, kw, vw = (x.unsqueeze(1) for x in (k_cache, v_cache, k_win, v_win))  # (G, 1, D, *)
        scores = torch.cat([torch.matmul(qt, kc), torch.matmul(qt, kw)], dim=3) + mask  # (G, R, S, T+S)
        p = torch.softmax(scores, dim=3)
        return (torch.matmul(vc, p[..., :cache_length].transpose(2, 3))
                + torch.matmul(vw, p[..., cache_length:].transpose(2, 3)))
    rows = q.transpose(2, 3).reshape(g, r * s, d)  # (G, R*S, D)
    scores = torch.cat([torch.bmm(rows, k_cache), torch.bmm(rows, k_win)], dim=2).view(g, r, s, -1) + mask
    p = torch.softmax(scores, dim=3).view(g, r * s, -1)  # (G, R*S, T+S)
    out = torch.bmm(p[..., :cache_length], v_cache.transpose(1, 2))  # (G, R*S, D)
    out = out.baddbmm_(p[..., cache_length:], v_win.transpose(1, 2))
    return out.view(g, r, s, d).transpose(2, 3)


def grouped_attention_mil(g: Graph, q, kc, vc, kw, vw, mask, t: int, s: int, shape_gr: tuple[int, int]):
    """grouped_attention in its broadcast form.

    q: (G,R,D,S); kc, vc: (G,1,D,T); kw, vw: (G,1,D,S); mask: (1,1,S,T+S) -> (G,R,D,S)
    """
    gk, r = shape_gr
    scores = mb.concat(values=[mb.matmul(x=q, y=kc, transpose_x=True), mb.matmul(x=q, y=kw, transpose_x=True)],
                       axis=3)  # (G,R,S,T+S)
    p = mb.softmax(x=mb.add(x=scores, y=mask), axis=3)
    p_cache = g.slice(p, [0, 0, 0, 0], [gk, r, s, t])
    p_win = g.slice(p, [0, 0, 0, t], [gk, r, s, t + s])
    return mb.add(x=mb.matmul(x=vc, y=p_cache, transpose_y=True), y=mb.matmul(x=vw, y=p_win, transpose_y=True))


# The cascade's attention (chunk.BranchChunk): B branch queries attend to one shared prefix and
# each to its own suffix, and the two attention states are merged with the log-sum-exp operator:
#     v = (v_p * e^(s_p - m) + v_s * e^(s_s - m)) / (e^(s_p - m) + e^(s_s - m)),  m = max(s_p, s_s)


def prefix_state(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor):
    """Attention state of all queries over the shared prefix.

    q: (G,R,D,B) scaled; k, v: (G,D,T); mask: (1,1,1,T) -> v_p (G,R,D,B), s_p (G,R,1,B) (natural log)
    """
    scores = torch.matmul(q.transpose(2, 3), k.unsqueeze(1)) + mask  # (G,R,B,T): one read of k for all B
    m = scores.amax(dim=3, keepdim=True)
    p = torch.exp(scores - m)
    denom = p.sum(dim=3, keepdim=True)  # (G,R,B,1)
    out = torch.matmul(v.unsqueeze(1), p.transpose(2, 3)) / denom.transpose(2, 3)
    return out, (m + torch.log(denom)).transpose(2, 3)


def _softmax_state_mil(scores, axis_len_axis: int = 3):
    """exp(scores - max) and its max and sum over the last axis (keep_dims)."""
    m = mb.reduce_max(x=scores, axes=[axis_len_axis], keep_dims=True)
    p = mb.exp(x=mb.sub(x=scores, y=m))
    return p, m, mb.reduce_sum(x=p, axes=[axis_len_axis], keep_dims=True)


def prefix_state_mil(q, k, v, mask):
    """prefix_state. q: (G,R,D,B); k, v: (G,1,D,T); mask: (1,1,1,T) -> v_p (G,R,D,B), s_p (G,R,1,B)"""
    p, m, denom = _softmax_state_mil(mb.add(x=mb.matmul(x=q, y=k, transpose_x=True), y=mask))  # (G,R,B,T)
    out = mb.real_div(x=mb.matmul(x=v, y=p, transpose_y=True), y=mb.transpose(x=denom, perm=[0, 1, 3, 2]))
    return out, mb.transpose(x=mb.add(x=m, y=mb.log(x=denom)), perm=[0, 1, 3, 2])


def suffix_state(q: torch.Tensor, k_suffix: torch.Tensor, v_suffix: torch.Tensor, k_self: torch.Tensor,
                 v_self: torch.Tensor, mask: torch.Tensor, suffix_length: int):
    """Attention state of each branch's query over its own suffix cache and its own new key.

    q: (G,R,D,B) scaled; k_suffix, v_suffix: (G,B,D,U); k_self, v_self: (G,D,B);
    mask: (1,B,1,U+1), the last column for the new key itself -> v_s (G,R,D,B), s_s (G,R,1,B)
    """
    qb = q.permute(0, 3, 1, 2)  # (G,B,R,D)
    ks = k_self.transpose(1, 2).unsqueeze(3)  # (G,B,D,1)
    vs = v_self.transpose(1, 2).unsqueeze(3)
    scores = torch.cat([torch.matmul(qb, k_suffix), torch.matmul(qb, ks)], dim=3) + mask  # (G,B,R,U+1)
    m = scores.amax(dim=3, keepdim=True)
    p = torch.exp(scores - m)
    denom = p.sum(dim=3, keepdim=True)  # (G,B,R,1)
    out = (torch.matmul(v_suffix, p[..., :suffix_length].transpose(2, 3))
           + torch.matmul(vs, p[..., suffix_length:].transpose(2, 3)))  # (G,B,D,R)
    out = out / denom.transpose(2, 3)
    return out.permute(0, 3, 2, 1), (m + torch.log(denom)).permute(0, 2, 3, 1)


def suffix_state_mil(g: Graph, q, k_suffix, v_suffix, k_self, v_self, mask, gr: tuple[int, int], b: int, u: int):
    """suffix_state. q: (G,R,D,B); k_suffix, v_suffix: (G,B,D,U); k_self, v_self: (G,D,B);
    mask: (1,B,1,U+1) -> v_s (G,R,D,B), s_s (G,R,1,B)
    """
    gk, r = gr
    qb = mb.transpose(x=q, perm=[0, 3, 1, 2])  # (G,B,R,D)
    ks = mb.expand_dims(x=mb.transpose(x=k_self, perm=[0, 2, 1]), axes=[3])  # (G,B,D,1)
    vs = mb.expand_dims(x=mb.transpose(x=v_self, perm=[0, 2, 1]), axes=[3])
    scores = mb.concat(values=[mb.matmul(x=qb, y=k_suffix), mb.matmul(x=qb, y=ks)], axis=3)  # (G,B,R,U+1)
    p, m, denom = _softmax_state_mil(mb.add(x=scores, y=mask))
    out = mb.add(x=mb.matmul(x=v_suffix, y=g.slice(p, [0, 0, 0, 0], [gk, b, r, u]), transpose_y=True),
                 y=mb.matmul(x=vs, y=g.slice(p, [0, 0, 0, u], [gk, b, r, u + 1]), transpose_y=True))  # (G,B,D,R)
    out = mb.real_div(x=out, y=mb.transpose(x=denom, perm=[0, 1, 3, 2]))
    return (mb.transpose(x=out, perm=[0, 3, 2, 1]),
            mb.transpose(x=mb.add(x=m, y=mb.log(x=denom)), perm=[0, 2, 3, 1]))


def merge_states(v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor) -> torch.Tensor:
    """The log-sum-exp merge of two attention states over disjoint key sets.

    v_a, v_b: (..., D, B); s_a, s_b: (..., 1, B) natural-log LSE -> (..., D, B)
    """
    m = torch.maximum(s_a, s_b)
    w_a = torch.exp(s_a - m)
    w_b = torch.exp(s_b - m)
    return (v_a * w_a + v_b * w_b) / (w_a + w_b)


def merge_states_mil(v_a, s_a, v_b, s_b):
    """merge_states."""
    m = mb.maximum(x=s_a, y=s_b)
    w_a = mb.exp(x=mb.sub(x=s_a, y=m))
    w_b = mb.exp(x=mb.sub(x=s_b, y=m))
    return mb.real_div(x=mb.add(x=mb.mul(x=v_a, y=w_a), y=mb.mul(x=v_b, y=w_b)), y=mb.add(x=w_a, y=w_b))


def stack_mil(vars_: list):
    """Per-layer (1,KV,1,S) vars as one (L,KV,1,S)."""
    return vars_[0] if len(vars_) == 1 else mb.concat(values=vars_, axis=0)
