"""The ops every layer kind is built from: the MIL builder's helper (`Graph`, `mb`), 1x1 projections,
the fp16-safe RMSNorm, RoPE, the activations, the gated MLP. Each torch piece (the reference) has,
right below it, its twin written with coremltools' MIL builder (named `*_mil`), op for op.

Every activation is channels-first `(B, C, 1, S)`: B = 1, C = channels, S = query length. Projections
are 1x1 `Conv2d` (the ANE's native matmul), and nothing below uses a dynamic index, a `cond`, or an
in-graph `tril`.

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

from ...precision import precision_of

Weights = Callable[[str], np.ndarray]  # our parameter name -> array in the export dtype


def with_state(make: Callable[[], nn.Module], state: dict[str, torch.Tensor]) -> nn.Module:
    """`make()` built on the meta device and given `state`'s tensors as its parameters.

    Nothing is initialised at random only to be overwritten, so building a model costs one copy
    of its weights, not two (a chunk of an 8B model is gigabytes in fp32). Only for modules whose
    every tensor is in the state dict (no buffers): strict loading checks the names.
    """
    with torch.device("meta"):
        module = make()
    module.load_state_dict(state, strict=True, assign=True)
    return module


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
    u = 1 + t (t = exp(-|x|)) keeps t only to 2^-11, and log(u) alone was up to 5e-4 off (7% of
    softplus(-5)); log(1 + t) is taken as log(u) + (t - (u - 1)) / u, the part of t that rounding
    dropped added back (u - 1 is exact), so small values keep fp16's relative precision down to
    fp16's subnormals. (A Gated DeltaNet's decay is exp(A_log) times it, so its error grows into the
    layer's state: with log(u) alone the tiny OLMo-Hybrid's fp16 programs drifted from torch's fp16
    several times further than with this form.)"""
    tail = mb.exp(x=mb.mul(x=mb.abs(x=x), y=g.scalar(-1.0)))
    u = mb.add(x=tail, y=g.scalar(1.0))
    lost = mb.sub(x=tail, y=mb.sub(x=u, y=g.scalar(1.0)))  # what rounding 1 + tail to u dropped
    return mb.add(x=mb.relu(x=x), y=mb.add(x=mb.log(x=u), y=mb.real_div(x=lost, y=u)))


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


def stack_mil(vars_: list):
    """Per-layer (1,KV,1,S) vars as one (L,KV,1,S)."""
    return vars_[0] if len(vars_) == 1 else mb.concat(values=vars_, axis=0)
