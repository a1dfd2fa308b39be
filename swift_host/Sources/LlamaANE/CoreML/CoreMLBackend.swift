#if canImport(CoreML)
import CoreML
import Foundation

/// The exported Core ML programs behind `PipelineBackend`: embeddings, the block chunks, the LM
/// head and the cache-update functions, with every tensor preallocated once.
///
/// Nothing is copied between stages: each stage writes into IOSurface-backed arrays given as
/// `outputBackings`, and the next stage reads them as inputs. Activations ping-pong between two
/// hidden-state buffers. Each chunk's cache is double-buffered: the cache update reads the current
/// buffer and writes the other, which becomes current when it finishes.
public final class CoreMLBackend: PipelineBackend, @unchecked Sendable {
    /// The activations between stages: which hidden-state buffer holds the current values.
    public struct Activations {
        let hidden: MLMultiArray
        let slot: Int
    }

    /// The functions and buffers of one phase (prefill or decode).
    private struct Stage {
        let embeddings: MLModel
        let chunks: [MLModel]
        let cacheUpdates: [MLModel]
        let lmHead: MLModel
        let chunkFunctions: [Manifest.Function]
        let updateFunctions: [Manifest.Function]
        let lmHeadFunction: Manifest.Function
        let inputIds: MLMultiArray
        let position: MLMultiArray
        let hidden: [MLMultiArray]
        /// Embedding outputs other than the hidden states (cos, sin, mask), by name.
        let shared: [String: MLMultiArray]
        /// Per chunk, the outputs other than the hidden states (k_new, v_new), by name.
        let chunkOutputs: [[String: MLMultiArray]]
        /// The LM head's logits outputs in vocabulary order.
        let logits: [(name: String, array: MLMultiArray)]
    }

    /// One chunk's K and V caches, double-buffered.
    private final class ChunkCache: @unchecked Sendable {
        private let lock = NSLock()
        private var buffers: [[String: MLMultiArray]]
        private var current = 0

        init(_ buffers: [[String: MLMultiArray]]) { self.buffers = buffers }

        /// (current, spare) buffers by input name ("k_cache", "v_cache").
        func pair() -> (current: [String: MLMultiArray], spare: [String: MLMultiArray]) {
            lock.lock(); defer { lock.unlock() }
            return (buffers[current], buffers[1 - current])
        }

        func swap() { lock.lock(); current = 1 - current; lock.unlock() }

        func zero() {
            lock.lock(); defer { lock.unlock() }
            current = 0
            for set in buffers { set.values.forEach(CoreMLArrays.zero) }
        }
    }

    public let manifest: Manifest
    private let stages: [Phase: Stage]
    private let caches: [ChunkCache]

    public var chunkCount: Int { manifest.chunks.count }

    /// Loads every function the manifest names (compiling packages on first use) and allocates
    /// all buffers.
    public static func load(manifest: Manifest, store: CoreMLModelStore) async throws -> CoreMLBackend {
        var stages: [Phase: Stage] = [:]
        for phase in Phase.allCases { stages[phase] = try await makeStage(phase, manifest: manifest, store: store) }
        var caches: [ChunkCache] = []
        for chunk in manifest.chunks {
            let decode = try manifest.function(chunk.model, Phase.decode.rawValue)
            var sets: [[String: MLMultiArray]] = []
            for _ in 0..<2 {
                var set: [String: MLMultiArray] = [:]
                for name in [TensorNames.kCache, TensorNames.vCache] {
                    guard let spec = decode.input(name) else {
                        throw CoreMLPipelineError.unwiredInput(model: chunk.model, input: name)
                    }
                    set[name] = try CoreMLArrays.make(spec)
                }
                sets.append(set)
            }
            caches.append(ChunkCache(sets))
        }
        return CoreMLBackend(manifest: manifest, stages: stages, caches: caches)
    }

    private init(manifest: Manifest, stages: [Phase: Stage], caches: [ChunkCache]) {
        self.manifest = manifest
        self.stages = stages
        self.caches = caches
    }

    private static func makeStage(_ phase: Phase, manifest: Manifest, store: CoreMLModelStore) async throws -> Stage {
        let p = phase.rawValue
        let embeddingsFunction = try manifest.function("embeddings", p)
        let lmHeadFunction = try manifest.function("lm_head", p)
        let chunkFunctions = try manifest.chunks.map { try manifest.function($0.model, p) }
        let updateFunctions = try manifest.chunks.map { chunk -> Manifest.Function in
            guard let name = chunk.cacheUpdate[p] else {
                throw ManifestError.inconsistent("chunk \(chunk.model) names no \(p) cache update")
            }
            return try manifest.function("cache_update", name)
        }

        var shared: [String: MLMultiArray] = [:]
        var hidden: [MLMultiArray] = []
        for spec in embeddingsFunction.outputs {
            if spec.name == TensorNames.hiddenStates {
                hidden = [try CoreMLArrays.make(spec), try CoreMLArrays.make(spec)]
            } else {
                shared[spec.name] = try CoreMLArrays.make(spec)
            }
        }
        guard hidden.count == 2 else {
            throw CoreMLPipelineError.unwiredInput(model: "embeddings", input: TensorNames.hiddenStates)
        }
        let chunkOutputs = try chunkFunctions.map { f in
            try Dictionary(uniqueKeysWithValues: f.outputs.filter { $0.name != TensorNames.hiddenStatesOut }
                .map { ($0.name, try CoreMLArrays.make($0)) })
        }
        let logits = try lmHeadFunction.outputs.filter { $0.name.hasPrefix(TensorNames.logitsPrefix) }
            .sorted { Int($0.name.dropFirst(TensorNames.logitsPrefix.count)) ?? 0 < Int($1.name.dropFirst(TensorNames.logitsPrefix.count)) ?? 0 }
            .map { (name: $0.name, array: try CoreMLArrays.make($0)) }
        guard let idsSpec = embeddingsFunction.input(TensorNames.inputIds),
              let positionSpec = embeddingsFunction.input(TensorNames.position) else {
            throw CoreMLPipelineError.unwiredInput(model: "embeddings", input: "\(TensorNames.inputIds)/\(TensorNames.position)")
        }

        var chunks: [MLModel] = [], updates: [MLModel] = []
        for f in chunkFunctions { chunks.append(try await store.model(for: f)) }
        for f in updateFunctions { updates.append(try await store.model(for: f)) }
        return Stage(embeddings: try await store.model(for: embeddingsFunction), chunks: chunks, cacheUpdates: updates,
                     lmHead: try await store.model(for: lmHeadFunction), chunkFunctions: chunkFunctions,
                     updateFunctions: updateFunctions, lmHeadFunction: lmHeadFunction,
                     inputIds: try CoreMLArrays.make(idsSpec), position: try CoreMLArrays.make(positionSpec),
                     hidden: hidden, shared: shared, chunkOutputs: chunkOutputs, logits: logits)
    }

    private func stage(_ phase: Phase) -> Stage { stages[phase]! }

    /// Runs one prediction whose outputs land in `backings`.
    private func predict(_ model: MLModel, inputs: [String: MLMultiArray], backings: [String: MLMultiArray]) async throws {
        let provider = try MLDictionaryFeatureProvider(dictionary: inputs.mapValues { MLFeatureValue(multiArray: $0) })
        let options = MLPredictionOptions()
        options.outputBackings = backings
        if #available(macOS 14.0, iOS 17.0, *) {
            _ = try await model.prediction(from: provider, options: options)
        } else {
            _ = try model.prediction(from: provider, options: options)
        }
    }

    public func embed(_ window: TokenWindow) async throws -> Activations {
        let s = stage(window.phase)
        CoreMLArrays.write(window.tokens, into: s.inputIds)
        CoreMLArrays.write([Int32(window.position)], into: s.position)
        var backings = s.shared
        backings[TensorNames.hiddenStates] = s.hidden[0]
        try await predict(s.embeddings, inputs: [TensorNames.inputIds: s.inputIds, TensorNames.position: s.position],
                          backings: backings)
        return Activations(hidden: s.hidden[0], slot: 0)
    }

    public func runChunk(_ index: Int, _ input: Activations, phase: Phase) async throws -> Activations {
        let s = stage(phase)
        let cache = caches[index].pair().current
        var inputs: [String: MLMultiArray] = [:]
        for spec in s.chunkFunctions[index].inputs {
            if spec.name == TensorNames.hiddenStates {
                inputs[spec.name] = input.hidden
            } else if let array = cache[spec.name] ?? s.shared[spec.name] {
                inputs[spec.name] = array
            } else {
                throw CoreMLPipelineError.unwiredInput(model: manifest.chunks[index].model, input: spec.name)
            }
        }
        let out = Activations(hidden: s.hidden[1 - input.slot], slot: 1 - input.slot)
        var backings = s.chunkOutputs[index]
        backings[TensorNames.hiddenStatesOut] = out.hidden
        try await predict(s.chunks[index], inputs: inputs, backings: backings)
        return out
    }

    public func updateCache(_ index: Int, phase: Phase, position: Int) async throws {
        let s = stage(phase)
        let (current, spare) = caches[index].pair()
        // Its own position array: the next window's embeddings may run while this update does.
        guard let positionSpec = s.updateFunctions[index].input(TensorNames.position) else {
            throw CoreMLPipelineError.unwiredInput(model: "cache_update", input: TensorNames.position)
        }
        let positionArray = try CoreMLArrays.make(positionSpec)
        CoreMLArrays.write([Int32(position)], into: positionArray)
        var inputs: [String: MLMultiArray] = [TensorNames.position: positionArray]
        for spec in s.updateFunctions[index].inputs where spec.name != TensorNames.position {
            guard let array = current[spec.name] ?? s.chunkOutputs[index][spec.name] else {
                throw CoreMLPipelineError.unwiredInput(model: "cache_update", input: spec.name)
            }
            inputs[spec.name] = array
        }
        guard let k = spare[TensorNames.kCache], let v = spare[TensorNames.vCache] else {
            throw CoreMLPipelineError.unwiredInput(model: "cache_update", input: TensorNames.kCache)
        }
        try await predict(s.cacheUpdates[index], inputs: inputs,
                          backings: [TensorNames.kCacheOut: k, TensorNames.vCacheOut: v])
        caches[index].swap()
    }

    public func logits(_ input: Activations, phase: Phase, column: Int) async throws -> [Float] {
        let s = stage(phase)
        try await predict(s.lmHead, inputs: [TensorNames.hiddenStates: input.hidden],
                          backings: Dictionary(uniqueKeysWithValues: s.logits.map { ($0.name, $0.array) }))
        var out: [Float] = []
        out.reserveCapacity(manifest.config.vocabSize)
        for (_, array) in s.logits { CoreMLArrays.appendColumn(array, column: column, to: &out) }
        guard out.count == manifest.config.vocabSize else {
            throw GenerationError.badLogits(expected: manifest.config.vocabSize, got: out.count)
        }
        return out
    }

    public func resetCaches() async throws {
        caches.forEach { $0.zero() }
    }
}
#endif
