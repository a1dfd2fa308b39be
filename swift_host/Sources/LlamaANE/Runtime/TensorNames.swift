/// Tensor names of the pipeline roles, as docs/manifest.md defines them. Shapes and dtypes always
/// come from the manifest; only these role names are shared knowledge between exporter and host.
/// The exporter's twin is `llama_ane/model/names.py`; both are checked against one table,
/// `Fixtures/tensor_names.json` (TensorNamesTests here, tests/test_tensor_names.py there).
enum TensorNames {
    static let inputIds = "input_ids"
    static let position = "position"
    static let positions = "positions"
    static let prefixLength = "prefix_length"
    static let suffixPositions = "suffix_positions"
    /// The verify window's per-token tree depths (W,), its additive tree mask (1, 1, W, W) and the
    /// cache slots (W,) its cache update writes the accepted tokens to.
    static let depths = "depths"
    static let treeMask = "tree_mask"
    static let slots = "slots"
    /// The masks a chunk's window function reads: over the cache and the window, and the sliding
    /// layers' twin. Where the prefill window decodes the host makes them (`HostMasks`).
    static let mask = "mask"
    static let slidingMask = "sliding_mask"
    static let hostMasks: Set<String> = [mask, slidingMask]
    static let hiddenStates = "hidden_states"
    static let hiddenStatesOut = "hidden_states_out"
    static let kCache = "k_cache"
    static let vCache = "v_cache"
    static let kCacheOut = "k_cache_out"
    static let vCacheOut = "v_cache_out"
    /// The sliding layers' ring buffer (`cache.sliding`), read whole in every context bucket, and
    /// the slots (W,) the verify cache update writes the accepted tokens to in it.
    static let kRing = "k_ring"
    static let vRing = "v_ring"
    static let ringSlots = "ring_slots"
    /// The conv layers' state (`cache.conv`): the chunk's input or state, the window's values the
    /// chunk returns (input caches), the window's real tokens from which a chunk writes its state
    /// itself (state caches), and the cascade branches' own states.
    static let convState = "conv_state"
    static let convNew = "conv_new"
    static let windowTokens = "window_tokens"
    static let convBranches = "conv_branches"
    /// The linear-attention layers' recurrent state (`cache.delta`): the chunk's input or state, the
    /// state after the window the chunk returns (input caches; in the cascade each branch's), and
    /// the cascade branches' own states.
    static let deltaState = "delta_state"
    static let deltaNew = "delta_new"
    static let deltaBranches = "delta_branches"
    /// The chunk caches a host holds: the full caches, the rings, the conv and recurrent states.
    static let caches: Set<String> = [kCache, vCache, kRing, vRing, convState, deltaState]
    static let rings: Set<String> = [kRing, vRing]
    /// Gemma 4's per-layer inputs: every layer's, which the embeddings output (a later embeddings
    /// file reads and completes them, as `per_layer_inputs_out`), and a chunk's own layers' rows.
    static let perLayerInputs = "per_layer_inputs"
    static let perLayerInputsOut = "per_layer_inputs_out"
    static let perLayerInput = "per_layer_input"
    /// The prefix of a KV-shared layer's inputs of its producers' K/V (`Manifest.hostRows`).
    static let sharedPrefix = "shared_"
    static let logitsPrefix = "logits_"
    /// A cache-update output `X_out` is the new value of its input `X`.
    static let updatedSuffix = "_out"

    /// The cache update's output that is the new value of its input `name` (k_cache -> k_cache_out).
    static func updated(_ name: String) -> String { name + updatedSuffix }
    /// A KV-shared chunk's input of its producer's tensor `name` (k_cache -> shared_k_cache).
    static func shared(_ name: String) -> String { sharedPrefix + name }
    /// The LM head's output of vocabulary split `split` (logits_0, logits_1, ...).
    static func logits(_ split: Int) -> String { "\(logitsPrefix)\(split)" }
}
