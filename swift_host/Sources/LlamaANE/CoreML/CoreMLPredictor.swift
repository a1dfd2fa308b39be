#if canImport(CoreML)
import CoreML
import Foundation

extension ExportedModel {
    /// The Core ML pipeline for this export: each stage's functions loaded by the load plan on
    /// the first use of its phase and context bucket (packages compiled on first use and cached),
    /// buffers preallocated, cache updates run in the background (or, for a `--kv-cache state`
    /// export, the caches held in Core ML states that the chunks update; where the prefill window
    /// decodes, every window and cascade step runs the prefill functions with the host's masks).
    public func makeCoreMLPredictor(computeUnits: MLComputeUnits = .cpuAndNeuralEngine,
                                    cacheDirectory: URL? = nil) async throws -> ChunkedPipeline<CoreMLBackend> {
        let store = CoreMLModelStore(folder: folder, manifest: manifest, computeUnits: computeUnits,
                                     cacheDirectory: cacheDirectory)
        let backend = try await CoreMLBackend.load(manifest: manifest, store: store)
        return ChunkedPipeline(backend: backend, manifest: manifest)
    }
}
#endif
