@testable import LlamaANE

/// A deterministic stand-in for a language model: the logits are a pseudo-random function of the
/// whole token history, so any mistake in positions, padding or cache handling changes them.
enum FakeModel {
    static func logits(_ history: [Int], vocab: Int, eos: Int? = nil) -> [Float] {
        var h: UInt64 = 0xcbf2_9ce4_8422_2325
        for t in history { h = (h ^ UInt64(truncatingIfNeeded: t)) &* 0x100_0000_01b3 }
        var rng = SeededRandom(seed: h)
        var out = (0..<vocab).map { _ in Float(rng.nextUnit()) * 4 }
        // Now and then make the end-of-sequence token the clear favourite.
        if let eos, h % 5 == 0 { out[eos] = 10 }
        return out
    }

    /// A predictor that keeps a fake cache and checks that windows arrive where they should. A window
    /// below the cached tokens drops those at and past its position, as the real model's mask does.
    final class CachePredictor: TokenPredictor, @unchecked Sendable {
        let contextLength: Int
        let prefillLength: Int
        let vocab: Int
        let eos: Int?
        var cache: [Int] = []
        var windows: [TokenWindow] = []
        var failures: [String] = []

        init(contextLength: Int, prefillLength: Int, vocab: Int, eos: Int? = nil) {
            self.contextLength = contextLength
            self.prefillLength = prefillLength
            self.vocab = vocab
            self.eos = eos
        }

        func predict(_ window: TokenWindow) async throws -> [Float] {
            windows.append(window)
            let length = window.phase == .prefill ? prefillLength : 1
            if window.tokens.count != length { failures.append("window of \(window.tokens.count) tokens, expected \(length)") }
            if window.position > cache.count { failures.append("window at \(window.position), cache holds \(cache.count)") }
            if window.tokens[window.count...].contains(where: { $0 != 0 }) { failures.append("padding is not 0") }
            if window.position + window.count > contextLength { failures.append("window past the context") }
            cache = Array(cache.prefix(window.position)) + window.tokens[..<window.count].map(Int.init)
            return FakeModel.logits(cache, vocab: vocab, eos: eos)
        }

        func reset() async throws { cache = [] }

        /// The real tokens of the windows run so far, by phase.
        func tokensRun(_ phase: Phase) -> Int { windows.filter { $0.phase == phase }.map(\.count).reduce(0, +) }
    }

    /// What `Generator` must produce: the same model recomputed on the full history each step.
    static func reference(prompt: [Int], maxNewTokens: Int, sampling: SamplingParameters, vocab: Int,
                          eos: Int?) -> [Int] {
        var sampler = Sampler(sampling)
        var history = prompt
        var out: [Int] = []
        while out.count < maxNewTokens {
            let t = sampler.sample(logits(history, vocab: vocab, eos: eos))
            out.append(t)
            history.append(t)
            if t == eos { break }
        }
        return out
    }

    /// Decodes one cascade branch alone (prefix + its own tokens, recomputed each step): what every
    /// grouping and every pipeline must reproduce.
    static func decodeAlone(prefix: [Int], _ r: BranchRequest, suffixCapacity: Int, vocab: Int, eos: Int) -> BranchResult {
        var sampler = Sampler(r.sampling)
        var suffix: [Int] = []
        var out: [Int] = []
        var toFeed = r.forcedTokens
        if r.maxNewTokens <= 0 { return BranchResult(tokens: [], stopReason: .length) }
        func take(_ logits: [Float]) -> FinishReason? {
            let t = sampler.sample(logits)
            out.append(t)
            if t == eos { return .eos }
            if out.count >= r.maxNewTokens { return .length }
            toFeed = [t]
            return nil
        }
        if toFeed.isEmpty, let stop = take(logits(prefix, vocab: vocab, eos: eos)) {
            return BranchResult(tokens: out, stopReason: stop)
        }
        while true {
            if suffix.count >= suffixCapacity { return BranchResult(tokens: out, stopReason: .context) }
            suffix.append(toFeed.removeFirst())
            if toFeed.isEmpty, let stop = take(logits(prefix + suffix, vocab: vocab, eos: eos)) {
                return BranchResult(tokens: out, stopReason: stop)
            }
        }
    }
}
