"""Decoder layers in the ANE layout, one file per layer kind: `attention` (grouped softmax attention
over a K/V cache, the cascade's attention states, the Llama-family decoder layer), `short_conv`
(LFM2's short convolution), `delta_net` (Qwen3.5's Gated DeltaNet) and `mamba2` (Falcon-H1's
Mamba-2 mixer), built from the shared ops in `ops`. Each file names the torch module and its MIL
builder, the states the layer keeps and how they carry over a window, and where its costs are
counted (`contract.layer_costs`, which imports no torch). The shared ops and the attention
operators are importable from here."""

from .attention import (GROUPED_ROWS, MASK_VALUE, grouped_attention, grouped_attention_mil, merge_states,
                        merge_states_mil, prefix_state, prefix_state_mil, suffix_state, suffix_state_mil)
from .ops import (MLP, Conv1x1, Graph, RMSNorm, Weights, activation, activation_mil, apply_rope, apply_rope_mil,
                  conv1x1, conv_mil, head_norm, head_norm_mil, mb, mlp_mil, rms_norm_mil, silu_mil, softcap,
                  softcap_mil, softplus_mil, stack_mil, with_state)

__all__ = ["GROUPED_ROWS", "MASK_VALUE", "MLP", "Conv1x1", "Graph", "RMSNorm", "Weights", "activation",
           "activation_mil", "apply_rope", "apply_rope_mil", "conv1x1", "conv_mil", "grouped_attention",
           "grouped_attention_mil", "head_norm", "head_norm_mil", "mb", "merge_states", "merge_states_mil",
           "mlp_mil", "prefix_state", "prefix_state_mil", "rms_norm_mil", "silu_mil", "softcap", "softcap_mil",
           "softplus_mil", "stack_mil", "suffix_state", "suffix_state_mil", "with_state"]
