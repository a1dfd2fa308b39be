"""transformers' own model of the checkpoint's family (Llama, Mistral, Qwen2, Qwen3, ...) run one decoder
layer at a time: the reference logits the parity gate compares with, and the activations
compression is calibrated on.

The arithmetic of `LlamaForCausalLM(input_ids)` (`Qwen2ForCausalLM`, ...) without holding the
model: the embedding lookup, then each of the family's decoder layers built with only its own
weights in float32 (attention "sdpa" with attention_mask=None, which is causal over the whole
sequence, or a sliding layer's windowed mask; cos/sin from the model's rotary embedding, per layer
type where the family has a local one), then the final norm and the (tied or
untied) LM head in blocks of the vocabulary. Memory: one layer's weights, one head block,
activations (T, C). Qwen3.5's linear-attention layers run transformers' token-by-token delta rule
(torch_recurrent_gated_delta_rule), not its chunked one: in float32 the chunked one is an order of
magnitude further from the float64 result (logits 7e-4 apart on a tiny model, against 5e-5).
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Callable, Iterator

import numpy as np

from .checkpoint.loader import Checkpoint
from .checkpoint.mapping import final_norm_name, layer_tensors
from .config import transformers_class

HEAD_BLOCK = 16384  # rows of the LM head multiplied at once: (block, C) in float32


def family_classes(model_type: str):
    """transformers' (DecoderLayer, RMSNorm, RotaryEmbedding) classes of a family, e.g. Qwen2DecoderLayer."""
    return tuple(transformers_class(model_type, part) for part in ("DecoderLayer", "RMSNorm", "RotaryEmbedding"))


def linear_layer_class(model_type: str):
    """transformers' class of a family's linear-attention decoder layers where it is not its DecoderLayer
    (OLMo-Hybrid's OlmoHybridLinearAttentionDecoderLayer), else None."""
    from .families import FAMILIES

    return transformers_class(model_type, "LinearDecoderLayer") if "LinearDecoderLayer" in FAMILIES[
        model_type].classes else None


def _rope_theta(hf):
    """The RoPE base transformers' config `hf` gives its model (None: the model rotates nothing);
    0 where its rope_parameters are per layer type."""
    rope = getattr(hf, "rope_parameters", None) or {}
    return rope.get("rope_theta", 0)


def hf_config(cfg):
    """transformers' config object of `cfg`'s family (LlamaConfig, Qwen2Config, ...), attending with
    torch's sdpa where the family's model does (else its own eager attention: Granite SWA's sinks)."""
    hf = cfg.transformers_config()
    hf._attn_implementation = "sdpa" if transformers_class(cfg.model_type, "PreTrainedModel")._supports_sdpa \
        else "eager"
    return hf


def _with_weights(ckpt: Checkpoint, module, prefix: str, stored=None):
    """`module` (built on the meta device: no random init) given checkpoint tensors `prefix + name`, in
    float32; `stored` (Family.stored_names) names those the checkpoint stores under another name, or
    as parts to concatenate."""
    import torch

    def read(name: str):
        where = (stored or {}).get(name, name)
        parts = [where] if isinstance(where, str) else list(where)
        return torch.cat([ckpt.tensor(prefix + part).to(torch.float32) for part in parts])

    state = {name: read(name).reshape(t.shape) for name, t in module.state_dict().items()}
    module.load_state_dict(state, strict=True, assign=True)
    return module.eval()


def run_layers(ckpt: Checkpoint, token_ids: list[int], *, logits: bool = True,
               on_layer: Callable[[int, object], Callable[[], None]] | None = None):
    """Run `token_ids` (one sequence from position 0) through the checkpoint's layers in float32.

    `on_layer(n, layer)` is called with each decoder layer (`LlamaDecoderLayer`, `Qwen2DecoderLayer`, ...) before it runs and may return a
    function to call after it (e.g. to remove hooks it put on the layer's projections). Returns
    the logits float32 [T, vocab] when `logits`, else the final norm's output [T, C] (`final_outputs`).
    """
    import torch

    hf, (DecoderLayer, _, RotaryEmbedding) = hf_config(ckpt.config), family_classes(ckpt.config.model_type)
    LinearLayer = linear_layer_class(ckpt.config.model_type)
    with torch.no_grad(), recurrent_delta_rule(ckpt.config.model_type):
        ids = torch.tensor(token_ids, dtype=torch.long)
        x = token_rows(ckpt, "model.embed_tokens.weight", ids).to(torch.float32)[None]  # (1, T, C)
        x = x * ckpt.config.embedding_multiplier  # Granite's and Gemma's, in their models' forward
        positions = torch.arange(len(token_ids))[None]  # (1, T)
        if _rope_theta(hf) is None:  # no RoPE at all (OLMo-Hybrid's released models): no cos, sin
            per_type, ropes = False, {None: None}
        else:
            rotary = RotaryEmbedding(config=hf)
            per_type = "layer_type" in inspect.signature(rotary.forward).parameters  # Gemma 3's local RoPE
            rotated = getattr(rotary, "layer_types", hf.layer_types if per_type else ())  # not LFM3's conv layers
            ropes = ({t: rotary(x, positions, layer_type=t) for t in set(hf.layer_types) & set(rotated)} if per_type
                     else {None: rotary(x, positions)})  # cos, sin (1, T, D)
        bases = getattr(hf, "layer_rope_theta", None)  # a RoPE base per layer (Granite SWA; 0: no RoPE)
        if bases is not None:
            ropes = {theta: RotaryEmbedding(config=_with_theta(hf, theta))(x, positions) if theta else None
                     for theta in set(bases)}
        sliding = _sliding_mask(ckpt.config, len(token_ids))
        full = None  # sdpa's own causal attention
        if hf._attn_implementation == "eager":  # eager attention adds its mask to the scores, and has no causal one
            causal = torch.ones(len(token_ids), len(token_ids), dtype=torch.bool).tril()[None, None]
            full, sliding = _additive(causal), _additive(causal if sliding is None else sliding)
        per_layer = _per_layer_inputs(ckpt, hf, ids, x)  # Gemma 4's, (1, T, L, P); None for the others
        shared: dict = {}  # Gemma 4's producers' K/V by layer type, which its KV-shared layers read
        for n in range(hf.num_hidden_layers):
            rope = ropes.get(bases[n] if bases is not None else hf.layer_types[n] if per_type else None)
            mask = sliding if ckpt.config.slides(n) else full
            with torch.device("meta"):
                layer = (LinearLayer or DecoderLayer)(hf, n) if ckpt.config.linear(n) else DecoderLayer(hf, n)
            layer = _with_weights(ckpt, layer, f"model.layers.{n}.", ckpt.config.family.stored_names)
            for path, maker in ckpt.config.family.layer_buffers.items():  # what its model gives each layer
                owner, _, buffer = path.rpartition(".")
                layer.get_submodule(owner).register_buffer(
                    buffer, transformers_class(ckpt.config.model_type, maker)(hf), persistent=False)
            after = on_layer(n, layer) if on_layer is not None else None
            extra = {} if per_layer is None else {"per_layer_input": per_layer[:, :, n], "shared_kv_states": shared}
            x = layer(x, attention_mask=mask, position_ids=positions, position_embeddings=rope, **extra)
            x = x[0] if isinstance(x, tuple) else x  # transformers 4 returns a tuple
            if after is not None:
                after()
            del layer  # before the next layer's weights are read
    return final_outputs(ckpt, x[0], logits=logits)


def _with_theta(hf, theta: float):
    """A copy of transformers' config `hf` whose RoPE base is `theta`."""
    import copy

    out = copy.deepcopy(hf)
    out.rope_parameters = {**hf.rope_parameters, "rope_theta": theta}
    return out


@contextlib.contextmanager
def recurrent_delta_rule(model_type: str) -> Iterator[None]:
    """Within it, transformers' linear-attention layers of `model_type` (Family.delta_rule_module) run the
    delta rule token by token (its reference loop) where they would run the chunked form; nothing
    changes for families without them."""
    from .families import FAMILIES

    name = FAMILIES[model_type].delta_rule_module if model_type in FAMILIES else ""
    if not name:
        yield
        return
    with token_by_token(name):
        yield


@contextlib.contextmanager
def token_by_token(name: str) -> Iterator[None]:
    """Within it, transformers' module `name` runs its torch_recurrent_gated_delta_rule where it would
    run its torch_chunk_gated_delta_rule."""
    import importlib

    modeling = importlib.import_module(name)
    chunked = modeling.torch_chunk_gated_delta_rule
    modeling.torch_chunk_gated_delta_rule = modeling.torch_recurrent_gated_delta_rule
    try:
        yield
    finally:
        modeling.torch_chunk_gated_delta_rule = chunked


def token_rows(ckpt: Checkpoint, hf_name: str, ids):
    """Rows `ids` (T,) of vocabulary matrix `hf_name`, read a row at a time where the format allows
    it: never the whole table (Gemma 4 E2B's per-layer table is 4.7 GB)."""
    import torch

    if ckpt.get_rows is None:
        return ckpt.tensor(hf_name)[ids]
    return torch.cat([ckpt.rows(hf_name, i, i + 1) for i in ids.tolist()])


def _per_layer_inputs(ckpt: Checkpoint, hf, ids, embeds):
    """Gemma 4's per-layer inputs of token `ids` (T,) with embeddings `embeds` (1, T, C), as its
    text model computes them (get_per_layer_inputs, project_per_layer_inputs): (1, T, L, P); None
    for a model without them."""
    import torch

    cfg = ckpt.config
    if not cfg.per_layer_input_size:
        return None
    layers, p = cfg.num_hidden_layers, cfg.per_layer_input_size
    tokens = token_rows(ckpt, "model.embed_tokens_per_layer.weight", ids).to(torch.float32) * p ** 0.5
    projected = embeds @ ckpt.tensor("model.per_layer_model_projection.weight").to(torch.float32).T
    projected = (projected * cfg.hidden_size ** -0.5).reshape(1, len(ids), layers, p)
    norm = transformers_class(cfg.model_type, "RMSNorm")(p, eps=cfg.rms_norm_eps)
    norm = _with_weights(ckpt, norm, "model.per_layer_projection_norm.")
    return (norm(projected) + tokens.reshape(1, len(ids), layers, p)) * 2 ** -0.5


def _sliding_mask(cfg, length: int):
    """The attention mask of a sliding layer over `length` tokens, bool (1, 1, T, T), True where a
    query sees a key: causal and less than sliding_window back; None where the window holds them all
    (the layers' own causal attention is the same)."""
    import torch

    if cfg.sliding_window is None or length <= cfg.sliding_window:
        return None
    i, j = torch.arange(length)[:, None], torch.arange(length)[None, :]
    return ((j <= i) & (i - j < cfg.sliding_window))[None, None]


def _additive(mask):
    """A bool mask (True: seen) as the float one eager attention adds to its scores."""
    import torch

    return torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)


def final_outputs(ckpt: Checkpoint, hidden, *, logits: bool = True) -> np.ndarray:
    """The family's final norm of decoder hidden states `hidden` float32 (T, C) (a torch tensor),
    then, when `logits`, the (tied or untied) LM head in blocks of the vocabulary: float32
    [T, vocab]; else the norm's output [T, C]."""
    import torch

    hf, (_, RMSNorm, _) = hf_config(ckpt.config), family_classes(ckpt.config.model_type)
    with torch.no_grad():
        with torch.device("meta"):
            norm = RMSNorm(hf.hidden_size, eps=ckpt.config.rms_norm_eps)  # read from the family's own field (LFM2: norm_eps)
        h = _with_weights(ckpt, norm, final_norm_name(ckpt.config).removesuffix("weight"))(hidden)  # (T, C)
        if not logits:
            return h.numpy()
        head = ckpt.tensor("model.embed_tokens.weight" if hf.tie_word_embeddings else "lm_head.weight")  # (V, C)
        out = torch.cat([h @ head[s:s + HEAD_BLOCK].to(torch.float32).T for s in range(0, head.shape[0], HEAD_BLOCK)],
                        dim=1)  # (T, V)
        out = out / getattr(hf, "logits_scaling", 1.0)  # Granite's, in its ForCausalLM's forward
        out = out * getattr(hf, "lm_head_multiplier", 1.0)  # Falcon-H1's, in its ForCausalLM's forward
        cap = getattr(hf, "final_logit_softcapping", None)  # Gemma 4's
        if cap is not None:
            out = torch.tanh(out / cap) * cap
    return out.numpy()


def transformers_logits(token_ids: list[int], checkpoint: Checkpoint) -> np.ndarray:
    """float32 logits [T, vocab] of transformers' model of `checkpoint`'s family, one layer at a time."""
    return run_layers(checkpoint, token_ids)


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
# Qwen3.5's linear-attention layers' projections (model.layers.delta_net's names are the checkpoint's); the
# output gates, whose input is q_proj's (Qwen3.5's o_gate, rows of the checkpoint's q_proj; LFM3's g_proj)
DELTA_PROJECTIONS = ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.in_proj_b",
                     "linear_attn.in_proj_a", "linear_attn.out_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
SAME_INPUT = {"q_proj": ("o_gate", "g_proj")}
CONV_PROJECTIONS = ("conv.in_proj", "conv.out_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")  # LFM's conv layers
MAMBA_PROJECTIONS = ("mamba.in_proj", "mamba.out_proj")  # a Mamba-2 mixer's beside attention (Falcon-H1)


def activation_importance(ckpt: Checkpoint, token_ids: list[int],
                          on_found: Callable[[str, np.ndarray], None] | None = None,
                          grams: bool = False) -> dict[str, np.ndarray]:
    """The mean square of each input channel of every projection over `token_ids`: how much an
    error in that column of the weight moves the layer's output (its diagonal part). With
    `grams`, also the whole second-moment matrix of its inputs, X^T X / T (in, in), under KEY + ".gram"
    (what error-compensated LUT codes are chosen against, see quantize.gptq).

    Keys are parameter names as in the exported modules, with the HF layer index: "layers.3.q_proj.weight",
    ..., and "heads" for the LM head (the final norm's output). float32 arrays (in_channels,).
    `on_found(key, array)` is called with each as soon as it is known (layer by layer).
    """
    def found_one(key: str, value: np.ndarray) -> None:
        found[key] = value
        if on_found is not None:
            on_found(key, value)

    import torch

    found: dict[str, np.ndarray] = {}

    def on_layer(n: int, layer) -> Callable[[], None]:
        handles = []
        names = layer_tensors(ckpt.config, n)
        cfg = ckpt.config
        kind = DELTA_PROJECTIONS if cfg.linear(n) else CONV_PROJECTIONS if not cfg.attends(n) else PROJECTIONS
        for name in kind + (MAMBA_PROJECTIONS if cfg.mamba(n) else ()):
            # a fused projection (Phi-3's qkv_proj) is the input of each of its parts
            module = layer.get_submodule(names[f"{name}.weight"].removesuffix(".weight"))
            also = [other for other in SAME_INPUT.get(name, ()) if f"{other}.weight" in names]

            def hook(_module, inputs, _output, keys=[f"layers.{n}.{x}.weight" for x in (name, *also)]):
                x = inputs[0].reshape(-1, inputs[0].shape[-1]).to(torch.float64)
                power = (x * x).mean(0).to(torch.float32).numpy()
                gram = (x.T @ x / x.shape[0]).to(torch.float32).numpy() if grams else None
                for key in keys:
                    found_one(key, power)
                    if grams:
                        found_one(f"{key}.gram", gram)
            handles.append(module.register_forward_hook(hook))
        return lambda: [h.remove() for h in handles]

    h = run_layers(ckpt, token_ids, logits=False, on_layer=on_layer).astype(np.float64)
    found_one("heads", (h * h).mean(0).astype(np.float32))
    if grams:
        found_one("heads.gram", (h.T @ h / h.shape[0]).astype(np.float32))
    return found
