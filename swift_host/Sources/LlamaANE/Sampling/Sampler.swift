import Foundation

/// How the next token is chosen from logits. The order and formulas are Python's
/// (`llama_ane.runtime.sampling`): repetition penalty, temperature, top-k, top-p, min-p, one draw.
public struct SamplingParameters: Equatable, Sendable {
    /// The last context tokens (prompt and generated) the repetition penalty reads; Python's
    /// `REPETITION_WINDOW`.
    public static let repetitionWindow = 64

    /// 0 means greedy (argmax); otherwise logits are divided by it before the softmax.
    public var temperature: Float
    /// Keep only the `topK` most likely tokens (0 keeps all).
    public var topK: Int
    /// Keep the smallest set of most likely tokens whose probability reaches `topP` (1 keeps all).
    public var topP: Float
    /// Of those, keep the tokens at least `minP` times as likely as the most likely one (0 keeps all;
    /// in 0...1).
    public var minP: Float
    /// CTRL's repetition penalty R (> 0; 1 is off): the logit l of every distinct token among the
    /// last `repetitionWindow` context tokens becomes l / R if l > 0, else l * R. It applies to
    /// greedy decoding too; speculative decoding does not take it.
    public var repetitionPenalty: Float
    /// Seed of the sampler's random number generator.
    public var seed: UInt64

    public init(temperature: Float = 0, topK: Int = 0, topP: Float = 1, minP: Float = 0,
                repetitionPenalty: Float = 1, seed: UInt64 = 0) {
        self.temperature = temperature
        self.topK = topK
        self.topP = topP
        self.minP = minP
        self.repetitionPenalty = repetitionPenalty
        self.seed = seed
    }

    /// Temperature 0 or top-k 1: the argmax, drawing no random number.
    public var isGreedy: Bool { temperature <= 0 || topK == 1 }

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

/// Chooses tokens from logits: greedy, or temperature with optional top-k, top-p and min-p, drawing
/// from a seeded generator so that the same seed and logits give the same tokens as Python's sampler.
/// It remembers the context for the repetition penalty: the tokens it was started with (the prompt)
/// and every token it has sampled since.
public struct Sampler: Sendable {
    public let parameters: SamplingParameters
    private var rng: SeededRandom
    /// The last `SamplingParameters.repetitionWindow` context tokens (kept only with a penalty).
    public private(set) var recent: [Int]

    /// - Parameter context: the token ids before the first sampled one (the prompt as fed to the
    ///   model); only the repetition penalty reads them.
    public init(_ parameters: SamplingParameters, context: [Int] = []) {
        self.parameters = parameters
        rng = SeededRandom(seed: parameters.seed)
        recent = parameters.repetitionPenalty == 1 ? [] : Array(context.suffix(SamplingParameters.repetitionWindow))
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

    /// `logits` with the repetition penalty applied (in Float, as Python's float32) to the distinct
    /// ids among the last `repetitionWindow` of `recent`; as they are without a penalty.
    public static func penalize(_ logits: [Float], recent: [Int], penalty: Float) -> [Float] {
        guard penalty != 1, !recent.isEmpty else { return logits }
        var out = logits
        for id in Set(recent.suffix(SamplingParameters.repetitionWindow)) where id >= 0 && id < out.count {
            out[id] = out[id] > 0 ? out[id] / penalty : out[id] * penalty
        }
        return out
    }

    /// The next token id; it joins the context the repetition penalty reads.
    public mutating func sample(_ logits: [Float]) -> Int {
        precondition(!logits.isEmpty, "cannot sample from empty logits")
        let token = draw(logits)
        if parameters.repetitionPenalty != 1 {
            recent.append(token)
            if recent.count > SamplingParameters.repetitionWindow { recent.removeFirst() }
        }
        return token
    }

    private mutating func draw(_ logits: [Float]) -> Int {
        if parameters.isGreedy {
            return Self.argmax(Self.penalize(logits, recent: recent, penalty: parameters.repetitionPenalty))
        }
        let candidates = Self.candidates(logits, parameters, recent: recent)
        let u = rng.nextUnit()
        var cumulative = 0.0
        for c in candidates {
            cumulative += c.probability
            if u < cumulative { return c.id }
        }
        return candidates.last!.id  // rounding left u past the last bucket
    }

    /// The tokens that may be drawn, most likely first, with renormalized probabilities, from
    /// `logits` and the context's `recent` token ids (for the repetition penalty).
    static func candidates(_ logits: [Float], _ p: SamplingParameters,
                           recent: [Int] = []) -> [(id: Int, probability: Double)] {
        let t = Double(p.temperature)
        let penalized = penalize(logits, recent: recent, penalty: p.repetitionPenalty)
        var scored = penalized.enumerated().compactMap { i, v in v.isNaN ? nil : (id: i, logit: Double(v) / t) }
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
        if p.minP > 0 {
            // probs[0] is exp(0) = 1, the most likely token's, so each entry is already its ratio to it
            let keep = max(probs.filter { $0 >= Double(p.minP) }.count, 1)
            probs.removeLast(probs.count - keep)
            scored.removeLast(scored.count - keep)
            total = probs.reduce(0, +)
        }
        return zip(scored, probs).map { (id: $0.id, probability: $1 / total) }
    }
}
