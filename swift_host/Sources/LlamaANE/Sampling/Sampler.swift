import Foundation

/// How the next token is chosen from logits.
public struct SamplingParameters: Equatable, Sendable {
    /// 0 means greedy (argmax); otherwise logits are divided by it before the softmax.
    public var temperature: Float
    /// Keep only the `topK` most likely tokens (0 keeps all).
    public var topK: Int
    /// Keep the smallest set of most likely tokens whose probability reaches `topP` (1 keeps all).
    public var topP: Float
    /// Seed of the sampler's random number generator.
    public var seed: UInt64

    public init(temperature: Float = 0, topK: Int = 0, topP: Float = 1, seed: UInt64 = 0) {
        self.temperature = temperature
        self.topK = topK
        self.topP = topP
        self.seed = seed
    }

    /// Always the most likely token.
    public static let greedy = SamplingParameters()

    /// The parameters of cascade branch `index`: seed `seed + index` (wrapping), the rule the Python
    /// runtime follows too (`sampling.branch_seed`), so the same seed gives the same branches in both.
    public func branch(_ index: Int) -> SamplingParameters {
        var p = self
        p.seed = seed &+ UInt64(index)
        return p
    }
}

/// Chooses tokens from logits: greedy, or temperature with optional top-k and top-p, drawing from a
/// seeded generator so that the same seed and logits give the same tokens.
public struct Sampler: Sendable {
    public let parameters: SamplingParameters
    private var rng: SeededRandom

    public init(_ parameters: SamplingParameters) {
        self.parameters = parameters
        rng = SeededRandom(seed: parameters.seed)
    }

    /// The index of the largest logit (the first one on ties); NaN logits never win.
    public static func argmax(_ logits: [Float]) -> Int {
        var best = 0
        var bestValue = -Float.infinity
        for (i, v) in logits.enumerated() where v > bestValue {
            best = i
            bestValue = v
        }
        return best
    }

    /// The next token id.
    public mutating func sample(_ logits: [Float]) -> Int {
        precondition(!logits.isEmpty, "cannot sample from empty logits")
        if parameters.temperature <= 0 || parameters.topK == 1 { return Self.argmax(logits) }
        let candidates = Self.candidates(logits, parameters)
        let u = rng.nextUnit()
        var cumulative = 0.0
        for c in candidates {
            cumulative += c.probability
            if u < cumulative { return c.id }
        }
        return candidates.last!.id  // rounding left u past the last bucket
    }

    /// The tokens that may be drawn, most likely first, with renormalized probabilities.
    static func candidates(_ logits: [Float], _ p: SamplingParameters) -> [(id: Int, probability: Double)] {
        let t = Double(p.temperature)
        var scored = logits.enumerated().compactMap { i, v in v.isNaN ? nil : (id: i, logit: Double(v) / t) }
        scored.sort { $0.logit != $1.logit ? $0.logit > $1.logit : $0.id < $1.id }
        if p.topK > 0, scored.count > p.topK { scored.removeLast(scored.count - p.topK) }
        let maxLogit = scored[0].logit
        var probs = scored.map { exp($0.logit - maxLogit) }
        var total = probs.reduce(0, +)
        if p.topP < 1 {
            var keep = 0
            var cumulative = 0.0
            while keep < probs.count {
                cumulative += probs[keep] / total
                keep += 1
                if cumulative >= Double(p.topP) { break }
            }
            probs.removeLast(probs.count - keep)
            scored.removeLast(scored.count - keep)
            total = probs.reduce(0, +)
        }
        return zip(scored, probs).map { (id: $0.id, probability: $1 / total) }
    }
}
