@testable import LlamaANE

/// Stand-ins for a model with a "verify" function, and a model whose text repeats (so that prompt
/// lookup has something to find) while its logits still depend on the positions.
enum FakeTreeModel {
    /// Logits that depend on the last token and on the parity of the history's length: greedy text
    /// soon cycles, but a token at a wrong position or after a wrong ancestor gets other logits.
    /// `size` > `vocab` pads the logits with ids the model never picks (a prompt from a real
    /// tokenizer holds such ids, and prompt lookup may draft them).
    static func logits(_ history: [Int], vocab: Int, size: Int? = nil) -> [Float] {
        let last = UInt64(truncatingIfNeeded: history.last ?? 0)
        var rng = SeededRandom(seed: last &* 0x9E37_79B9 &+ UInt64(history.count % 2))
        return (0..<vocab).map { _ in Float(rng.nextUnit()) * 4 } + Array(repeating: -1, count: max(0, (size ?? vocab) - vocab))
    }

    /// What plain greedy or sampled decoding gives: the model recomputed on the full history.
    static func reference(prompt: [Int], maxNewTokens: Int, vocab: Int, eos: Int? = nil) -> [Int] {
        var history = prompt
        var out: [Int] = []
        while out.count < maxNewTokens {
            let t = Sampler.argmax(logits(history, vocab: vocab))
            out.append(t)
            history.append(t)
            if t == eos { break }
        }
        return out
    }

    /// The history a verify window's column `i` sees: the cached tokens before the window, then the
    /// window tokens its tree mask lets it see (its ancestors and itself), which must sit at depths
    /// 0, 1, 2, ... in window order. Problems go to `problems`.
    static func visibleHistory(_ window: TreeWindow, column i: Int, cached: [Int], problems: inout [String]) -> [Int] {
        let w = window.width
        let seen = (0..<w).filter { window.treeMask[i * w + $0] == 0 }
        if seen.map({ Int(window.depths[$0]) }) != Array(0..<seen.count), i < window.count {
            problems.append("column \(i) sees depths \(seen.map { window.depths[$0] })")
        }
        if (0..<w).contains(where: { window.treeMask[i * w + $0] != 0 && window.treeMask[i * w + $0] != DraftTree.hidden }) {
            problems.append("column \(i) has a mask value other than 0 and \(DraftTree.hidden)")
        }
        return Array(cached.prefix(window.position)) + seen.map { Int(window.tokens[$0]) }
    }

    /// A predictor with a verify function over a fake cache of token ids. Windows and trees must
    /// start at or below the cached tokens; a verify run writes nothing; `accept` writes the tokens
    /// its slots keep at their slots, which must follow the position without a gap.
    final class TreePredictor: TreeVerifier, @unchecked Sendable {
        let contextLength: Int
        let prefillLength: Int
        let verifyWindow: Int
        let vocab: Int
        var cache: [Int] = []
        var problems: [String] = []
        /// Every write to the cache: (position, tokens) of windows and of accepted paths.
        var writes: [(position: Int, tokens: [Int], accepted: Bool)] = []
        var verified: [TreeWindow] = []

        /// Entries of each logits row (see `logits`).
        var size: Int?

        init(contextLength: Int, prefillLength: Int, verifyWindow: Int, vocab: Int, size: Int? = nil) {
            self.size = size
            self.contextLength = contextLength
            self.prefillLength = prefillLength
            self.verifyWindow = verifyWindow
            self.vocab = vocab
        }

        func predict(_ window: TokenWindow) async throws -> [Float] {
            if window.position > cache.count { problems.append("window at \(window.position), cache holds \(cache.count)") }
            let real = window.tokens[..<window.count].map(Int.init)
            cache = Array(cache.prefix(window.position)) + real
            writes.append((window.position, real, false))
            return FakeTreeModel.logits(cache, vocab: vocab, size: size)
        }

        func verify(_ window: TreeWindow) async throws -> [[Float]] {
            if window.position > cache.count { problems.append("tree at \(window.position), cache holds \(cache.count)") }
            if window.width != verifyWindow || window.tokens.count != verifyWindow { problems.append("a window of \(window.width)") }
            if window.end > contextLength { problems.append("a tree past the context") }
            if window.tokens[window.count...].contains(where: { $0 != 0 }) { problems.append("padding is not 0") }
            verified.append(window)
            return (0..<window.count).map { i in
                FakeTreeModel.logits(FakeTreeModel.visibleHistory(window, column: i, cached: cache, problems: &problems), vocab: vocab,
                                     size: size)
            }
        }

        func accept(_ window: TreeWindow, path: [Int]) async throws {
            if verified.last != window { problems.append("accepted a window that was not the last verified") }
            let slots = window.slots(keeping: path)
            let kept = slots.enumerated().filter { $0.element >= 0 }.sorted { $0.element < $1.element }
            if kept.map({ Int($0.element) }) != Array(window.position..<(window.position + kept.count)) {
                problems.append("slots \(slots) do not follow position \(window.position)")
            }
            let tokens = kept.map { Int(window.tokens[$0.offset]) }
            cache = Array(cache.prefix(window.position)) + tokens
            writes.append((window.position, tokens, true))
        }

        func reset() async throws { cache = [] }
    }
}
