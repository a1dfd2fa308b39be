"""Decoder building blocks in the ANE layout.

Every activation is channels-first `(B, C, 1, S)`: B = 1, C = channels, S = query length. Projections
are 1x1 `Conv2d` (the ANE's native matmul), attention is computed per head with einsums over the
channel axis, and nothing below uses a dynamic index, a `cond`, or an in-graph `tril`.
"""

from __future__ import annotations

import torch
from torch import nn

MASK_VALUE = -1.0e4  # large negative but finite: -inf turns a fully masked fp16 row into NaN


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


class RMSNorm(nn.Module):
    """RMSNorm over channels that cannot overflow in fp16.

    `x * rsqrt(mean(x^2) + eps)` squares activations that reach thousands in real checkpoints, past
    fp16's 65504. Dividing by `m = max|x|` first keeps every square <= 1, and the identity
    `x * rsqrt(mean(x^2) + eps) = y * rsqrt(mean(y^2) + eps / m^2)` with `y = x / m` leaves the
    result unchanged.

    x: (B, C, 1, S) -> (B, C, 1, S)
    """

    def __init__(self, channels: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inv_m = 1.0 / x.abs().amax(dim=1, keepdim=True).clamp_min(1e-4)
        y = x * inv_m
        var = (y * y).mean(dim=1, keepdim=True) + (self.eps * inv_m) * inv_m
        return y * torch.rsqrt(var) * self.weight.view(1, -1, 1, 1)


def head_norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """RMSNorm of every head over its head_dim channels (Qwen3's q_norm / k_norm), fp16-safe as RMSNorm.

    x: (H, D, S) -> (H, D, S); `norm` has D channels. The heads become the batch axis of the
    (B, C, 1, S) layout, so the norm reduces over D only.
    """
    h, d = x.shape[0], x.shape[1]
    return norm(x.reshape(h, d, 1, -1)).reshape(h, d, -1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, half: int) -> torch.Tensor:
    """Rotary embedding of all heads at once, `x*cos + rotate_half(x)*sin`; `half` = head_dim // 2.

    x: (H, D, S); cos, sin: (1, D, S) -> (H, D, S). Sizes are Python ints, never read off tensors,
    so the traced graph holds no shape arithmetic.
    """
    rotated = torch.cat([-x[:, half:], x[:, :half]], dim=1)
    return x * cos + rotated * sin


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


class MLP(nn.Module):
    """SwiGLU MLP. x: (B, C, 1, S) -> (B, C, 1, S)"""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = conv1x1(hidden, intermediate)
        self.up_proj = conv1x1(hidden, intermediate)
        self.down_proj = conv1x1(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))
