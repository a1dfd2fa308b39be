/// Tensor names of the pipeline roles, as docs/manifest.md defines them. Shapes and dtypes always
/// come from the manifest; only these role names are shared knowledge between exporter and host.
enum TensorNames {
    static let inputIds = "input_ids"
    static let position = "position"
    static let hiddenStates = "hidden_states"
    static let hiddenStatesOut = "hidden_states_out"
    static let kCache = "k_cache"
    static let vCache = "v_cache"
    static let kCacheOut = "k_cache_out"
    static let vCacheOut = "v_cache_out"
    static let logitsPrefix = "logits_"
}
