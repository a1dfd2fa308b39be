#if canImport(CoreML)
import CoreML
import Foundation

/// The exported Core ML programs behind `BranchBackend`: the embeddings parts, the block chunks, the
/// LM head models and the cache-update functions of each phase, with every tensor preallocated once.
///
/// Nothing is copied between stages: each stage writes into IOSurface-backed arrays given as
/// `outputBackings`, and the next stage reads them as inputs. Activations ping-pong between two
/// hidden-state buffers, through the later embeddings parts (when the table is cut by vocabulary
/// rows) and the chunks alike. Caches (the prefix K/V and, for cascades, the branches' suffix K/V) are
/// double-buffered: a cache update reads the current buffer, writes the other (its outputs
/// `X_out` back input `X`), and the two swap when it finishes.
///
/// A `--kv-cache state` export keeps each chunk's prefix K/V in a Core ML `MLState` (macOS 15 /
/// iOS 18) instead: one per chunk, made from the chunk's package and shared by all its functions;
/// the prefill and decode functions write their window into it at the window's position, and
/// there is no cache update for them (the cascade's suffix caches are still double-buffered).
///
/// An export with a verify window also loads the "verify" functions (speculative decoding): the
/// tree's ids, depths and float tree mask go to the embeddings, the chunks run their window graph
/// at S = W against the prefix caches and keep their new K/V in the verify stage's own output
/// arrays, and once the accepted path is known each chunk's verify cache update writes only that
/// path's K/V (`slots`), double-buffered like every other update.
///
/// An export with context buckets also has each bucket's prefill and decode functions; a window
/// runs in its bucket's stage, whose functions are given views of the first T positions of the
/// prefix caches (see `CacheBuffers`). The LM head is the same in every bucket.
///
/// Functions are loaded by the export's load plan (`LoadPlan`, `PlannedStages`): a stage (a phase
/// at one context bucket) loads its functions through the model store on the first use of that
/// phase and bucket, once, and keeps them with its buffers; a function several stages hold (the
/// LM head's) is loaded once. Each function loaded for the Neural Engine is modelled as its own
/// copy of its package's weights (`ResidentModel`), so the backend holds those of the stages the
/// session has run, not of every stage the export has.
///
/// Where the sliding layers keep a ring buffer (`cache.sliding`), each chunk with such layers also
/// holds `k_ring`/`v_ring` of R slots beside (or, where all its layers slide, instead of) its
/// `k_cache`/`v_cache`: double-buffered inputs the cache update writes at the window's slots
/// (position mod R, which it computes from `position`; for verify, the accepted tokens'
/// `ring_slots`), or states of a state export that the chunk writes itself. Every phase and
/// bucket reads the ring whole.
///
/// Where the model has conv layers (`cache.conv`: LFM2's, Qwen3.5's linear-attention layers), each
/// chunk with such layers also holds their conv state: with input caches one `conv_state` array the
/// chunk reads, which the host moves on in place after the chunk has run, from its `conv_new` and
/// the window's real tokens (a chunk of conv layers only has no K/V and no cache update); with state
/// caches a state the chunk writes itself, told the window's real tokens by `window_tokens`. The
/// cascade's `conv_branches` array gets a copy of the prefix's state in every branch at a group's
/// first step (from the array or the chunk's `MLState`) and moves each branch on by its own
/// `conv_new` value after every step. Qwen3.5's linear-attention layers' recurrent state
/// (`cache.delta`) moves the same way (`CarriedState`): `delta_state`, replaced by the chunk's
/// `delta_new` after each window; `delta_branches`, a layer-major copy of the prefix's per branch,
/// replaced by `delta_new` after each step. Unlike K/V, which every function masks from the
/// window's position on, these states are not positional: a window at position 0 (a new sequence,
/// or any rewind, which keeps no token of such an export) first empties them.
///
/// An export whose prefill window decodes (`decode_function` "prefill", format_version 4) has one
/// function per model and bucket, the prefill one, which a decoded token runs as a window of one
/// real token (`Manifest.runs` maps decode to it). Its embeddings take each row's `positions` and
/// output no masks: the host's masks (`HostWindow`, made by `HostMasks`) are written into the
/// stage's own mask arrays, which the chunks read, and with state caches the window's write
/// `position` into the chunks' int32 input (the states hold `Manifest.cacheLength` columns, room for
/// a window's padding at the context's end). Its cascade, where it steps through the prefill window
/// (`cascade` "window"), runs through the same stage (`ChunkedPipeline.decodeBranchesInWindow`).
///
/// An export whose LM head is folded into the last chunk (`lm_head.folded_into`) loads no head
/// model: the last chunk's function of each phase and bucket writes the logits into that stage's
/// logits arrays, which the step's `Activations` then point to.
///
/// Tensors are wired by name as `PipelineWiring` resolves them from the manifest.
public final class CoreMLBackend: BranchBackend, VerifyBackend, @unchecked Sendable {
    /// The activations between stages: which hidden-state buffer holds the current values.
    public struct Activations {
        let hidden: MLMultiArray
        let slot: Int
        /// With a folded head, after the last chunk: its logits outputs in vocabulary order (the
        /// stage's own arrays, so the right ones for the window's context bucket); empty otherwise.
        var logits: [(name: String, array: MLMultiArray)] = []
        /// The window's real tokens, after which the conv layers' state is taken (0 for a cascade step).
        var realTokens = 0
        /// Gemma 4's per-layer inputs of the step (the last embeddings file's), nil without.
        var perLayer: MLMultiArray?
        /// The context bucket of the window's stage, whose LM head arrays hold its logits (nil: the
        /// whole context).
        var bucket: Int?
    }

    /// The functions and buffers of one phase.
    private struct Stage {
        /// The first embeddings part (ids and positions to hidden states, RoPE tables, masks).
        let embeddings: MLModel
        /// The later embeddings parts in manifest order; each adds its rows' lookup to the hidden states.
        let embeddingParts: [(name: String, model: MLModel)]
        let chunks: [MLModel]
        let chunkFunctions: [Manifest.Function]
        /// Per chunk, its cache update (nil where it has none: a state export's prefill and decode,
        /// a chunk of conv layers only).
        let updates: [MLModel?]
        /// The LM head models in manifest order, each with its own logits output arrays by name
        /// (the same arrays as `logits`).
        let lmHeads: [(model: MLModel, outputs: [String: MLMultiArray])]
        let embeddingsFunction: Manifest.Function
        let updateFunctions: [Manifest.Function?]
        /// The first embeddings part's inputs the host writes, by name: int32 ids and positions
        /// (input_ids, position(s), prefix_length, depths) and the verify function's float tree
        /// mask; the later parts read the same arrays.
        let hostInputs: [String: MLMultiArray]
        /// The chunks' int32 inputs the host writes that the embeddings do not read (a state
        /// export's window_tokens; where the prefill window decodes, with states, the window's
        /// write position), by name.
        let chunkValues: [String: MLMultiArray]
        /// Where the prefill window decodes: the masks the chunks read, which the host writes
        /// (`HostWindow.masks`), by name; empty otherwise.
        let hostMasks: [String: MLMultiArray]
        let hidden: [MLMultiArray]
        /// Gemma 4's per-layer inputs, ping-ponged through the embeddings files as the hidden states
        /// are; empty without.
        let perLayer: [MLMultiArray]
        /// Per chunk, its inputs the host gathers rows into before it runs (`TensorSource.gathered`:
        /// per_layer_input, the KV-shared layers' shared_* inputs), by name.
        let gathered: [[String: MLMultiArray]]
        /// Embedding outputs other than the hidden states (cos, sin, masks), by name.
        let shared: [String: MLMultiArray]
        /// Per chunk, its outputs other than the hidden states (k_new, v_new), by name.
        let chunkOutputs: [[String: MLMultiArray]]
        /// The logits outputs of all LM head models (with a folded head: of the last chunk) in
        /// vocabulary order (logits_0, logits_1, ...).
        let logits: [(name: String, array: MLMultiArray)]
    }

    /// Double-buffered cache tensors of one chunk, by input name ("k_cache", "v_cache", ...).
    ///
    /// A context bucket T below the whole context gets, once, views of the first T positions of
    /// both buffers (`CoreMLArrays.prefixView`: the same memory, with the whole array's strides),
    /// rather than per-bucket buffers: a per-bucket copy would cost a copy of the filled positions
    /// at every step, or at every change of bucket plus a second set of caches, while a view costs
    /// nothing and lets the update write its T positions straight back into the whole cache. The
    /// positions past T are left as they were; they are past the window's position, which every
    /// function masks, so no bucket ever reads them as history. A ring buffer (`k_ring`, `v_ring`)
    /// is its R slots in every bucket: each bucket's functions read and write it whole.
    private final class CacheBuffers: @unchecked Sendable {
        private let lock = NSLock()
        private let buffers: [[String: MLMultiArray]]
        /// Bucket -> per buffer, the views of its first positions.
        private let views: [Int: [[String: MLMultiArray]]]
        private var current = 0

        init(_ specs: [Manifest.TensorSpec], buckets: [Int] = []) throws {
            let buffers = try (0..<2).map { _ in
                try Dictionary(uniqueKeysWithValues: specs.map { ($0.name, try CoreMLArrays.make($0)) })
            }
            var views: [Int: [[String: MLMultiArray]]] = [:]
            for bucket in buckets {
                views[bucket] = try buffers.map { set in
                    try Dictionary(uniqueKeysWithValues: set.map { entry -> (String, MLMultiArray) in
                        let whole = TensorNames.rings.contains(entry.key)
                        return (entry.key, try whole ? entry.value : CoreMLArrays.prefixView(entry.value, positions: bucket))
                    })
                }
            }
            self.buffers = buffers
            self.views = views
        }

        /// The current and the spare buffers, or their views of a context bucket's first positions.
        func pair(bucket: Int? = nil) -> (current: [String: MLMultiArray], spare: [String: MLMultiArray]) {
            lock.lock(); defer { lock.unlock() }
            let sets = bucket.flatMap { views[$0] } ?? buffers
            return (sets[current], sets[1 - current])
        }

        func swap() { lock.lock(); current = 1 - current; lock.unlock() }

        func zero() {
            lock.lock(); defer { lock.unlock() }
            current = 0
            for set in buffers { set.values.forEach(CoreMLArrays.zero) }
        }
    }

    /// The Core ML states of a state export's chunks (`MLState`, typed `AnyObject` so that the
    /// class itself needs no macOS 15 availability): made once, from the first stage that needs
    /// them (`makeOnce`), and replaced, empty, by `reset`.
    private final class ChunkStates: @unchecked Sendable {
        private let lock = NSLock()
        private var states: [AnyObject] = []
        private var maker: (() throws -> [AnyObject])?

        /// Whether the states have been made.
        var made: Bool {
            lock.lock(); defer { lock.unlock() }
            return maker != nil
        }

        /// Makes the states with `make` unless they have been made; `reset` makes them again with it.
        func makeOnce(_ make: @escaping () throws -> [AnyObject]) throws {
            lock.lock(); defer { lock.unlock() }
            guard maker == nil else { return }
            states = try make()
            maker = make
        }

        func state(_ index: Int) -> AnyObject? {
            lock.lock(); defer { lock.unlock() }
            return index < states.count ? states[index] : nil
        }

        /// Replaces the states by empty ones (nothing while they have not been made).
        func reset() throws {
            lock.lock(); let make = maker; lock.unlock()
            guard let make else { return }
            let fresh = try make()
            lock.lock(); states = fresh; lock.unlock()
        }
    }

    public let manifest: Manifest
    private let wiring: PipelineWiring
    /// Where the prefill window decodes, the masks a window given as a `TokenWindow` gets.
    private let masks: HostMasks?
    /// Each phase's stage ("prefill", ...) and each context bucket's ("prefill_512", ...), made on
    /// first use through the load plan.
    private let stages: PlannedStages<CoreMLModelStore, Stage>
    private let prefixCaches: [CacheBuffers]
    private let suffixCaches: [CacheBuffers]
    /// A state export's chunk states, made with the first stage that needs them; nil with input caches.
    private let chunkStates: ChunkStates?
    /// Per carried state and chunk, the state with input caches (`conv_state`, `delta_state`), moved
    /// on in place after each window; nil for a chunk without such layers or whose state is a Core ML state.
    private let carriedStates: [CarriedState: [MLMultiArray?]]
    /// Per carried state and chunk, its states per cascade branch (`conv_branches`, `delta_branches`), nil without.
    private let carriedBranches: [CarriedState: [MLMultiArray?]]

    public var chunkCount: Int { manifest.chunks.count }
    public var branchWidth: Int {
        stages.plan.stage(.decodeBranches, bucket: manifest.contextLength) == nil ? 0 : manifest.branchWidth ?? 0
    }
    public var suffixLength: Int { manifest.suffixLength ?? 0 }
    public var verifyWindow: Int { stages.plan.stage(.verify, bucket: manifest.contextLength) == nil ? 0 : manifest.verifyWindow ?? 0 }

    /// The export's load plan: the functions of each stage.
    public var loadPlan: LoadPlan { stages.plan }

    /// The functions loaded so far, in load order.
    public func loadedFunctions() async -> [PlannedFunction] { await stages.loaded }

    /// What the functions loaded so far keep wired, modelled (`ResidentModel`).
    public func resident() async -> ResidentModel { await stages.resident }

    /// Resolves the wiring and the load plan and allocates the caches. No function is loaded here:
    /// each stage (the cascade and verify phases when the export has them, each context bucket's
    /// prefill and decode) loads its functions through `store` on its first use, compiling
    /// packages on first use.
    public static func load(manifest: Manifest, store: CoreMLModelStore) async throws -> CoreMLBackend {
        let wiring = try PipelineWiring(manifest: manifest)
        let stages = PlannedStages(plan: try LoadPlan(manifest: manifest), store: store) { loaded in
            try makeStage(loaded, manifest: manifest)
        }
        let buckets = manifest.buckets
        let smaller = Array(buckets.sizes.dropLast())
        let prefix = try (wiring.updatedState[manifest.decodePhase] ?? []).map { try CacheBuffers($0, buckets: smaller) }
        let suffix = try (wiring.updatedState[.decodeBranches] ?? []).map { try CacheBuffers($0) }
        let states = manifest.cache.inStates ? ChunkStates() : nil
        // carried states by the input specs of the functions that read them (the same in every bucket)
        func carriedArrays(_ phase: Phase, _ carry: CarryMode, _ name: (CarriedState) -> String) throws
            -> [CarriedState: [MLMultiArray?]] {
            var out: [CarriedState: [MLMultiArray?]] = [:]
            for carried in CarriedState.allCases {
                out[carried] = try manifest.chunks.enumerated().map { i, chunk -> MLMultiArray? in
                    guard wiring.carry(carried, manifest.runs(phase), chunk: i) == carry else { return nil }
                    guard let spec = try manifest.function(chunk.model, manifest.runs(phase).rawValue).input(name(carried)) else {
                        throw PipelineError.unwiredInput(model: "\(chunk.model) (\(phase.rawValue))", input: name(carried))
                    }
                    return try CoreMLArrays.make(spec)
                }
            }
            return out
        }
        return CoreMLBackend(manifest: manifest, wiring: wiring, stages: stages, prefixCaches: prefix, suffixCaches: suffix,
                             chunkStates: states, carriedStates: try carriedArrays(.decode, .fromOutput, \.stateName),
                             carriedBranches: try carriedArrays(.decodeBranches, .branches, \.branchesName))
    }

    private init(manifest: Manifest, wiring: PipelineWiring, stages: PlannedStages<CoreMLModelStore, Stage>, prefixCaches: [CacheBuffers],
                 suffixCaches: [CacheBuffers], chunkStates: ChunkStates?, carriedStates: [CarriedState: [MLMultiArray?]],
                 carriedBranches: [CarriedState: [MLMultiArray?]]) {
        self.manifest = manifest
        self.wiring = wiring
        self.masks = manifest.prefillDecodes ? HostMasks(manifest: manifest) : nil
        self.stages = stages
        self.prefixCaches = prefixCaches
        self.suffixCaches = suffixCaches
        self.chunkStates = chunkStates
        self.carriedStates = carriedStates
        self.carriedBranches = carriedBranches
    }

    /// A new state of `model` with each of its buffers `specs` (k_cache, v_cache, k_ring, v_ring:
    /// those the chunk holds) zeroed (needs macOS 15 / iOS 18, as states do). Each buffer must have
    /// the manifest's shape: a context-long cache `Manifest.cacheLength` columns, which where the
    /// prefill window decodes holds a window's padding past the context.
    private static func makeState(_ model: MLModel, _ specs: [Manifest.TensorSpec], manifest: Manifest) throws -> AnyObject {
        guard #available(macOS 15.0, iOS 18.0, *) else {
            throw ManifestError.inconsistent("this export keeps its KV caches in Core ML states, which need macOS 15 / "
                + "iOS 18; re-export with --kv-cache inputs for \(manifest.deploymentTarget)")
        }
        let state = model.makeState()
        for spec in specs {
            try state.withMultiArray(for: spec.name) { array in
                guard array.shape.map(\.intValue) == spec.shape else {
                    throw ManifestError.inconsistent("the package's state \(spec.name) has shape \(array.shape.map(\.intValue)), "
                        + "but the manifest gives \(spec.shape) (cache length \(manifest.cacheLength))")
                }
                CoreMLArrays.zero(array)
            }
        }
        return state
    }

    /// The stage of the loaded functions `loaded` of its plan's phase at its context bucket: the
    /// phase's own, or a context bucket's copy (whose later embeddings parts and LM head are the
    /// phase's: they have no bucketed functions), with its buffers allocated.
    private static func makeStage(_ loaded: LoadedStage<MLModel>, manifest: Manifest) throws -> Stage {
        let plan = loaded.plan
        let p = plan.phase.rawValue
        func entry(_ f: PlannedFunction) throws -> Manifest.Function { try manifest.function(f.model, f.function) }
        let firstPart = manifest.embeddings.models.first ?? ""
        guard let first = plan.embeddings.first, let embeddingsModel = loaded.embeddings.first else {
            throw ManifestError.inconsistent("embeddings models is empty")
        }
        let embeddingsFunction = try entry(first)
        let headFunctions = try plan.lmHeads.map(entry)
        let chunkFunctions = try plan.chunks.map(entry)
        // A state export's prefill and decode write their caches in the chunk: no cache update;
        // nor has a chunk of conv layers only, which keeps no K/V (`LoadPlan`).
        let updateFunctions = try plan.updates.map { try $0.map(entry) }
        var shared: [String: MLMultiArray] = [:]
        var hidden: [MLMultiArray] = [], perLayer: [MLMultiArray] = []
        for spec in embeddingsFunction.outputs {
            if spec.name == TensorNames.hiddenStates {
                hidden = [try CoreMLArrays.make(spec), try CoreMLArrays.make(spec)]
            } else if spec.name == TensorNames.perLayerInputs {
                perLayer = [try CoreMLArrays.make(spec), try CoreMLArrays.make(spec)]
            } else {
                shared[spec.name] = try CoreMLArrays.make(spec)
            }
        }
        guard hidden.count == 2 else {
            throw PipelineError.unwiredInput(model: firstPart, input: TensorNames.hiddenStates)
        }
        let gathered = try chunkFunctions.map { f in
            try Dictionary(uniqueKeysWithValues: f.inputs.filter {
                $0.name == TensorNames.perLayerInput || $0.name.hasPrefix(TensorNames.sharedPrefix)
            }.map { ($0.name, try CoreMLArrays.make($0)) })
        }
        let chunkOutputs = try chunkFunctions.map { f in
            try Dictionary(uniqueKeysWithValues: f.outputs.filter { $0.name != TensorNames.hiddenStatesOut }
                .map { ($0.name, try CoreMLArrays.make($0)) })
        }
        // Every head model writes its own logits_j into its own arrays; together they are the vocabulary.
        var headOutputs: [[String: MLMultiArray]] = []
        for (name, f) in zip(manifest.lmHead.models, headFunctions) {
            if let other = f.inputs.first(where: { $0.name != TensorNames.hiddenStates }) {
                throw PipelineError.unwiredInput(model: "\(name) (\(p))", input: other.name)
            }
            headOutputs.append(try Dictionary(uniqueKeysWithValues: f.outputs.filter { $0.name.hasPrefix(TensorNames.logitsPrefix) }
                .map { ($0.name, try CoreMLArrays.make($0)) }))
        }
        func splitIndex(_ name: String) -> Int { Int(name.dropFirst(TensorNames.logitsPrefix.count)) ?? 0 }
        // A folded head's logits are the last chunk's own outputs, written where its k_new and v_new are.
        let logitsSources = manifest.lmHead.foldedInto == nil ? headOutputs
            : [(chunkOutputs.last ?? [:]).filter { $0.key.hasPrefix(TensorNames.logitsPrefix) }]
        let logits = logitsSources.flatMap { $0.map { (name: $0.key, array: $0.value) } }
            .sorted { splitIndex($0.name) < splitIndex($1.name) }
        let hostInputs = try Dictionary(uniqueKeysWithValues: embeddingsFunction.inputs.map { ($0.name, try CoreMLArrays.make($0)) })
        var chunkValues: [String: MLMultiArray] = [:], hostMasks: [String: MLMultiArray] = [:]
        // where the prefill window decodes, its embeddings take no position: the chunks' own (with states)
        let values = manifest.prefillDecodes ? [TensorNames.windowTokens, TensorNames.position] : [TensorNames.windowTokens]
        for spec in chunkFunctions.flatMap(\.inputs) where values.contains(spec.name) && spec.dtype == "int32"
            && embeddingsFunction.input(spec.name) == nil && chunkValues[spec.name] == nil {
            chunkValues[spec.name] = try CoreMLArrays.make(spec)
        }
        // and no masks: the host writes them into the stage's arrays, which every chunk reads
        for spec in chunkFunctions.flatMap(\.inputs) where manifest.prefillDecodes && plan.phase == .prefill
            && TensorNames.hostMasks.contains(spec.name) && embeddingsFunction.output(spec.name) == nil && hostMasks[spec.name] == nil {
            hostMasks[spec.name] = try CoreMLArrays.make(spec)
        }

        let parts = zip(plan.embeddings.dropFirst(), loaded.embeddings.dropFirst()).map { (name: $0.model, model: $1) }
        let heads = zip(loaded.lmHeads, headOutputs).map { (model: $0, outputs: $1) }
        return Stage(embeddings: embeddingsModel, embeddingParts: parts, chunks: loaded.chunks,
                     chunkFunctions: chunkFunctions, updates: loaded.updates, lmHeads: heads, embeddingsFunction: embeddingsFunction,
                     updateFunctions: updateFunctions, hostInputs: hostInputs, chunkValues: chunkValues, hostMasks: hostMasks,
                     hidden: hidden, perLayer: perLayer, gathered: gathered, shared: shared, chunkOutputs: chunkOutputs,
                     logits: logits)
    }

    /// The stage of `phase` at context bucket `bucket` (the whole context by default), its
    /// functions loaded on its first use (`PlannedStages`). A state export's chunk states are made
    /// with the first stage asked for.
    private func stage(_ phase: Phase, bucket: Int? = nil) async throws -> Stage {
        let phase = manifest.runs(phase)
        let s = try await stages.stage(phase, bucket: bucket ?? manifest.contextLength)
        try await makeStates(phase, s)
        return s
    }

    /// A state export's chunk states, made once from the chunks of the first stage asked for: that
    /// stage's where it is a prefill or decode stage (any bucket's: the functions that write the
    /// states, which keep the whole context in every bucket), else the decode stage's.
    private func makeStates(_ phase: Phase, _ s: Stage) async throws {
        guard let chunkStates, !chunkStates.made else { return }
        guard phase == .prefill || phase == .decode else {
            _ = try await stage(manifest.decodePhase)  // makes them
            return
        }
        let manifest = self.manifest
        try chunkStates.makeOnce {
            try zip(s.chunks, s.chunkFunctions).map { try Self.makeState($0, $1.states, manifest: manifest) }
        }
    }

    /// Runs one prediction whose outputs land in `backings`, on `state` when given (an `MLState`).
    private func predict(_ model: MLModel, inputs: [String: MLMultiArray], backings: [String: MLMultiArray],
                         state: AnyObject? = nil) async throws {
        let provider = try MLDictionaryFeatureProvider(dictionary: inputs.mapValues { MLFeatureValue(multiArray: $0) })
        let options = MLPredictionOptions()
        options.outputBackings = backings
        if let state {
            guard #available(macOS 15.0, iOS 18.0, *), let state = state as? MLState else {
                throw ManifestError.inconsistent("Core ML states need macOS 15 / iOS 18")
            }
            _ = try await model.prediction(from: provider, using: state, options: options)
        } else if #available(macOS 14.0, iOS 17.0, *) {
            _ = try await model.prediction(from: provider, options: options)
        } else {
            try Self.predictBlocking(model, provider, options)
        }
    }

    /// The synchronous prediction of macOS 13 / iOS 16 (a synchronous context picks that overload).
    private static func predictBlocking(_ model: MLModel, _ provider: MLFeatureProvider, _ options: MLPredictionOptions) throws {
        _ = try model.prediction(from: provider, options: options)
    }

    /// The embeddings of `phase` with the given int32 inputs (and float inputs, row-major over
    /// their shapes): the first part into hidden buffer 0 and the shared outputs, then each later
    /// part from the current hidden buffer into the other.
    private func embed(_ phase: Phase, bucket: Int? = nil, _ values: [String: [Int32]],
                       floats: [String: [Float]] = [:], realTokens: Int = 0) async throws -> Activations {
        let phase = manifest.runs(phase)
        let s = try await stage(phase, bucket: bucket)
        for spec in s.embeddingsFunction.inputs {
            guard let array = s.hostInputs[spec.name] else {
                throw PipelineError.unwiredInput(model: manifest.embeddings.models.first ?? "", input: spec.name)
            }
            if let v = values[spec.name] {
                CoreMLArrays.write(v, into: array)
            } else if let v = floats[spec.name], v.count == spec.count {
                CoreMLArrays.write(v, into: array)
            } else {
                throw PipelineError.unwiredInput(model: manifest.embeddings.models.first ?? "", input: spec.name)
            }
        }
        var backings = s.shared
        backings[TensorNames.hiddenStates] = s.hidden[0]
        backings[TensorNames.perLayerInputs] = s.perLayer.first
        try await predict(s.embeddings, inputs: s.hostInputs, backings: backings)
        var current = Activations(hidden: s.hidden[0], slot: 0, realTokens: realTokens, perLayer: s.perLayer.first, bucket: bucket)
        for (index, part) in s.embeddingParts.enumerated() {
            var inputs: [String: MLMultiArray] = [:]
            for (name, source) in wiring.embeddingInputs[phase]?[index] ?? [:] {
                let array: MLMultiArray?
                switch source {
                case .hiddenStates: array = current.hidden
                case .perLayerInputs: array = current.perLayer
                case let .value(n): array = s.hostInputs[n]
                case .embeddingsOutput, .hostMask, .cache, .suffixCache, .chunkOutput, .carriedState, .carriedBranches, .gathered:
                    array = nil
                }
                guard let array else { throw PipelineError.unwiredInput(model: part.name, input: name) }
                inputs[name] = array
            }
            // the per-layer inputs alternate between their two buffers with the hidden states
            let perLayer = s.perLayer.isEmpty ? nil : s.perLayer[1 - current.slot]
            let out = Activations(hidden: s.hidden[1 - current.slot], slot: 1 - current.slot, realTokens: realTokens,
                                  perLayer: perLayer, bucket: bucket)
            var partBackings = [TensorNames.hiddenStatesOut: out.hidden]
            partBackings[TensorNames.perLayerInputsOut] = perLayer
            try await predict(part.model, inputs: inputs, backings: partBackings)
            current = out
        }
        return current
    }

    private func chunk(_ index: Int, _ input: Activations, _ phase: Phase, bucket: Int? = nil) async throws -> Activations {
        let phase = manifest.runs(phase)
        let s = try await stage(phase, bucket: bucket)
        let prefix = prefixCaches[index].pair(bucket: bucket).current
        let suffix = phase == .decodeBranches ? suffixCaches[index].pair().current : [:]
        var inputs: [String: MLMultiArray] = [:]
        for (name, source) in wiring.chunkInputs[phase]?[index] ?? [:] {
            let array: MLMultiArray?
            switch source {
            case .hiddenStates: array = input.hidden
            case let .embeddingsOutput(n): array = s.shared[n]
            case let .hostMask(n): array = s.hostMasks[n]
            case let .cache(n): array = prefix[n]
            case let .suffixCache(n): array = suffix[n]
            case let .value(n): array = s.hostInputs[n] ?? s.chunkValues[n]  // the window's position, as the embeddings read it
            case let .carriedState(carried): array = carriedStates[carried]?[index]
            case let .carriedBranches(carried): array = carriedBranches[carried]?[index]
            case let .gathered(axis, rows): array = try gather(index, name, axis: axis, rows: rows, input, stage: s)
            case .chunkOutput, .perLayerInputs: array = nil
            }
            guard let array else { throw PipelineError.unwiredInput(model: manifest.chunks[index].model, input: name) }
            inputs[name] = array
        }
        var state: AnyObject?
        if !(wiring.chunkStates[phase]?[index] ?? []).isEmpty {
            guard let held = chunkStates?.state(index) else {
                throw PipelineError.unwiredInput(model: manifest.chunks[index].model, input: TensorNames.kCache)
            }
            state = held
        }
        var out = Activations(hidden: s.hidden[1 - input.slot], slot: 1 - input.slot, realTokens: input.realTokens,
                              perLayer: input.perLayer, bucket: input.bucket)
        var backings = s.chunkOutputs[index]
        // the chunk carrying a folded head outputs logits in place of hidden_states_out
        if s.chunkFunctions[index].output(TensorNames.hiddenStatesOut) != nil {
            backings[TensorNames.hiddenStatesOut] = out.hidden
        }
        try await predict(s.chunks[index], inputs: inputs, backings: backings, state: state)
        try carryStates(index, phase, outputs: s.chunkOutputs[index], realTokens: input.realTokens)
        if wiring.headFolded, index == manifest.chunks.count - 1 { out.logits = s.logits }
        return out
    }

    /// Chunk `index`'s input `name` of the stage `s`, its rows copied in from where they live now
    /// (`HostRows`): the step's per-layer inputs, an earlier chunk's current cache or suffix cache
    /// buffer (whole: a bucket's function reads their first positions) or its outputs of this step.
    /// A cache update still writing runs on the spare buffer, which is written again only after
    /// this step.
    private func gather(_ index: Int, _ name: String, axis: Int, rows: [HostRows], _ input: Activations,
                        stage s: Stage) throws -> MLMultiArray? {
        guard let target = s.gathered[index][name] else { return nil }
        var sources: [(array: MLMultiArray, rows: Range<Int>)] = []
        for block in rows {
            let array: MLMultiArray?
            switch block.place {
            case .perLayerInputs: array = input.perLayer
            case let .cache(c): array = prefixCaches[c].pair().current[block.tensor]
            case let .suffix(c): array = suffixCaches[c].pair().current[block.tensor]
            case let .output(c): array = s.chunkOutputs[c][block.tensor]
            }
            guard let array else { throw PipelineError.unwiredInput(model: manifest.chunks[index].model, input: name) }
            sources.append((array, block.rows))
        }
        try CoreMLArrays.gather(into: target, axis: axis, from: sources)
        return target
    }

    /// Moves chunk `index`'s carried states on after it ran `phase` (`CarryMode`): each state after
    /// the window's `realTokens` from the chunk's conv_new or delta_new, or each branch's after its
    /// step; nothing where the chunk has no such layers or writes its states itself.
    private func carryStates(_ index: Int, _ phase: Phase, outputs: [String: MLMultiArray], realTokens: Int) throws {
        for carried in CarriedState.allCases {
            let carry = wiring.carry(carried, phase, chunk: index)
            guard carry == .fromOutput || carry == .branches else { continue }
            let target = (carry == .fromOutput ? carriedStates : carriedBranches)[carried]?[index]
            guard let target, let new = outputs[carried.newName] else {
                throw PipelineError.unwiredInput(model: "\(manifest.chunks[index].model) (\(phase.rawValue))", input: carried.newName)
            }
            try CoreMLArrays.carry(carry == .fromOutput ? carried.afterWindow(realTokens: realTokens) : carried.afterBranchStep,
                                   target: target, source: new)
        }
    }

    /// Chunk `index`'s `carried` state where the chunk writes it itself: the array of that name in
    /// its Core ML state, handed to `body`.
    private func withHeldState(_ index: Int, _ carried: CarriedState, as input: String,
                               _ body: (MLMultiArray) throws -> Void) throws {
        guard #available(macOS 15.0, iOS 18.0, *), let held = chunkStates?.state(index) as? MLState else {
            throw PipelineError.unwiredInput(model: manifest.chunks[index].model, input: input)
        }
        try held.withMultiArray(for: carried.stateName, body)
    }

    /// Empties every chunk's conv and recurrent states: their arrays, or (state caches) those of its Core ML state.
    private func emptyCarriedStates() throws {
        for case let array? in carriedStates.values.joined() { CoreMLArrays.zero(array) }
        for carried in CarriedState.allCases {
            for i in manifest.chunks.indices where wiring.carry(carried, manifest.decodePhase, chunk: i) == .inState {
                try withHeldState(i, carried, as: carried.stateName) { CoreMLArrays.zero($0) }
            }
        }
    }

    /// Every cascade branch's conv and recurrent states become copies of the prefix's: chunk i's
    /// state arrays, or (state caches) those of its Core ML state.
    private func copyStatesToBranches() throws {
        for carried in CarriedState.allCases {
            for (i, branches) in (carriedBranches[carried] ?? []).enumerated() {
                guard let branches else { continue }
                if let state = carriedStates[carried]?[i] {
                    try CoreMLArrays.carry(carried.copyToBranches, target: branches, source: state)
                    continue
                }
                try withHeldState(i, carried, as: carried.branchesName) { state in
                    try CoreMLArrays.carry(carried.copyToBranches, target: branches, source: state)
                }
            }
        }
    }

    /// cache_update(phase at `bucket`) of chunk `index`: reads `cache`'s current buffers (a
    /// bucket's first positions of them) and the chunk's new K/V, writes the spare buffers, then
    /// swaps them.
    private func update(_ index: Int, _ phase: Phase, bucket: Int? = nil, _ cache: CacheBuffers,
                        _ values: [String: [Int32]]) async throws {
        let phase = manifest.runs(phase)
        let s = try await stage(phase, bucket: bucket)
        guard let function = s.updateFunctions[index], let updateModel = s.updates[index] else {
            guard manifest.cache.inStates && (phase == .prefill || phase == .decode) else {
                return  // a chunk of conv layers only keeps no K/V: nothing to write
            }
            throw ManifestError.inconsistent("chunk \(manifest.chunks[index].model) has no \(phase.rawValue) cache update: "
                + "its caches are Core ML states the chunk writes itself")
        }
        let (current, spare) = cache.pair(bucket: bucket)
        var inputs: [String: MLMultiArray] = [:]
        for (name, source) in wiring.updateInputs[phase]?[index] ?? [:] {
            switch source {
            case let .value(n):
                // Its own small array: the next window's embeddings may run while this update does.
                guard let v = values[n], let spec = function.input(n) else {
                    throw PipelineError.unwiredInput(model: "cache_update", input: name)
                }
                let array = try CoreMLArrays.make(spec)
                CoreMLArrays.write(v, into: array)
                inputs[name] = array
            case let .cache(n), let .suffixCache(n):
                guard let array = current[n] else { throw PipelineError.unwiredInput(model: "cache_update", input: name) }
                inputs[name] = array
            case let .chunkOutput(n):
                guard let array = s.chunkOutputs[index][n] else { throw PipelineError.unwiredInput(model: "cache_update", input: name) }
                inputs[name] = array
            case .hiddenStates, .embeddingsOutput, .hostMask, .carriedState, .carriedBranches, .perLayerInputs, .gathered:
                throw PipelineError.unwiredInput(model: "cache_update", input: name)
            }
        }
        var backings: [String: MLMultiArray] = [:]
        for spec in wiring.updatedState[phase]?[index] ?? [] {
            guard let array = spare[spec.name] else { throw PipelineError.unwiredInput(model: "cache_update", input: spec.name) }
            backings[spec.name + TensorNames.updatedSuffix] = array
        }
        try await predict(updateModel, inputs: inputs, backings: backings)
        cache.swap()
    }

    /// The LM head models of `phase` in the stage of `input`'s context bucket (none with a folded
    /// head: the last chunk has written the logits): the logits of each requested window column,
    /// all vocabulary splits of all models concatenated in split order.
    private func logits(_ input: Activations, _ phase: Phase, columns: [Int]) async throws -> [[Float]] {
        let phase = manifest.runs(phase)
        let s = try await stage(phase, bucket: input.bucket)
        for head in s.lmHeads {
            try await predict(head.model, inputs: [TensorNames.hiddenStates: input.hidden], backings: head.outputs)
        }
        let arrays = wiring.headFolded ? input.logits : s.logits
        guard !arrays.isEmpty else { throw GenerationError.badLogits(expected: manifest.config.vocabSize, got: 0) }
        return try columns.map { column in
            var out: [Float] = []
            out.reserveCapacity(manifest.config.vocabSize)
            for (_, array) in arrays { CoreMLArrays.appendColumn(array, column: column, to: &out) }
            guard out.count == manifest.config.vocabSize else {
                throw GenerationError.badLogits(expected: manifest.config.vocabSize, got: out.count)
            }
            return out
        }
    }

    // MARK: PipelineBackend

    public func embed(_ window: TokenWindow, bucket: Int) async throws -> Activations {
        if let masks {  // the prefill window decodes: the window's rows, positions and masks as the host makes them
            return try await embed(HostWindow.sequence(window, prefillLength: manifest.prefillLength, bucket: bucket, masks: masks),
                                   bucket: bucket)
        }
        let s = try await stage(window.phase, bucket: bucket)  // loaded on first use, with a state export's states
        if window.position == 0, manifest.cache.conv != nil || manifest.cache.delta != nil {
            try emptyCarriedStates()  // a new sequence: no earlier token's values in the conv or recurrent state
        }
        if let tokens = s.chunkValues[TensorNames.windowTokens] {
            CoreMLArrays.write([Int32(window.count)], into: tokens)  // the chunks keep their states after these
        }
        return try await embed(window.phase, bucket: bucket,
                               [TensorNames.inputIds: window.tokens, TensorNames.position: [Int32(window.position)]],
                               realTokens: window.count)
    }

    /// The prefill stage's embeddings at `bucket` of an export whose prefill window decodes: the
    /// window's ids and row positions to the embeddings; its masks into the stage's mask arrays and,
    /// with state caches, its write position into the chunks' `position`, for the chunks to read.
    public func embed(_ window: HostWindow, bucket: Int) async throws -> Activations {
        guard manifest.prefillDecodes else {
            throw ManifestError.inconsistent("a window with host-made masks for an export whose embeddings make them "
                + "(decode_function \"\(manifest.decodeFunction ?? "decode")\")")
        }
        let s = try await stage(.prefill, bucket: bucket)  // loaded on first use, with a state export's states
        if window.position == 0, manifest.cache.conv != nil || manifest.cache.delta != nil {
            try emptyCarriedStates()  // a new sequence: no earlier token's values in the conv or recurrent state
        }
        if let tokens = s.chunkValues[TensorNames.windowTokens] {
            CoreMLArrays.write([Int32(window.count)], into: tokens)  // the chunks keep their states after these
        }
        if let position = s.chunkValues[TensorNames.position] {
            CoreMLArrays.write([Int32(window.position)], into: position)  // where the chunks write the window's K/V
        }
        for (name, array) in s.hostMasks {
            guard let mask = window.masks[name] else {
                throw PipelineError.unwiredInput(model: manifest.chunks.first?.model ?? "chunk_0", input: name)
            }
            try CoreMLArrays.write(mask, into: array)
        }
        return try await embed(.prefill, bucket: bucket, [TensorNames.inputIds: window.tokens, TensorNames.positions: window.positions],
                               realTokens: window.count)
    }

    public func runChunk(_ index: Int, _ input: Activations, phase: Phase, bucket: Int) async throws -> Activations {
        try await chunk(index, input, phase, bucket: bucket)
    }

    public func updateCache(_ index: Int, phase: Phase, bucket: Int, position: Int) async throws {
        try await update(index, phase, bucket: bucket, prefixCaches[index], [TensorNames.position: [Int32(position)]])
    }

    public func logits(_ input: Activations, phase: Phase, column: Int) async throws -> [Float] {
        try await logits(input, phase, columns: [column])[0]
    }

    public func logits(_ input: Activations, phase: Phase, columns: [Int]) async throws -> [[Float]] {
        try await logits(input, phase, columns: columns)
    }

    public func resetCaches() async throws {
        prefixCaches.forEach { $0.zero() }
        suffixCaches.forEach { $0.zero() }
        for case let array? in (Array(carriedStates.values) + Array(carriedBranches.values)).joined() { CoreMLArrays.zero(array) }
        try chunkStates?.reset()
    }

    // MARK: BranchBackend

    public func embedBranches(_ step: BranchStep) async throws -> Activations {
        try await embed(.decodeBranches, [
            TensorNames.inputIds: step.tokens,
            TensorNames.positions: step.suffixPositions.map { Int32(step.prefixLength + $0) },
            TensorNames.prefixLength: [Int32(step.prefixLength)],
        ])
    }

    public func runBranchChunk(_ index: Int, _ input: Activations) async throws -> Activations {
        try await chunk(index, input, .decodeBranches)
    }

    public func updateSuffix(_ index: Int, suffixPositions: [Int32]) async throws {
        try await update(index, .decodeBranches, suffixCaches[index], [TensorNames.suffixPositions: suffixPositions])
    }

    public func branchLogits(_ input: Activations) async throws -> [[Float]] {
        try await logits(input, .decodeBranches, columns: Array(0..<branchWidth))
    }

    public func resetSuffixes() async throws {
        if chunkStates?.made == false {
            _ = try await stage(.decodeBranches)  // the states the branches copy from, made with the stages they need
        }
        suffixCaches.forEach { $0.zero() }
        try copyStatesToBranches()  // each branch starts from the prefix's conv and recurrent states
    }

    // MARK: VerifyBackend

    public func embedTree(_ window: TreeWindow) async throws -> Activations {
        try await embed(.verify, [
            TensorNames.inputIds: window.tokens,
            TensorNames.position: [Int32(window.position)],
            TensorNames.depths: window.depths,
        ], floats: [TensorNames.treeMask: window.treeMask])
    }

    public func acceptTree(_ index: Int, slots: [Int32]) async throws {
        try await update(index, .verify, prefixCaches[index],
                         [TensorNames.slots: slots, TensorNames.ringSlots: RingSlots.of(slots, ring: manifest.cache.ringLength)])
    }

    public func treeLogits(_ input: Activations, count: Int) async throws -> [[Float]] {
        try await logits(input, .verify, columns: Array(0..<count))
    }
}
#endif
