import Foundation

/// What a generation stream yields.
public enum GenerationEvent: Equatable, Sendable {
    /// A new token and the text it completed (may be empty while a character is incomplete).
    case token(id: Int, text: String)
    /// The end, with timings.
    case finished(GenerationStats)
}

/// What a generation does when its tokens would not fit the context.
public enum ContextOverflow: Equatable, Sendable {
    /// Refuse a prompt that does not fit; finish with `.context` when decoding fills the cache.
    case stop
    /// Keep the first `keep` tokens (a system prompt) and the most recent ones (half the rest of the
    /// context), prefill what the cache does not already hold, and go on.
    case shift(keep: Int)
}

/// Token counts and speeds of one generation.
public struct GenerationStats: Equatable, Sendable {
    public var promptTokens: Int
    public var generatedTokens: Int
    public var prefillSeconds: Double
    public var decodeSeconds: Double
    public var stopReason: FinishReason
    /// Prompt tokens whose K/V the cache already held (a common prefix with the previous generation).
    public var reusedTokens = 0
    /// Prompt tokens that ran through prefill: `promptTokens - reusedTokens` (0 when nothing ran).
    public var prefilledTokens = 0
    /// Context shifts (`ContextOverflow.shift`): of a prompt longer than the context, and each time
    /// decoding filled it.
    public var shifts = 0
    /// Verify steps, plain steps and accepted drafts of a speculative generation; nil otherwise.
    public var speculative: SpeculativeStats?

    /// Prefill speed over the prompt tokens that actually ran.
    public var prefillTokensPerSecond: Double { prefillSeconds > 0 ? Double(prefilledTokens) / prefillSeconds : 0 }
    /// Decode speed over the tokens produced by decode steps (the first comes from prefill).
    public var decodeTokensPerSecond: Double {
        decodeSeconds > 0 ? Double(max(generatedTokens - 1, 0)) / decodeSeconds : 0
    }
}

/// Generates tokens from a `TokenPredictor`: prefill windows for the prompt, then one decode
/// step per token, streaming each token (and its text) through an `AsyncThrowingStream`.
///
/// The generator keeps one KV cache across generations and records the token ids it holds
/// (`cachedTokens`). A prompt keeps the longest common prefix it shares with them (all but its last
/// token at most), rewinds the cache to it and prefills only the rest, so the next turn of a
/// conversation prefills only its new tokens (see `Conversation`). Afterwards the cache holds the
/// prompt and every generated token that was fed back: all but the last (an end-of-sequence token,
/// or the one that reached `maxNewTokens`, is never fed).
///
/// Stops at an end-of-sequence id (`FinishReason.eos`), after `maxNewTokens` (`.length`) or when the
/// cache is full (`.context`), as the Python runtime does. With `overflow: .stop` (the default) a
/// prompt that does not fit the cache is refused before any model call
/// (`GenerationError.contextFull`). With `.shift(keep:)` the generation shifts the context instead
/// (the first `keep` tokens and the most recent ones are kept) and goes on.
///
/// With `speculative`, a drafter proposes token trees after each sampled token and the predictor's
/// "verify" function checks each tree in one window (`TreeVerifier`); only the accepted tokens
/// reach the cache, which afterwards holds what plain decoding would have fed. Greedy decoding
/// gives the very same tokens; sampling draws them from the same distributions, with Python's
/// rule and generator (`TreeAcceptance`), so the same seed gives Python's tokens.
///
/// Generations run one at a time, in the order they were started: a new one waits until the
/// previous one (also a cancelled one) has left the model. The generator assumes it alone writes the
/// predictor's cache; after using the predictor elsewhere (e.g. `decodeBranches`), call `resetCache()`.
public final class Generator: @unchecked Sendable {
    public let predictor: TokenPredictor
    public let eosTokenIds: Set<Int>
    private let decode: (([Int]) -> String)?
    private let jobs = SerialJobs()
    private let lock = NSLock()
    /// What the predictor's cache holds; read and written under `lock`.
    private var cache: KVCacheState

    /// - Parameters:
    ///   - decode: ids -> text, for the `text` of each event; nil leaves texts empty.
    public init(predictor: TokenPredictor, eosTokenIds: Set<Int>, decode: (([Int]) -> String)? = nil) {
        self.predictor = predictor
        self.eosTokenIds = eosTokenIds
        self.decode = decode
        cache = predictor.emptyCache()
    }

    /// The token ids whose K/V the predictor's cache holds, in order (their count is the position).
    public var cachedTokens: [Int] { cacheState.tokens }

    /// Starts generating; cancelling the consuming task stops it after the current model call.
    public func generate(prompt: [Int], maxNewTokens: Int, sampling: SamplingParameters = .greedy,
                         overflow: ContextOverflow = .stop,
                         speculative: SpeculativeDecoding? = nil) -> AsyncThrowingStream<GenerationEvent, Error>
    {
        AsyncThrowingStream { continuation in
            let task = Task {
                do {
                    let stats = try await self.jobs.run {
                        try await self.run(prompt: prompt, maxNewTokens: maxNewTokens, sampling: sampling,
                                           overflow: overflow, speculative: speculative) {
                            continuation.yield($0)
                        }
                    }
                    continuation.yield(.finished(stats))
                    continuation.finish()
                } catch {
                    continuation.finish(throwing: error)
                }
            }
            continuation.onTermination = { _ in task.cancel() }
        }
    }

    /// Generates to the end and returns the new token ids and the stats.
    public func generateAll(prompt: [Int], maxNewTokens: Int, sampling: SamplingParameters = .greedy,
                            overflow: ContextOverflow = .stop, speculative: SpeculativeDecoding? = nil)
        async throws -> (tokens: [Int], stats: GenerationStats)
    {
        var tokens: [Int] = []
        for try await event in generate(prompt: prompt, maxNewTokens: maxNewTokens, sampling: sampling,
                                        overflow: overflow, speculative: speculative) {
            switch event {
            case let .token(id, _): tokens.append(id)
            case let .finished(stats): return (tokens, stats)
            }
        }
        throw CancellationError()  // the stream ended without finishing: the caller was cancelled
    }

    /// Forgets the cached tokens and empties the predictor's cache, after the running generation.
    /// Only needed when something else has written the predictor's cache: a prompt that shares no
    /// prefix with the cached tokens already starts over at position 0.
    public func resetCache() async throws {
        try await jobs.run {
            self.store(self.predictor.emptyCache())
            try await self.predictor.reset()
        }
    }

    private func run(prompt fullPrompt: [Int], maxNewTokens: Int, sampling: SamplingParameters,
                     overflow: ContextOverflow, speculative: SpeculativeDecoding?,
                     emit: (GenerationEvent) -> Void) async throws -> GenerationStats {
        // Refused before any model call: no verify function, or a draft size that does not fit it.
        let speculation = try speculative.map { options -> (TreeVerifier, SpeculativeDecoder) in
            guard let verifier = predictor as? TreeVerifier else { throw GenerationError.noVerifyWindow }
            return (verifier, try SpeculativeDecoder(options, sampling: sampling, verifyWindow: verifier.verifyWindow))
        }
        var cache = cacheState
        let text = decode.map { StreamingDetokenizer(decode: $0) }
        var prompt = fullPrompt
        var shifts = 0
        if case let .shift(keep) = overflow, prompt.count > cache.capacity - 1 {
            prompt = try cache.shifted(prompt, keep: keep)
            shifts = 1
        }
        var stats = GenerationStats(promptTokens: prompt.count, generatedTokens: 0, prefillSeconds: 0,
                                    decodeSeconds: 0, stopReason: .length)
        stats.shifts = shifts

        let reused = cache.reusablePrefix(of: prompt)
        cache.rewind(to: reused)
        let windows = try cache.prefillWindows(Array(prompt[reused...]))  // refuses a prompt that does not fit
        guard maxNewTokens > 0 else { return stats }
        stats.reusedTokens = reused
        stats.prefilledTokens = prompt.count - reused
        store(cache)  // the first window overwrites what followed the kept prefix

        let clock = ContinuousClock()
        var logits: [Float] = []
        let prefillStart = clock.now
        for window in windows {
            try Task.checkCancellation()
            logits = try await run(window, recordingIn: &cache)
        }
        stats.prefillSeconds = Self.seconds(clock.now - prefillStart)

        let decodeStart = clock.now
        var events = TokenEvents(maxNewTokens: maxNewTokens, eosTokenIds: eosTokenIds, text: text)
        if let (verifier, decoder) = speculation {
            try await decodeSpeculatively(verifier, decoder, prompt: prompt, logits: logits, overflow: overflow,
                                          cache: &cache, stats: &stats, events: &events, emit: emit)
        } else {
            var sampler = Sampler(sampling, context: prompt)  // the repetition penalty reads the prompt
            while true {
                let token = sampler.sample(logits)
                let (event, done) = events.next(token, stats: &stats)
                emit(event)
                if done { break }
                if cache.position >= cache.capacity, overflow == .stop {  // no room to feed the token back
                    stats.stopReason = .context
                    break
                }
                try Task.checkCancellation()
                logits = try await feed(token, overflow: overflow, cache: &cache, stats: &stats)
            }
        }
        stats.decodeSeconds = Self.seconds(clock.now - decodeStart)
        return stats
    }

    /// Feeds one token the plain way: a decode window, or a context shift when `overflow` shifts and
    /// the cache is full. Returns the logits after it.
    func feed(_ token: Int, overflow: ContextOverflow, cache: inout KVCacheState,
              stats: inout GenerationStats) async throws -> [Float] {
        if case let .shift(keep) = overflow, cache.remaining == 0 {
            stats.shifts += 1
            return try await shift(cache.tokens + [token], keep: keep, cache: &cache)
        }
        return try await run(try cache.decodeWindow(token), recordingIn: &cache)
    }

    /// A context shift: `history` cut to its first `keep` tokens and the most recent ones; the cache
    /// keeps what it shares with that (the first `keep`, and the rest is prefilled). Returns the
    /// logits after the last kept token.
    private func shift(_ history: [Int], keep: Int, cache: inout KVCacheState) async throws -> [Float] {
        let kept = try cache.shifted(history, keep: keep)
        cache.rewind(to: cache.reusablePrefix(of: kept))
        store(cache)
        var logits: [Float] = []
        for window in try cache.prefillWindows(Array(kept[cache.position...])) {
            logits = try await run(window, recordingIn: &cache)
        }
        return logits
    }

    /// Runs `window`, then records its tokens in `cache` and publishes it. When the model call fails
    /// (other than by cancellation), the predictor's cache may lack K/V it was given before (a
    /// background cache update that failed), so the record is emptied: the next prompt starts over.
    func run(_ window: TokenWindow, recordingIn cache: inout KVCacheState) async throws -> [Float] {
        let logits: [Float]
        do {
            logits = try await predictor.predict(window)
        } catch {
            if !(error is CancellationError) { cache.reset(); store(cache) }
            throw error
        }
        cache.commit(window)
        store(cache)
        return logits
    }

    private var cacheState: KVCacheState {
        lock.lock(); defer { lock.unlock() }
        return cache
    }

    func store(_ state: KVCacheState) {
        lock.lock(); defer { lock.unlock() }
        cache = state
    }

    static func seconds(_ d: Duration) -> Double {
        Double(d.components.seconds) + Double(d.components.attoseconds) / 1e18
    }
}
