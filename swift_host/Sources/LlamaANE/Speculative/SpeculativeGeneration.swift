extension Generator {
    /// The decode loop of a speculative generation, as Python's `SpeculativeDecoder.tokens`, from
    /// the `logits` after the prompt (which the cache holds).
    ///
    /// Each step starts from the root, the last sampled token, streamed but not cached yet. When
    /// the decoder drafts nothing (the first step, no match, no room, no tree worth a window) the
    /// root is fed the plain way. Otherwise its tree runs in one verify window (timed with its
    /// drafting, as a verify step's cost), the decoder keeps the path the
    /// model agrees with, only that path (the root and the accepted drafts) is written to the
    /// cache, the drafts are streamed, and the model's own next token is the next root. When the
    /// generation ends on an accepted draft, that draft and those after it leave the cache again,
    /// so that it holds what plain decoding would have fed.
    func decodeSpeculatively(_ verifier: TreeVerifier, _ decoder: SpeculativeDecoder, prompt: [Int], logits: [Float],
                             overflow: ContextOverflow, cache: inout KVCacheState, stats: inout GenerationStats,
                             events: inout TokenEvents, emit: (GenerationEvent) -> Void) async throws {
        var decoder = decoder
        defer { stats.speculative = decoder.stats }
        let clock = ContinuousClock()
        var history = prompt
        var root = decoder.draw(logits)
        generation: while true {
            let (event, done) = events.next(root, stats: &stats)
            emit(event)
            if done { break }
            history.append(root)
            if cache.position >= cache.capacity, overflow == .stop {  // no room to feed the root
                stats.stopReason = .context
                break
            }
            try Task.checkCancellation()
            let drafting = clock.now
            let tree = decoder.tree(after: history, room: cache.capacity - cache.position - 1)
            guard tree.count > 1 else {
                let start = clock.now
                let next = try await feed(root, overflow: overflow, cache: &cache, stats: &stats)
                decoder.recordDecode(seconds: Self.seconds(clock.now - start))
                root = decoder.draw(next)
                continue
            }
            let window = TreeWindow(tree: tree, position: cache.position, width: verifier.verifyWindow)
            let (path, next) = try await verify(window, of: tree, on: verifier, decoder: &decoder, recordingIn: &cache)
            decoder.recordVerify(seconds: Self.seconds(clock.now - drafting), tree: tree, path: path)
            for (i, node) in path.dropFirst().enumerated() {
                let (event, done) = events.next(tree.tokens[node], stats: &stats)
                emit(event)
                if done {  // this draft and the ones after it were cached but never fed
                    cache.rewind(to: cache.position - (path.count - 1 - i))
                    store(cache)
                    break generation
                }
                history.append(tree.tokens[node])
            }
            root = next
        }
    }

    /// Runs `window` (the layout of `tree`), lets `decoder` choose the accepted path and the next
    /// token, writes the path to the cache and records it in `cache`. When a model call fails (other
    /// than by cancellation) the record is emptied, as for a window: the next prompt starts over.
    private func verify(_ window: TreeWindow, of tree: DraftTree, on verifier: TreeVerifier,
                        decoder: inout SpeculativeDecoder,
                        recordingIn cache: inout KVCacheState) async throws -> (path: [Int], next: Int) {
        let chosen: (path: [Int], next: Int)
        do {
            let logits = try await verifier.verify(window)
            chosen = decoder.choose(tree, logits: logits)
            try await verifier.accept(window, path: chosen.path)
        } catch {
            if !(error is CancellationError) { cache.reset(); store(cache) }
            throw error
        }
        cache.commitAccepted(window.tokens(along: chosen.path))
        store(cache)
        return chosen
    }
}
