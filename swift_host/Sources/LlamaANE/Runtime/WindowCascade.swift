/// The cascade of an export that steps it through the prefill window (`Manifest.windowCascade`:
/// its prefill window decodes and every layer attends over the one cache; no "decode_branches"
/// functions). As Python's `CascadeDecoder.window_step`: a step runs its group of G <= B branches as
/// the first G rows of one prefill window, branch b's token at position prefix + (its tokens written
/// so far), their K/V written side by side after the shared prefix (branch b's i-th token in column
/// prefix + i*G + b: the step's columns from prefix + step*G on), each row seeing the prefix, its own
/// branch's tokens and itself (`HostMasks.branchMasks`). The logits of rows 0..<G are the branches'.
/// A group after the first starts again at the prefix: its masks hide what the group before wrote.
/// The branches share the context, so prefix + G x (a branch's own and new tokens) must fit it.
extension ChunkedPipeline {
    /// Prefills `prefix` once, then decodes every branch over it through the prefill window, in
    /// groups of `windowCascadeWidth`. Throws `contextFull` before any model call when the branches
    /// side by side after the prefix would not fit the context, `noBranchWidth` where the export's
    /// cascade does not step through the window.
    public func decodeBranchesInWindow(prefix: [Int], branches: [BranchRequest],
                                       eosTokenIds: Set<Int>) async throws -> [BranchResult] {
        guard windowCascadeWidth > 0 else { throw GenerationError.noBranchWidth }
        try checkWindowCascadeBudget(prefix: prefix.count, branches)
        let (cache, logits) = try await prefillPrefix(prefix)
        // no suffix caches: the budget above is what bounds a branch
        let scheduler = CascadeScheduler(branchWidth: windowCascadeWidth, prefixLength: cache.position,
                                         suffixCapacity: .max, eosTokenIds: eosTokenIds)
        let results = try await scheduler.run(branches, prefixLogits: logits) { try await self.windowBranchStep($0) }
        try await finishUpdates()
        return results
    }

    /// Refuses branches that would not fit side by side after a prefix of `prefix` tokens: a group
    /// of G branches (the most of `branchWidth` and the branches given) takes G columns per step, a
    /// branch at most its own tokens and its new ones (Python's `CascadeDecoder.check_budget`).
    func checkWindowCascadeBudget(prefix: Int, _ branches: [BranchRequest]) throws {
        guard prefix > 0 else { throw GenerationError.emptyPrompt }
        guard prefix <= contextLength else {
            throw GenerationError.contextFull(position: 0, requested: prefix, capacity: contextLength)
        }
        let need = branches.map { $0.forcedTokens.count + max($0.maxNewTokens, 0) }.max() ?? 0
        let group = min(branches.count, windowCascadeWidth)
        guard prefix + need * group <= contextLength else {
            throw GenerationError.contextFull(position: prefix, requested: need * group, capacity: contextLength)
        }
    }

    /// One cascade step through the prefill window (`step` from `CascadeScheduler`, whose group's
    /// branches fill its first slots): the window of the group's G branches, written after the
    /// step's earlier ones, through the embeddings, every chunk (and with input caches each chunk's
    /// prefill cache update at the step's first column) and the LM head. Returns one logits vector
    /// per slot: rows 0..<G the branches', empty for the slots past the group.
    public func windowBranchStep(_ step: BranchStep) async throws -> [[Float]] {
        guard windowCascadeWidth > 0, let masks = hostMasks else { throw GenerationError.noBranchWidth }
        let g = step.branches.prefix { $0 != nil }.count
        guard g > 0, g <= windowCascadeWidth, step.branches.dropFirst(g).allSatisfy({ $0 == nil }) else {
            throw GenerationError.badLogits(expected: windowCascadeWidth, got: g)
        }
        let base = HostWindow.branchBase(prefix: step.prefixLength, group: g, steps: step.step)
        let bucket = buckets.bucket(holding: base + g)
        let window = HostWindow.branches(tokens: Array(step.tokens.prefix(g)), seen: Array(step.written.prefix(g)),
                                         steps: step.step, prefix: step.prefixLength, prefillLength: prefillLength,
                                         bucket: bucket, masks: masks)
        let x = try await run(window, bucket: bucket)
        let rows = try await backend.logits(x, phase: .prefill, columns: Array(0..<g))
        guard rows.count == g else { throw GenerationError.badLogits(expected: g, got: rows.count) }
        return rows + Array(repeating: [], count: step.branches.count - g)
    }

    /// A fresh cache holding `prefix`, prefilled in windows, and the logits after its last token:
    /// where every cascade begins.
    func prefillPrefix(_ prefix: [Int]) async throws -> (KVCacheState, [Float]) {
        try await reset()
        var cache = emptyCache()
        var logits: [Float] = []
        for window in try cache.prefillWindows(prefix) {
            logits = try await predict(window)
            cache.commit(window)
        }
        return (cache, logits)
    }
}
