/// Prompt lookup, as Python's `PromptLookupDrafter`: find the last n tokens earlier in the text and
/// propose what followed them. No extra model.
///
/// The longest n-gram (from `maxNgram` down to `minNgram`) that occurs earlier is used; its most
/// recent `matches` occurrences each give a continuation. The most recent match's continuation
/// gets most of the `k` tokens, the others `alternative` tokens each, and shared prefixes merge,
/// so several matches make one tree.
public struct PromptLookupDrafter: Drafter, Equatable {
    public let maxNgram: Int
    public let minNgram: Int
    public let matches: Int
    public let alternative: Int

    public init(maxNgram: Int = 4, minNgram: Int = 1, matches: Int = 4, alternative: Int = 2) {
        precondition(1 <= minNgram && minNgram <= maxNgram, "n-gram sizes must satisfy 1 <= min <= max, got \(minNgram)...\(maxNgram)")
        self.maxNgram = maxNgram
        self.minNgram = minNgram
        self.matches = matches
        self.alternative = alternative
    }

    /// Up to `matches` distinct continuations, most recent match first, of the longest n-gram that
    /// ends `tokens` and occurs earlier in it; each at most `length` tokens.
    public func continuations(_ tokens: [Int], length: Int) -> [[Int]] {
        var found: [[Int]] = []
        let end = tokens.count
        var n = min(maxNgram, end - 1)
        while n >= minNgram {
            let suffix = tokens[(end - n)...]
            // earlier occurrences start at s = 0 ... end - 1 - n (the n-gram ending the text excluded)
            for s in stride(from: end - 1 - n, through: 0, by: -1) where tokens[s..<(s + n)].elementsEqual(suffix) {
                let continuation = Array(tokens[(s + n)..<min(s + n + length, end)])
                if !continuation.isEmpty, !found.contains(continuation) {
                    found.append(continuation)
                    if found.count == matches { return found }
                }
            }
            if !found.isEmpty { return found }
            n -= 1
        }
        return found
    }

    public func draft(_ tokens: [Int], k: Int) -> DraftTree {
        guard let root = tokens.last else { preconditionFailure("a draft needs at least the root token") }
        var tree = DraftTree(root: root)
        guard k >= 1 else { return tree }
        let found = continuations(tokens, length: k)
        guard !found.isEmpty else { return tree }
        let reserved = min(alternative * (found.count - 1), k / 2)  // room kept for the alternatives
        for (j, continuation) in found.enumerated() {
            let budget = j == 0 ? k - reserved : alternative
            var node = 0
            for token in continuation.prefix(max(budget, 0)) {
                let known = tree.children(of: node).contains { tree.tokens[$0] == token }
                if tree.count - 1 >= k, !known { break }
                node = tree.add(token, under: node)
            }
        }
        return tree
    }
}
