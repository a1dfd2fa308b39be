import Foundation

/// A Codable mirror of an export's `manifest.json` (format_version 2, and 4 for an export whose
/// prefill window decodes; see docs/manifest.md): the one place that names the files, functions,
/// tensors, shapes and dtypes of an exported model.
///
/// Use `Manifest.load(from:)`, which checks `format_version` before decoding anything else, then the
/// fields and their types, the cache shapes against `context_length`, every file name (plain relative
/// names, no link leading outside the folder), a `files` map holding the sha256 of every named file,
/// and that every named file exists: the manifest is untrusted input.
public struct Manifest: Codable, Equatable, Sendable {
    /// The format versions this package reads: 2, and 4 for an export whose prefill window decodes
    /// (`decode_function` "prefill", see `prefillDecodes`).
    public static let supportedFormatVersions = [2, 4]
    /// The format version of an export whose prefill window decodes.
    public static let prefillDecodesFormatVersion = 4
    /// Format versions no longer read, with what they were (refused with a line to re-export).
    public static let retiredFormatVersions = [3: "an export whose prefill window decoded, with masks the embeddings made"]
    /// State caches where the prefill window decodes are longer than the context by the window
    /// less one, rounded up to this many columns (`cacheLength`).
    public static let cacheMultiple = 32
    /// The file name of the manifest inside an export folder.
    public static let fileName = "manifest.json"

    public var formatVersion: Int
    /// What a decoded token runs: "decode" (absent: the default), or "prefill" where the prefill
    /// window decodes (format_version 4; see `prefillDecodes`).
    public var decodeFunction: String?
    /// How the cascade steps where it is "window": as rows of the prefill window, without
    /// "decode_branches" functions (see `windowCascade`); absent or "function": those functions.
    public var cascade: String?
    public var name: String
    public var createdBy: [String: String]
    public var source: Source?
    public var config: ModelConfig
    /// Tokens the KV cache holds.
    public var contextLength: Int
    /// Query length S of the "prefill" functions.
    public var prefillLength: Int
    /// Cache lengths with their own prefill and decode functions, ascending to `contextLength`
    /// (absent in exports without buckets: see `buckets`).
    public var contextBuckets: [Int]?
    /// Branches B of the cascade: of the "decode_branches" functions, or (`windowCascade`) the most
    /// branches one prefill window runs as its rows; nil or 0 when the export has no cascade.
    public var branchWidth: Int?
    /// Tokens each branch's private suffix cache holds (with `branchWidth`).
    public var suffixLength: Int?
    /// Tokens W of the "verify" functions (a drafted token tree checked in one window, for
    /// speculative decoding); nil or 0 when the export has none.
    public var verifyWindow: Int?
    public var precision: String
    public var deploymentTarget: String
    /// Whether functions share one package (needs iOS 18 / macOS 15).
    public var multifunction: Bool
    /// Model name -> the bytes of weights in its package (optional; see `Weights`).
    public var weights: [String: Weights]?
    public var cache: CacheLayout
    /// The embedding table's model files, cut by vocabulary rows.
    public var embeddings: Embeddings
    public var lmHead: LMHead
    /// Block chunks in execution order.
    public var chunks: [Chunk]
    /// Model name ("embeddings", "embeddings_1", "chunk_0", "lm_head", "lm_head_1", "cache_update") -> its functions.
    public var models: [String: ModelEntry]
    public var tokenizer: TokenizerInfo
    /// Artifact file name -> sha256 hex (for a directory, see `SHA256.manifestHash`).
    public var files: [String: String]

    enum CodingKeys: String, CodingKey {
        case formatVersion = "format_version", decodeFunction = "decode_function", cascade, name, createdBy = "created_by", source, config
        case contextLength = "context_length", prefillLength = "prefill_length", contextBuckets = "context_buckets"
        case branchWidth = "branch_width"
        case suffixLength = "suffix_length", verifyWindow = "verify_window"
        case precision, deploymentTarget = "deployment_target", multifunction, weights, cache, embeddings, lmHead = "lm_head"
        case chunks, models, tokenizer, files
    }

    /// The export's context buckets: `context_buckets`, or the whole context alone when absent.
    /// Call after `Manifest.load`/`decode`, which check that the buckets ascend to `contextLength`.
    public var buckets: ContextBuckets {
        ContextBuckets(contextBuckets ?? [contextLength], contextLength: contextLength)
    }

    /// Whether the prefill window decodes (`decode_function` "prefill", format_version 4): the export
    /// has no decode functions (nor decode cache updates), and a token runs its bucket's prefill
    /// function as a window of one real token padded to `prefillLength`. Its embeddings take each
    /// row's position (`positions`) and output no masks: the host makes the masks the chunks read
    /// (`HostMasks`) and, with state caches, the `position` their K/V are written at.
    public var prefillDecodes: Bool { decodeFunction == "prefill" }

    /// Whether the cascade steps through the prefill window (`cascade` "window"): a step runs a group
    /// of up to `branchWidth` branches as the first rows of one prefill window, their K/V side by side
    /// after the shared prefix in the one cache; there are no "decode_branches" functions.
    public var windowCascade: Bool { cascade == "window" }

    /// The phase a decoded token runs: `.decode`, or `.prefill` where the prefill window decodes.
    public var decodePhase: Phase { prefillDecodes ? .prefill : .decode }

    /// The phases of single-sequence windows, each with a copy per context bucket: prefill and
    /// decode, or prefill alone where the prefill window decodes.
    public var windowPhases: [Phase] { prefillDecodes ? [.prefill] : [.prefill, .decode] }

    /// The phase whose functions run `phase` in this export: `.prefill` for `.decode` where the
    /// prefill window decodes, `phase` itself otherwise.
    public func runs(_ phase: Phase) -> Phase { phase == .decode ? decodePhase : phase }

    /// Columns of a context-long state cache (`cache.kind` "state"): the context, and where the
    /// prefill window decodes, that window less one more, rounded up to `cacheMultiple`, so that a
    /// window at the context's last position writes its padding too (Python's `cache_length`).
    /// Input caches hold `contextLength` columns.
    public var cacheLength: Int {
        guard cache.inStates, prefillDecodes else { return contextLength }
        return contextLength + (prefillLength - 1 + Self.cacheMultiple - 1) / Self.cacheMultiple * Self.cacheMultiple
    }

    /// Where the checkpoint came from (provenance only).
    public struct Source: Codable, Equatable, Sendable {
        public var kind: String
        public var path: String?
    }

    /// The model's Hugging Face config fields that a host needs.
    public struct ModelConfig: Codable, Equatable, Sendable {
        public var vocabSize: Int
        public var hiddenSize: Int
        public var intermediateSize: Int?
        public var numHiddenLayers: Int
        public var numAttentionHeads: Int
        public var numKeyValueHeads: Int
        public var headDim: Int
        public var rmsNormEps: Double?
        public var ropeTheta: Double?
        public var maxPositionEmbeddings: Int?
        public var tieWordEmbeddings: Bool?
        public var bosTokenId: Int?
        /// Hugging Face writes one id or a list; both decode to a list.
        public var eosTokenId: [Int]
        public var modelType: String?
        /// The sliding layers' attention window (a query at p sees the keys in (p - window, p]), when
        /// the model has one; the programs apply it (see `slidingLayers`).
        public var slidingWindow: Int?
        /// The layers that attend within `slidingWindow`; where the window is shorter than the
        /// context they read the embeddings' sliding masks, whose names the wiring resolves.
        public var slidingLayers: [Int]
        /// The sliding layers' own RoPE base (Gemma 3), whose tables the embeddings output.
        public var ropeLocalTheta: Double?
        /// The layers with a short convolution in place of attention (LFM2): they keep no K/V, but a
        /// conv state (`cache.conv`) the host carries from window to window.
        public var convLayers: [Int]
        /// The short convolution's kernel (LFM2's conv_L_cache; Qwen3.5's linear-attention layers'
        /// linear_conv_kernel_dim), where the model has conv layers.
        public var convKernel: Int?
        /// Qwen3.5's linear-attention (Gated DeltaNet) layers: no K/V, but a conv state (they are
        /// among `cache.conv.layers`) and a recurrent state (`cache.delta`) the host carries.
        public var deltaLayers: [Int]
        /// Their value heads and key and value widths (`cache.delta` holds the same), where the model has them.
        public var deltaValueHeads: Int?
        public var deltaKeyDim: Int?
        public var deltaValueDim: Int?
        /// P of Gemma 4's per-layer inputs: the embeddings output every layer's P channels
        /// (`per_layer_inputs`), and each chunk reads its own layers' (`per_layer_input`); 0: none.
        public var perLayerInputSize: Int
        /// Gemma 4's global layers' head size and kv heads where they differ from the sliding
        /// layers' (`wideGlobal`); nil: the same.
        public var globalHeadDim: Int?
        public var globalKeyValueHeads: Int?
        /// Gemma 4's KV-shared layers: the last `kvSharedLayers` layers compute no K/V and keep no
        /// cache, attending over their `kvProducer`'s.
        public var kvSharedLayers: Int

        enum CodingKeys: String, CodingKey {
            case vocabSize = "vocab_size", hiddenSize = "hidden_size", intermediateSize = "intermediate_size"
            case numHiddenLayers = "num_hidden_layers", numAttentionHeads = "num_attention_heads"
            case numKeyValueHeads = "num_key_value_heads", headDim = "head_dim", rmsNormEps = "rms_norm_eps"
            case ropeTheta = "rope_theta", maxPositionEmbeddings = "max_position_embeddings"
            case tieWordEmbeddings = "tie_word_embeddings", bosTokenId = "bos_token_id", eosTokenId = "eos_token_id"
            case modelType = "model_type", slidingWindow = "sliding_window", slidingLayers = "sliding_layers"
            case ropeLocalTheta = "rope_local_theta", convLayers = "conv_layers", convKernel = "conv_kernel"
            case perLayerInputSize = "per_layer_input_size", globalHeadDim = "global_head_dim"
            case globalKeyValueHeads = "global_key_value_heads", kvSharedLayers = "kv_shared_layers"
            case deltaLayers = "delta_layers", deltaValueHeads = "delta_value_heads", deltaKeyDim = "delta_key_dim"
            case deltaValueDim = "delta_value_dim"
        }

        public init(from decoder: Decoder) throws {
            let c = try decoder.container(keyedBy: CodingKeys.self)
            vocabSize = try c.decode(Int.self, forKey: .vocabSize)
            hiddenSize = try c.decode(Int.self, forKey: .hiddenSize)
            intermediateSize = try c.decodeIfPresent(Int.self, forKey: .intermediateSize)
            numHiddenLayers = try c.decode(Int.self, forKey: .numHiddenLayers)
            numAttentionHeads = try c.decode(Int.self, forKey: .numAttentionHeads)
            numKeyValueHeads = try c.decodeIfPresent(Int.self, forKey: .numKeyValueHeads) ?? numAttentionHeads
            headDim = try c.decodeIfPresent(Int.self, forKey: .headDim) ?? hiddenSize / numAttentionHeads
            rmsNormEps = try c.decodeIfPresent(Double.self, forKey: .rmsNormEps)
            ropeTheta = try c.decodeIfPresent(Double.self, forKey: .ropeTheta)
            maxPositionEmbeddings = try c.decodeIfPresent(Int.self, forKey: .maxPositionEmbeddings)
            tieWordEmbeddings = try c.decodeIfPresent(Bool.self, forKey: .tieWordEmbeddings)
            bosTokenId = try c.decodeIfPresent(Int.self, forKey: .bosTokenId)
            if let list = try? c.decodeIfPresent([Int].self, forKey: .eosTokenId) {
                eosTokenId = list
            } else {
                eosTokenId = try c.decodeIfPresent(Int.self, forKey: .eosTokenId).map { [$0] } ?? []
            }
            modelType = try c.decodeIfPresent(String.self, forKey: .modelType)
            slidingWindow = try c.decodeIfPresent(Int.self, forKey: .slidingWindow)
            slidingLayers = try c.decodeIfPresent([Int].self, forKey: .slidingLayers) ?? []
            ropeLocalTheta = try c.decodeIfPresent(Double.self, forKey: .ropeLocalTheta)
            convLayers = try c.decodeIfPresent([Int].self, forKey: .convLayers) ?? []
            convKernel = try c.decodeIfPresent(Int.self, forKey: .convKernel)
            perLayerInputSize = try c.decodeIfPresent(Int.self, forKey: .perLayerInputSize) ?? 0
            globalHeadDim = try c.decodeIfPresent(Int.self, forKey: .globalHeadDim)
            globalKeyValueHeads = try c.decodeIfPresent(Int.self, forKey: .globalKeyValueHeads)
            kvSharedLayers = try c.decodeIfPresent(Int.self, forKey: .kvSharedLayers) ?? 0
            deltaLayers = try c.decodeIfPresent([Int].self, forKey: .deltaLayers) ?? []
            deltaValueHeads = try c.decodeIfPresent(Int.self, forKey: .deltaValueHeads)
            deltaKeyDim = try c.decodeIfPresent(Int.self, forKey: .deltaKeyDim)
            deltaValueDim = try c.decodeIfPresent(Int.self, forKey: .deltaValueDim)
        }

        /// Whether layer `n` attends within the sliding window.
        public func slides(_ n: Int) -> Bool { slidingLayers.contains(n) }

        /// Whether layer `n` is a KV-shared layer (one of the last `kvSharedLayers`): no K/V, no cache.
        public func sharesKV(_ n: Int) -> Bool { kvSharedLayers > 0 && n >= numHiddenLayers - kvSharedLayers }

        /// The layer whose K/V KV-shared layer `n` attends over: the last layer before the KV-shared
        /// ones of its type (sliding or global), nil where there is none (`Manifest.decode` refuses that).
        public func kvProducer(_ n: Int) -> Int? {
            (0..<max(numHiddenLayers - kvSharedLayers, 0)).last { slides($0) == slides(n) }
        }

        /// Whether the global layers' heads differ from the sliding layers' (Gemma 4's E2B/E4B): their
        /// K/V then keep apart from the ring's, in the cascade too (a suffix pair per kind).
        public var wideGlobal: Bool { (globalHeadDim ?? 0) > 0 || (globalKeyValueHeads ?? 0) > 0 }

        /// The kv heads of the global layers (`globalKeyValueHeads`, else `numKeyValueHeads`).
        public var globalKVHeads: Int { (globalKeyValueHeads ?? 0) > 0 ? globalKeyValueHeads ?? 0 : numKeyValueHeads }
    }

    /// The bytes of weights in one model's package (`weights`, see docs/manifest.md and
    /// docs/quantization.md): as stored, as fp16, and as the Neural Engine reads them.
    public struct Weights: Codable, Equatable, Sendable {
        /// Bytes as stored in the package (compressed forms at their stored size).
        public var bytes: Int?
        /// The same weights in fp16.
        public var denseBytes: Int?
        /// Bytes as the Neural Engine holds them: forms decompressed at load count dense.
        public var readBytes: Int?
        enum CodingKeys: String, CodingKey { case bytes, denseBytes = "dense_bytes", readBytes = "read_bytes" }

        /// `readBytes`, else `bytes`, else 0: what a loaded copy of the package's weights holds (as
        /// `package_weight_bytes` of the Python package's `contract/resident.py` reads it).
        public var residentBytes: Int { readBytes ?? bytes ?? 0 }
    }

    /// The KV cache layout: `(layers, kv_heads*head_dim, 1, context)` per chunk, and where the caches
    /// live: `kind` "inputs" (passed to the chunks, written back by the cache-update model) or
    /// "state" (Core ML states the prefill/decode functions update themselves; iOS 18 / macOS 15).
    public struct CacheLayout: Codable, Equatable, Sendable {
        public var kind: String?
        public var layout: String
        public var channels: Int
        public var dtype: String
        /// The sliding layers' ring buffer, where the sliding window is shorter than the context.
        public var sliding: Sliding?
        /// The conv layers' state, where the model has conv layers (LFM2; Qwen3.5's linear-attention layers).
        public var conv: Conv?
        /// The linear-attention layers' recurrent state, where the model has them (Qwen3.5).
        public var delta: Delta?

        /// The caches are Core ML states (`kind` "state").
        public var inStates: Bool { kind == "state" }

        /// Slots of the sliding layers' ring buffer, 0 where the export has none.
        public var ringLength: Int { sliding?.length ?? 0 }

        /// Channels of the ring's K/V (`sliding.channels`, else `channels`).
        public var ringChannels: Int { sliding?.channels ?? channels }
    }

    /// The sliding layers' ring buffer (`cache.sliding`): instead of a context-long cache, those
    /// layers keep `(their layers in a chunk, channels, 1, length)` tensors `k_ring`/`v_ring`,
    /// position p in slot p mod `length`, read whole in every phase and context bucket.
    public struct Sliding: Codable, Equatable, Sendable {
        public var length: Int
        /// The decoder layers that keep their K/V in the ring (the config's sliding layers, but
        /// Gemma 4's KV-shared ones, which keep none).
        public var layers: [Int]
        /// The ring's K/V channels where they are not `cache.channels` (Gemma 4's global layers are
        /// wider than its sliding ones); nil: the same.
        public var channels: Int?
    }

    /// The conv layers' state (`cache.conv`, LFM2): each conv layer convolves over its last
    /// `kernel - 1` values, kept right-aligned in `width` columns (a multiple of 32), zeros before the
    /// first token. A chunk with conv layers reads `(its conv layers, channels, 1, width)` as
    /// `conv_state`: an input the host takes after each window from the chunk's `conv_new` (input
    /// caches), or a state the chunk writes itself from `window_tokens` (state caches); the cascade's
    /// `conv_branches` hold a copy per branch. The state does not depend on the context or its buckets
    /// and cannot go back: a rewind by any token starts again from position 0.
    public struct Conv: Codable, Equatable, Sendable {
        /// The conv layers (the config's `conv_layers`).
        public var layers: [Int]
        public var channels: Int
        public var kernel: Int
        public var width: Int
    }

    /// The linear-attention layers' recurrent state (`cache.delta`, Qwen3.5): `heads` value heads of
    /// `keyDim` x `valueDim` per layer, zeros before the first token. A chunk with such layers reads
    /// `(its layers, heads * keyDim, 1, valueDim)` as `delta_state`: an input the host replaces by
    /// the chunk's `delta_new` after each window (input caches), or a state the chunk writes itself
    /// (state caches); the cascade's `delta_branches` hold a copy per layer and branch, layer-major.
    /// Like the conv state it does not depend on the context and cannot go back.
    public struct Delta: Codable, Equatable, Sendable {
        /// The linear-attention layers (the config's `delta_layers`).
        public var layers: [Int]
        public var heads: Int
        public var keyDim: Int
        public var valueDim: Int
        enum CodingKeys: String, CodingKey { case layers, heads, keyDim = "key_dim", valueDim = "value_dim" }

        /// The state's channels: heads * keyDim.
        public var channels: Int { heads * keyDim }
    }

    /// The embedding table, cut by vocabulary rows into one or more models (one file each, so that no
    /// file passes the 1 GB iOS limit); `["embeddings"]` with one range when it fits one file.
    ///
    /// They run in order. The first, `models[0]`, maps `input_ids` and the position(s) to
    /// `hidden_states`, the RoPE tables and the masks. Each later one takes the same `input_ids` and
    /// the previous part's hidden states as `hidden_states`, and outputs `hidden_states_out`: those
    /// plus the lookup of its own rows.
    public struct Embeddings: Codable, Equatable, Sendable {
        /// Model names in execution order ("embeddings", "embeddings_1", ...).
        public var models: [String]
        /// Per model, the `[start, end)` token ids whose rows it holds: consecutive, covering `0..<vocab_size`.
        public var vocabRanges: [[Int]]
        enum CodingKeys: String, CodingKey { case models, vocabRanges = "vocab_ranges" }
    }

    /// The LM head, cut into one or more models that all take `hidden_states`: each outputs a
    /// consecutive group of the vocabulary splits, named globally `logits_j`. `logits_j` has
    /// `vocabSplits[j]` entries; all of them in `j` order, concatenated, are the full vocabulary.
    ///
    /// With `foldedInto` there is no head model: the last chunk carries the head, and every one of
    /// its functions outputs the `logits_j` in place of `hidden_states_out`.
    public struct LMHead: Codable, Equatable, Sendable {
        /// Model names ("lm_head", "lm_head_1", ...); `["lm_head"]` when the head fits one file,
        /// empty when the head is folded into the last chunk.
        public var models: [String]
        public var vocabSplits: [Int]
        /// The last chunk's model, when it carries the head (`export --fold-lm-head`).
        public var foldedInto: String?
        enum CodingKeys: String, CodingKey { case models, vocabSplits = "vocab_splits", foldedInto = "folded_into" }

        /// The models whose outputs are the logits: the head models, or the chunk that carries the head.
        public var logitsModels: [String] { foldedInto.map { [$0] } ?? models }
    }

    /// One block chunk: its model name, its layers, and its cache-update functions per phase
    /// ("prefill", "decode", and "decode_branches", "verify" when the export has them).
    public struct Chunk: Codable, Equatable, Sendable {
        public var model: String
        public var layers: [Int]
        /// Function name ("prefill", "decode", "decode_branches", "verify") -> function in the "cache_update" model.
        public var cacheUpdate: [String: String]
        enum CodingKeys: String, CodingKey { case model, layers, cacheUpdate = "cache_update" }
    }

    /// A model of the export: its functions by name ("prefill", "decode", "decode_branches", "verify").
    public struct ModelEntry: Codable, Equatable, Sendable {
        public var functions: [String: Function]
    }

    /// One function: the package that holds it, its name inside that package, its I/O, and the
    /// states it reads and writes (a `--kv-cache state` export's caches; empty otherwise).
    public struct Function: Codable, Equatable, Sendable {
        public var file: String
        public var functionName: String
        public var inputs: [TensorSpec]
        public var outputs: [TensorSpec]
        public var states: [TensorSpec] = []
        enum CodingKeys: String, CodingKey { case file, functionName = "function_name", inputs, outputs, states }

        public func input(_ name: String) -> TensorSpec? { inputs.first { $0.name == name } }
        public func output(_ name: String) -> TensorSpec? { outputs.first { $0.name == name } }
    }

    /// A tensor's name, shape and dtype ("float16", "float32", "int32").
    public struct TensorSpec: Codable, Equatable, Sendable {
        public var name: String
        public var shape: [Int]
        public var dtype: String

        public var count: Int { shape.reduce(1, *) }
    }

    /// What the exporter recorded about the tokenizer.
    public struct TokenizerInfo: Codable, Equatable, Sendable {
        public var files: [String]
        public var bosTokenId: Int?
        public var eosTokenIds: [Int]
        public var addBosToken: Bool
        public var chatTemplate: String?
        public var specialTokens: [String: Int]

        enum CodingKeys: String, CodingKey {
            case files, bosTokenId = "bos_token_id", eosTokenIds = "eos_token_ids", addBosToken = "add_bos_token"
            case chatTemplate = "chat_template", specialTokens = "special_tokens"
        }

        public init(from decoder: Decoder) throws {
            let c = try decoder.container(keyedBy: CodingKeys.self)
            files = try c.decode([String].self, forKey: .files)
            bosTokenId = try c.decodeIfPresent(Int.self, forKey: .bosTokenId)
            eosTokenIds = try c.decodeIfPresent([Int].self, forKey: .eosTokenIds) ?? []
            addBosToken = try c.decodeIfPresent(Bool.self, forKey: .addBosToken) ?? false
            chatTemplate = try c.decodeIfPresent(String.self, forKey: .chatTemplate)
            specialTokens = try c.decodeIfPresent([String: Int].self, forKey: .specialTokens) ?? [:]
        }
    }
}

extension Manifest.Function {
    /// Decodes a function entry; `states` may be absent (functions without states).
    public init(from decoder: Decoder) throws {
        let c = try decoder.container(keyedBy: CodingKeys.self)
        file = try c.decode(String.self, forKey: .file)
        functionName = try c.decode(String.self, forKey: .functionName)
        inputs = try c.decode([Manifest.TensorSpec].self, forKey: .inputs)
        outputs = try c.decode([Manifest.TensorSpec].self, forKey: .outputs)
        states = try c.decodeIfPresent([Manifest.TensorSpec].self, forKey: .states) ?? []
    }
}
