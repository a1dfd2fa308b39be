/// A `PipelineBackend` that also has the cascade ("decode_branches") functions: one token for
/// each of `branchWidth` branches per step, over the shared prefix held in the ordinary caches and
/// a private suffix cache per branch.
public protocol BranchBackend: PipelineBackend {
    /// B of the exported "decode_branches" functions (0 when the export has none).
    var branchWidth: Int { get }
    /// Tokens each branch's suffix cache holds.
    var suffixLength: Int { get }
    /// embeddings(decode_branches): the step's tokens at positions prefix + suffix position.
    func embedBranches(_ step: BranchStep) async throws -> Activations
    /// chunk_i(decode_branches): reads the prefix cache and the suffix caches, keeps k_new, v_new.
    func runBranchChunk(_ index: Int, _ input: Activations) async throws -> Activations
    /// cache_update(decode_branches of chunk i): writes each slot's new K/V at its suffix position.
    func updateSuffix(_ index: Int, suffixPositions: [Int32]) async throws
    /// lm_head(decode_branches): one logits vector per slot (a folded head: the last chunk's).
    func branchLogits(_ input: Activations) async throws -> [[Float]]
    /// Empties every suffix cache (a new group of branches).
    func resetSuffixes() async throws
}

extension ChunkedPipeline where Backend: BranchBackend {
    /// One cascade step, in the same order as a window: embeddings, each chunk (after its previous
    /// suffix update), suffix updates in the background, LM head.
    public func decodeBranches(_ step: BranchStep) async throws -> [[Float]] {
        try await finishUpdates()  // the prefix cache must be complete before branches read it
        if step.startsGroup {
            try await branchUpdates.waitAll()
            try await backend.resetSuffixes()
        }
        var x = try await backend.embedBranches(step)
        let positions = step.suffixPositions.map { Int32($0) }
        for i in 0..<backend.chunkCount {
            try await branchUpdates.wait(i)
            x = try await backend.runBranchChunk(i, x)
            let backend = self.backend
            await branchUpdates.submit(i) { try await backend.updateSuffix(i, suffixPositions: positions) }
        }
        return try await backend.logits(forBranches: x)
    }

    /// Prefills `prefix` once, then decodes every branch over it with the cascade scheduler: through
    /// the "decode_branches" functions, or where the cascade steps through the prefill window
    /// (`windowCascadeWidth`), through that window (`decodeBranchesInWindow`).
    /// Throws `contextFull` when the prefix does not fit the cache.
    public func decodeBranches(prefix: [Int], branches: [BranchRequest], eosTokenIds: Set<Int>) async throws -> [BranchResult] {
        if windowCascadeWidth > 0 {
            return try await decodeBranchesInWindow(prefix: prefix, branches: branches, eosTokenIds: eosTokenIds)
        }
        guard backend.branchWidth > 0 else { throw GenerationError.noBranchWidth }
        let (cache, logits) = try await prefillPrefix(prefix)
        let scheduler = CascadeScheduler(branchWidth: backend.branchWidth, prefixLength: cache.position,
                                         suffixCapacity: backend.suffixLength, eosTokenIds: eosTokenIds)
        let results = try await scheduler.run(branches, prefixLogits: logits) { try await self.decodeBranches($0) }
        try await branchUpdates.waitAll()
        return results
    }
}

extension BranchBackend {
    fileprivate func logits(forBranches x: Activations) async throws -> [[Float]] {
        let out = try await branchLogits(x)
        guard out.count == branchWidth else { throw GenerationError.badLogits(expected: branchWidth, got: out.count) }
        return out
    }
}
