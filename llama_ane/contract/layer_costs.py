"""What each kind of decoder layer costs one step on the device, one class per layer kind: the keys
its queries read, the states it keeps and reads whole, what writing them moves, and the flops of
what it runs besides its weights. `traffic` and `device_model` add these up over an export's
layers; a new layer kind (a file in model/layers/) adds its class here, to `STATE_KINDS` where it
keeps a state of its own and to `WINDOW_KINDS` where its window runs flops besides its weights.

The classes read the manifest only (its config and cache sections, its tensor specs) and import
no torch: `info`, `inspect` and the device model run without it, where the layer files' torch
modules would take longer to import than the rest of the command takes to run.

Weights are costed alike for every kind, 2 flops a weight a token and their stored bytes
(`traffic.weight_read_bytes`): a conv layer's C x kernel taps, a linear-attention layer's
projections, convolution and gated norm among them.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import LlamaConfig
from ..model import names as N
from ..model.functions import BRANCHES, DELTA_BRANCHES, DELTA_NEW, DELTA_STATE, delta_span, squarings

DTYPE_BYTES = {"float16": 2, "float32": 4, "int32": 4}


def nbytes(spec: dict) -> int:
    """Bytes of a tensor spec ({"shape": [...], "dtype": "float16"})."""
    n = 1
    for d in spec["shape"]:
        n *= d
    return n * DTYPE_BYTES[spec["dtype"]]


@dataclass(frozen=True)
class Attention:
    """Softmax attention over a K/V cache (model/layers/attention.py): its K/V are the main caches,
    rings and suffix caches `traffic` counts by name; its flops beyond the weights are 4 per query
    channel per key per token (q.k and p.v, 2 each)."""

    def keys(self, cfg: LlamaConfig, layer: int, attended: int, new: int, ring: int) -> int:
        """The keys a query of decoder layer `layer` reads in a step with `attended` cached
        positions read (the bucket that runs) and `new` of its own (the window, or a cascade's
        suffix): a global layer `attended` + `new`, a sliding layer with a ring of `ring` slots
        (KV-shared layers reading their producer's among them) `ring` + `new` whatever the bucket,
        a layer of another kind none."""
        if not cfg.attends(layer):
            return 0
        return (ring if ring and cfg.slides(layer) else attended) + new

    def flops(self, cfg: LlamaConfig, layer: int, keys: int) -> int:
        """Flops a token of decoder layer `layer` spends attending over `keys` keys, its query
        channels its own (Gemma 4's global layers have wider heads)."""
        return 4 * cfg.at(layer).q_channels * keys


@dataclass(frozen=True)
class ShortConv:
    """LFM2's short convolution (model/layers/short_conv.py), whose state a linear-attention layer's
    convolution shares: the manifest's cache.conv, L_c layers x C channels x W columns, any context.
    Its flops are its weights'."""

    section = "conv"
    states = (N.CONV_STATE, N.CONV_BRANCHES)  # (L_c, C, 1, W), a cascade's per branch (L_c, C, B, W): read whole
    new = N.CONV_NEW  # the window's values (L_c, C, 1, S): the state's write with input caches

    def state_bytes(self, cache: dict) -> int:
        conv = cache.get("conv")
        return len(conv["layers"]) * conv["channels"] * conv["width"] * DTYPE_BYTES[cache["dtype"]] if conv else 0

    def write_bytes(self, spec: dict, tokens: int, kind: str) -> int:
        """Writing a chunk's conv state `spec` (conv_state, or a cascade's conv_branches) in a step
        of `tokens` tokens: with states ("state") the chunk's one-hot write of conv_state, which
        reads and rewrites it whole, as a ring's; otherwise (input caches, and a cascade step's
        conv_branches, inputs with either kind) the chunk's output of the window's values, conv_new
        (L_c, C, 1, `tokens`), from which the host keeps the next state."""
        if kind == "state" and spec["name"] == N.CONV_STATE:
            return 2 * nbytes(spec)
        return spec["shape"][0] * spec["shape"][1] * tokens * DTYPE_BYTES[spec["dtype"]]


@dataclass(frozen=True)
class DeltaNet:
    """The Gated DeltaNet's recurrent states (model/layers/delta_net.py): the manifest's cache.delta,
    L_d layers x H value heads of Dk x Dv, any context; delta_state (L_d, H*Dk, 1, Dv) and a
    cascade's per-branch delta_branches (L_d*B, H*Dk, 1, Dv), read whole every step."""

    section = "delta"
    states = (DELTA_STATE, DELTA_BRANCHES)
    new = DELTA_NEW  # the state after the window, the state's write with input caches

    def state_bytes(self, cache: dict) -> int:
        delta = cache.get("delta")
        return (len(delta["layers"]) * delta["heads"] * delta["key_dim"] * delta["value_dim"]
                * DTYPE_BYTES[cache["dtype"]] if delta else 0)

    def write_bytes(self, spec: dict, tokens: int, kind: str) -> int:
        """Writing a chunk's recurrent state `spec` in a step of any window: the state after the
        window whole, once, with either kind. With input caches (and in a cascade step) that is the
        chunk's output delta_new, which has the state's shape (the manifest's validator holds every
        delta tensor to it), so the other kind's pricing needs no spec of it; with states the chunk
        writes the state it computed from the one it read (counted as a read)."""
        return nbytes(spec)

    def flops(self, manifest: dict, function: str, tokens: int) -> float:
        """Flops of the delta rule in one step of `function` over a window of `tokens`, 2 per
        multiply-add of the matmuls the program runs (delta_net.gated_delta; its elementwise ops,
        O(S^2) or O(Dk*Dv) per head, left out as the attention's softmax is). Per layer, with G key
        heads, H value heads of Dk x Dv and a window of S tokens:

            H*S^2          the decays summed up to each token (G_t)
            H*S^3          their pairwise sums (D_tj), from the decays themselves
            2*G*S^2*Dk     k.k and q.k between the window's tokens
            2*H*S^3 each   of the squarings(S) - 1 steps of the lower-triangular inverse (I+N)(I+N^2)...
            3*H*Dk*Dv*S    the state read against k and q, and the window's k u^T added to it
            2*H*Dv*S^2     the deltas solved, and read out by q

        So a decode step (S = 1) costs 6*H*Dk*Dv + 4*H*Dv + 4*G*Dk + 4*H flops a layer, and a window grows with
        S^3 log2(S). Where the layer runs its window in spans (DeltaShape.span: beta up to 2), each span
        costs this with S its own length. A cascade step ("decode_branches") runs it with S = 1 for each
        of its B branches, each from its own state."""
        layers, sequences, s = _window_steps(manifest, function, tokens, mamba=False)
        if not layers:
            return 0.0
        delta = manifest["cache"]["delta"]
        g = manifest["config"]["delta_key_heads"]
        h, dk, dv = delta["heads"], delta["key_dim"], delta["value_dim"]
        span = delta_span(manifest["config"].get("delta_beta_scale", 1.0)) or s
        macs = sum(h * t * t + h * t ** 3 + 2 * g * t * t * dk + 2 * h * t ** 3 * max(squarings(t) - 1, 0)
                   + 3 * h * dk * dv * t + 2 * h * dv * t * t for t in [min(span, s - a) for a in range(0, s, span)])
        return 2.0 * macs * sequences * layers


@dataclass(frozen=True)
class Mamba2:
    """Falcon-H1's Mamba-2 mixers (model/layers/mamba2.py), beside attention in their layers. They keep
    their states as the Gated DeltaNet's, in cache.delta (its heads x N as Dk, x P as Dv) and the
    conv states, costed by `DeltaNet` and `ShortConv`; what is their own is the SSD form's flops."""

    def flops(self, manifest: dict, function: str, tokens: int) -> float:
        """2 per multiply-add of the SSD form over the step's window (`macs`: it solves nothing,
        unlike the delta rule), per mixer; a cascade step runs it with S = 1 for each branch."""
        layers, sequences, s = _window_steps(manifest, function, tokens, mamba=True)
        if not layers:
            return 0.0
        delta = manifest["cache"]["delta"]
        return 2.0 * self.macs(delta["heads"], manifest["config"]["delta_key_heads"], delta["key_dim"],
                               delta["value_dim"], s) * sequences * layers

    @staticmethod
    def macs(heads: int, groups: int, state: int, head_dim: int, s: int) -> int:
        """Multiply-adds of one mixer's SSD form over a window of S tokens (layers.mamba2.ssd), H heads
        of width P, G groups, state size N: the decays summed up to each token (H S^2) and pairwise
        (H S^3), C.B between the window's tokens (G S^2 N), the state read against C and the window's
        B u^T added to it (2 H N P S), the updates read out (H P S^2)."""
        h, g, n, p = heads, groups, state, head_dim
        return h * s * s + h * s ** 3 + g * s * s * n + 2 * h * n * p * s + h * p * s * s


def _window_steps(manifest: dict, function: str, tokens: int, mamba: bool) -> tuple[int, int, int]:
    """For the layers keeping their states in cache.delta, Mamba-2 mixers (`mamba`) or the delta
    rule's (the others): how many there are, and the sequences and window a step of `function` over
    `tokens` runs each on (a cascade step, "decode_branches", runs S = 1 for each of its branches)."""
    delta = manifest["cache"].get("delta")
    if not delta:
        return 0, 0, 0
    mixers = set(manifest["config"].get("mamba_layers") or [])
    layers = len(set(delta["layers"]) & mixers if mamba else set(delta["layers"]) - mixers)
    sequences, s = (tokens, 1) if function == BRANCHES else (1, tokens)
    return layers, sequences, s


ATTENTION = Attention()
STATE_KINDS = (ShortConv(), DeltaNet())  # the kinds keeping fixed-size states, each in its own cache section
WINDOW_KINDS = (DeltaNet(), Mamba2())  # the kinds whose window runs flops of its own besides the weights
STATES = tuple(name for k in STATE_KINDS for name in k.states)  # their state tensors, read whole every step
STATE_WRITES = tuple(k.new for k in STATE_KINDS)  # the chunks' outputs of them (counted as their writes)


def state_kind(name: str) -> ShortConv | DeltaNet | None:
    """The layer kind whose state tensor is named `name`, or None."""
    return next((k for k in STATE_KINDS if name in k.states), None)
