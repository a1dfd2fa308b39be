extension Manifest.ModelConfig {
    /// Every `config` field of the manifests this package runs (docs/manifest.md). Each one is
    /// carried out inside the exported programs (norms, RoPE tables, masks, multipliers), so the
    /// host needs only the sizes; a field outside this list is a setting of a newer exporter whose
    /// effect on the host is unknown, and `Manifest.decode` refuses it by name rather than run the
    /// export wrong. One name a line: tests/test_swift_fixtures.py reads this list.
    public static let knownFields: Set<String> = [
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "rope_theta",
        "rope_scaling",
        "max_position_embeddings",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "model_type",
        "qkv_bias",
        "o_proj_bias",
        "qk_norm",
        "qk_norm_across_heads",
        "post_norms",
        "fused_projections",
        "partial_rotary_factor",
        "sliding_window",
        "sliding_layers",
        "rope_local_theta",
        "hidden_act",
        "sandwich_norms",
        "nope_layers",
        "conv_layers",
        "conv_kernel",
        "conv_bias",
        "embedding_multiplier",
        "residual_multiplier",
        "attention_scale",
        "logits_scaling",
        // Gemma 4's (written only where they differ from their defaults): the norms, scalars, RoPE
        // and softcapping live in the programs; the host reads the per-layer input size, the global
        // layers' widths and the KV-shared layers, which decide what it hands each chunk.
        "value_norm",
        "k_eq_v",
        "per_layer_input_size",
        "per_layer_vocab_size",
        "layer_scalar",
        "final_logit_softcapping",
        "rope_proportion",
        "global_head_dim",
        "global_key_value_heads",
        "kv_shared_layers",
        "double_wide_mlp",
        // Qwen3.5's (written only for its exports): the linear-attention layers, whose conv and
        // recurrent states the host carries (`cache.conv`, `cache.delta`); their heads, widths and
        // output gate live in the programs.
        "delta_layers",
        "delta_key_heads",
        "delta_value_heads",
        "delta_key_dim",
        "delta_value_dim",
        "attn_output_gate",
        // the linear-attention variant (OLMo-Hybrid's): beta's scale and the gated norm's eps live in
        // the programs
        "delta_beta_scale",
        "delta_norm_eps",
        // attention sinks (Granite SWA): a learned logit per query head inside the programs' softmax
        "attention_sinks",
        // a sigmoid gate per query head on attention's output (LFM3), inside the programs
        "attn_head_gate",
    ]

    /// `config` fields of exports this host does not run, each with what it lacks: `Manifest.decode`
    /// refuses a manifest holding one by its name (the exporter writes them only for those exports).
    /// tests/test_swift_fixtures.py reads this list beside `knownFields`.
    public static let refusedFields: [String: String] = [
        "mamba_layers": "Falcon-H1's Mamba-2 mixers beside attention in the same layer",
        "mamba_gate": "Falcon-H1's Mamba-2 mixers beside attention in the same layer",
        "mamba_multipliers": "Falcon-H1's Mamba-2 mixers beside attention in the same layer",
    ]
}
