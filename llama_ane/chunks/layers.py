"""Decoder building blocks in the ANE layout.

Every activation is channels-first `(B, C, 1, S)`: B = 1, C = channels, S = query length. Projections
are 1x1 `Conv2d` (the ANE's native matmul), attention is computed per head with einsums over the
channel axis, and nothing below uses a dynamic index, a `cond`, or an in-graph `tril`.
"""

from __future__ import annotations

import torch
from torch import nn

MASK_VALUE = -1.0e4  # large negative but finite: -inf turns a fully masked fp16 row into NaN


def conv1x1(in_channels: int, out_channels: int) -> nn.Conv2d:
    return nn.Conv2d(in_channels, out_channels, kernel_size=1, bias=False)


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


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of one head, `x*cos + rotate_half(x)*sin`.

    x, cos, sin: (B, D, 1, S) -> (B, D, 1, S)
    """
    half = x.shape[1] // 2
    rotated = torch.cat([-x[:, half:], x[:, :half]], dim=1)
    return x * cos + rotated * sin


def attend(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
           mask: torch.Tensor) -> torch.Tensor:
    """Softmax attention of one head over several key blocks (e.g. the cache and the window).

    q: (B, D, 1, S), already scaled by 1/sqrt(D); keys[i], values[i]: (B, D, 1, T_i);
    mask: (B, sum T_i, 1, S) additive, rows in the order of the blocks. -> (B, D, 1, S)
    """
    scores = torch.cat([torch.einsum("bchq,bchk->bkhq", q, k) for k in keys], dim=1) + mask
    p = torch.softmax(scores, dim=1)
    out, start = None, 0
    for v in values:
        part = torch.einsum("bkhq,bchk->bchq", p[:, start:start + v.shape[3]], v)
        out = part if out is None else out + part
        start += v.shape[3]
    return out


def attention_state(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one head as an attention state (v, s), for merging with `merge_states`.

    q: (B, D, 1, S) already scaled by 1/sqrt(D); k, v: (B, D, 1, T); mask: (B, T, 1, S) additive.
    Returns v_out: (B, D, 1, S), the softmax-weighted values, and lse: (B, 1, 1, S), the natural-log
    sum of exp of the masked scores. The max is subtracted before exp, so fp16 cannot overflow.
    """
    scores = torch.einsum("bchq,bchk->bkhq", q, k) + mask
    m = scores.amax(dim=1, keepdim=True)
    p = torch.exp(scores - m)
    denom = p.sum(dim=1, keepdim=True)
    out = torch.einsum("bkhq,bchk->bchq", p, v) / denom
    return out, m + torch.log(denom)


def merge_states(v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor,
                 s_b: torch.Tensor) -> torch.Tensor:
    """The log-sum-exp merge of two attention states over disjoint key sets (values only).

    v_a, v_b: (B, D, 1, S); s_a, s_b: (B, 1, 1, S) natural-log LSE -> (B, D, 1, S)
    """
    m = torch.maximum(s_a, s_b)
    w_a = torch.exp(s_a - m)
    w_b = torch.exp(s_b - m)
    return (v_a * w_a + v_b * w_b) / (w_a + w_b)


class MLP(nn.Module):
    """SwiGLU MLP. x: (B, C, 1, S) -> (B, C, 1, S)"""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = conv1x1(hidden, intermediate)
        self.up_proj = conv1x1(hidden, intermediate)
        self.down_proj = conv1x1(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))
