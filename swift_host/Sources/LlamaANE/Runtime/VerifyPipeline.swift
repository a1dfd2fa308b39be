/// A `PipelineBackend` that also has the "verify" functions (speculative decoding): a token tree
/// of `verifyWindow` W tokens through the embeddings, the chunks' verify functions (their window
/// graph at S = W, run with `runChunk(_:_:phase: .verify, bucket:)` at the whole context) and the LM head; and the verify cache
/// update, which writes only the accepted tokens' K/V.
public protocol VerifyBackend: PipelineBackend {
    /// W of the exported "verify" functions (0 when the export has none).
    var verifyWindow: Int { get }
    /// embeddings(verify): `input_ids` (1, W), `position` (1,), `depths` (W,) and `tree_mask`
    /// (1, 1, W, W) -> hidden states (1, C, 1, W), cos, sin (1, D, 1, W), mask (1, 1, W, T + W).
    func embedTree(_ window: TreeWindow) async throws -> Activations
    /// cache_update(verify of chunk i): writes the k_new, v_new (L, KV, 1, W) that chunk i's last
    /// verify run kept, column j at cache position `slots[j]` (W,), none where it is -1.
    func acceptTree(_ index: Int, slots: [Int32]) async throws
    /// lm_head(verify): the logits of window columns 0 ..< count, all vocabulary splits concatenated
    /// (a folded head: the last chunk's).
    func treeLogits(_ input: Activations, count: Int) async throws -> [[Float]]
}

extension ChunkedPipeline: TreeVerifier where Backend: VerifyBackend {
    /// W, or 0 when the backend has no verify functions or the caches are Core ML states.
    public var verifyWindow: Int { cacheInStates ? 0 : backend.verifyWindow }

    /// The tree through the same chunk schedule as a window (each chunk after its own pending
    /// cache update); the chunks' new K/V wait in the backend for `accept`.
    public func verify(_ window: TreeWindow) async throws -> [[Float]] {
        guard verifyWindow > 0 else { throw GenerationError.noVerifyWindow }
        precondition(window.width == verifyWindow, "a tree window of \(window.width) tokens for verify functions of \(verifyWindow)")
        guard window.end <= contextLength else {
            throw GenerationError.contextFull(position: window.position, requested: window.end - window.position, capacity: contextLength)
        }
        let x = try await runChunks(try await backend.embedTree(window), phase: .verify, bucket: contextLength) { _ in }
        let logits = try await backend.treeLogits(x, count: window.count)
        guard logits.count == window.count else { throw GenerationError.badLogits(expected: window.count, got: logits.count) }
        return logits
    }

    /// Each chunk's verify cache update with the slots that keep `path`, in the background like a
    /// window's cache updates (a chunk runs again only after its update has finished).
    public func accept(_ window: TreeWindow, path: [Int]) async throws {
        let slots = window.slots(keeping: path)
        let backend = self.backend
        for i in 0..<backend.chunkCount {
            await updates.submit(i) { try await backend.acceptTree(i, slots: slots) }
        }
    }
}
