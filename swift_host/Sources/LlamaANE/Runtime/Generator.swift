import Foundation

/// What a generation stream yields.
public enum GenerationEvent: Equatable, Sendable {
    /// A new token and the text it completed (may be empty while a character is incomplete).
    case token(id: Int, text: String)
    /// The end, with timings.
    case finished(GenerationStats)
}

/// Why generation ended.
public enum StopReason: String, Equatable, Sendable {
    case endOfSequence
    case maxTokens
}

/// Token counts and speeds of one generation.
public struct GenerationStats: Equatable, Sendable {
    public var promptTokens: Int
    public var generatedTokens: Int
    public var prefillSeconds: Double
    public var decodeSeconds: Double
    public var stopReason: StopReason

    public var prefillTokensPerSecond: Double { prefillSeconds > 0 ? Double(promptTokens) / prefillSeconds : 0 }
    /// Decode speed over the tokens produced by decode steps (the first comes from prefill).
    public var decodeTokensPerSecond: Double {
        decodeSeconds > 0 ? Double(max(generatedTokens - 1, 0)) / decodeSeconds : 0
    }
}

/// Generates tokens from a `TokenPredictor`: prefill windows for the prompt, then one decode
/// step per token, streaming each token (and its text) through an `AsyncThrowingStream`.
///
/// The predictor's cache is reset at the start of every generation. Stops at an end-of-sequence id
/// or after `maxNewTokens`. A prompt that does not fit the cache is refused before any model call;
/// when decoding fills the cache, the tokens so far have been streamed and the stream then throws
/// `GenerationError.contextFull`.
public final class Generator: @unchecked Sendable {
    public let predictor: TokenPredictor
    public let eosTokenIds: Set<Int>
    private let decode: (([Int]) -> String)?

    /// - Parameters:
    ///   - decode: ids -> text, for the `text` of each event; nil leaves texts empty.
    public init(predictor: TokenPredictor, eosTokenIds: Set<Int>, decode: (([Int]) -> String)? = nil) {
        self.predictor = predictor
        self.eosTokenIds = eosTokenIds
        self.decode = decode
    }

    /// Starts generating; cancelling the consuming task stops it after the current model call.
    public func generate(prompt: [Int], maxNewTokens: Int, sampling: SamplingParameters = .greedy)
        -> AsyncThrowingStream<GenerationEvent, Error>
    {
        AsyncThrowingStream { continuation in
            let task = Task {
                do {
                    let stats = try await self.run(prompt: prompt, maxNewTokens: maxNewTokens, sampling: sampling) {
                        continuation.yield($0)
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
    public func generateAll(prompt: [Int], maxNewTokens: Int, sampling: SamplingParameters = .greedy)
        async throws -> (tokens: [Int], stats: GenerationStats)
    {
        var tokens: [Int] = []
        let stats = try await run(prompt: prompt, maxNewTokens: maxNewTokens, sampling: sampling) { event in
            if case let .token(id, _) = event { tokens.append(id) }
        }
        return (tokens, stats)
    }

    private func run(prompt: [Int], maxNewTokens: Int, sampling: SamplingParameters,
                     emit: (GenerationEvent) -> Void) async throws -> GenerationStats {
        var cache = KVCacheState(capacity: predictor.contextLength, prefillLength: predictor.prefillLength)
        var sampler = Sampler(sampling)
        var text = decode.map { StreamingDetokenizer(decode: $0) }
        var stats = GenerationStats(promptTokens: prompt.count, generatedTokens: 0, prefillSeconds: 0,
                                    decodeSeconds: 0, stopReason: .maxTokens)
        try await predictor.reset()

        let windows = try cache.prefillWindows(prompt)  // refuses a prompt that does not fit
        guard maxNewTokens > 0 else { return stats }

        let clock = ContinuousClock()
        var logits: [Float] = []
        let prefillStart = clock.now
        for window in windows {
            try Task.checkCancellation()
            logits = try await predictor.predict(window)
            cache.commit(window)
        }
        stats.prefillSeconds = Self.seconds(clock.now - prefillStart)

        let decodeStart = clock.now
        while true {
            let token = sampler.sample(logits)
            stats.generatedTokens += 1
            var piece = text?.append(token) ?? ""
            let done = eosTokenIds.contains(token) || stats.generatedTokens >= maxNewTokens
            if done, var t = text { piece += t.finish() }
            emit(.token(id: token, text: piece))
            if eosTokenIds.contains(token) { stats.stopReason = .endOfSequence }
            if done { break }
            try Task.checkCancellation()
            let window = try cache.decodeWindow(token)
            logits = try await predictor.predict(window)
            cache.commit(window)
        }
        stats.decodeSeconds = Self.seconds(clock.now - decodeStart)
        return stats
    }

    private static func seconds(_ d: Duration) -> Double {
        Double(d.components.seconds) + Double(d.components.attoseconds) / 1e18
    }
}
