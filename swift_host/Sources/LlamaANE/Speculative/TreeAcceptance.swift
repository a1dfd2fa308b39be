/// Which drafted tokens of a verified tree the model itself would have produced: the rule of
/// Python's `runtime/speculative.py` (`choose`), drawing from the same `SeededRandom`.
///
/// Walking down from the root, the model's choice at each node is made from the logits after it:
///   * greedy: the argmax; a child that drafted it is accepted and the walk goes on from there,
///     else the argmax is the step's next token;
///   * sampling: each child c (drafted with probability q, a point mass when the drafter gives
///     none) is accepted with probability min(1, p(c) / q(c)); after a rejection p becomes the
///     normalised residual max(p - q, 0). With no child accepted, the next token is drawn from
///     what remains of p.
/// So every accepted token and the next one are distributed as plain decoding would draw them
/// (greedy: the very same tokens). A certain answer (probability 0 or 1) draws no number.
public enum TreeAcceptance {
    /// The distribution a token is drawn from, over the whole vocabulary: one-hot at the argmax
    /// when greedy, else `Sampler.candidates`' probabilities at their ids (0 elsewhere).
    public static func probabilities(_ logits: [Float], _ sampling: SamplingParameters) -> [Double] {
        var p = [Double](repeating: 0, count: logits.count)
        if sampling.temperature <= 0 || sampling.topK == 1 {
            p[Sampler.argmax(logits)] = 1
            return p
        }
        for c in Sampler.candidates(logits, sampling) { p[c.id] = c.probability }
        return p
    }

    /// A token drawn from `p` (vocabulary order): the top one without touching `rng` when it is
    /// certain, else the first whose cumulative probability passes one uniform number.
    public static func draw(_ p: [Double], rng: inout SeededRandom) -> Int {
        var top = 0
        for (i, v) in p.enumerated() where v > p[top] { top = i }
        if p[top] >= 1 { return top }
        let u = rng.nextUnit()
        var cumulative = 0.0
        for (i, v) in p.enumerated() {
            cumulative += v
            if cumulative > u { return i }
        }
        return p.count - 1  // rounding left u past the last bucket
    }

    /// Walks `tree` with the model's logits after each of its nodes (`logits[i]`, vocabulary
    /// sized). Returns the accepted path (node indices, root first) and the next token: the
    /// model's choice after the path's last node.
    public static func choose(_ tree: DraftTree, logits: [[Float]], sampling: SamplingParameters,
                              rng: inout SeededRandom) -> (path: [Int], next: Int) {
        precondition(logits.count >= tree.count, "\(logits.count) logits rows for a tree of \(tree.count) nodes")
        var path = [0]
        while true {
            let node = path[path.count - 1]
            var p = probabilities(logits[node], sampling)
            var chosen: Int?
            for child in tree.children(of: node) {
                let token = tree.tokens[child], q = tree.probabilities[child]
                if accepts(p, token: token, q: q, rng: &rng) {
                    chosen = child
                    break
                }
                p = residual(p, token: token, q: q)
            }
            guard let chosen else { return (path, draw(p, rng: &rng)) }
            path.append(chosen)
        }
    }

    /// Accepts `token` with probability min(1, p/q) (q a point mass when nil); draws a number only
    /// when the answer is not certain.
    static func accepts(_ p: [Double], token: Int, q: [Double]?, rng: inout SeededRandom) -> Bool {
        let ratio = q.map { min(1, p[token] / max($0[token], 1e-30)) } ?? p[token]
        if ratio >= 1 { return true }
        if ratio <= 0 { return false }
        return rng.nextUnit() < ratio
    }

    /// max(p - q, 0) normalised after rejecting `token` (q its point mass when nil); p itself when
    /// nothing is left. (Summed in order; numpy sums pairwise, which may differ in the last bit.)
    static func residual(_ p: [Double], token: Int, q: [Double]?) -> [Double] {
        var r = p
        if let q {
            for i in r.indices { r[i] = max(p[i] - q[i], 0) }
        } else {
            r[token] = 0
        }
        let total = r.reduce(0, +)
        return total > 0 ? r.map { $0 / total } : p
    }
}
