/// Prompt lookup, as Python's `PromptLookupDrafter`: find the last tokens earlier in the text and
/// propose what followed them. No extra model.
///
/// For every n from `maxNgram` down to `minNgram`, the `matches` most recent occurrences of the
/// last n tokens (not already found with a longer n) each give a continuation of up to `length`
/// tokens, `candidates` continuations in all; shared prefixes merge into one tree.
///
/// Each node carries its chance of acceptance (`LookupChances`), from its match length (a node d
/// levels below the root continues a match of n + d - 1 tokens) and its votes (how many
/// continuations propose it). At each call the drafter first counts how its previous tree fared
/// against how the text went on (whether that tree was verified or not). `draft` returns the `k`
/// nodes most likely to be accepted (`DraftTree.best`).
public struct PromptLookupDrafter: Drafter, Equatable {
    /// The tokens after one earlier occurrence of the last `match` tokens of the text.
    public struct Continuation: Equatable, Sendable {
        public let match: Int
        public let tokens: [Int]
    }

    /// The previous call's text, its whole tree and each node's class (nil for the root).
    private struct LastDraft: Equatable, Sendable {
        let text: [Int]
        let tree: DraftTree
        let keys: [LookupChances.Key?]
    }

    public let maxNgram: Int
    public let minNgram: Int
    public let matches: Int
    public let candidates: Int
    public let length: Int
    public private(set) var chances = LookupChances()
    private var last: LastDraft?

    public init(maxNgram: Int = 8, minNgram: Int = 1, matches: Int = 4, candidates: Int = 12, length: Int = 15) {
        precondition(1 <= minNgram && minNgram <= maxNgram, "n-gram sizes must satisfy 1 <= min <= max, got \(minNgram)...\(maxNgram)")
        precondition(matches >= 1 && candidates >= 1 && length >= 1, "matches, candidates and length must be at least 1")
        self.maxNgram = maxNgram
        self.minNgram = minNgram
        self.matches = matches
        self.candidates = candidates
        self.length = length
    }

    /// The tokens (at most `length`) after earlier occurrences of the last n tokens of `tokens`,
    /// longest n first and the most recent first for each n; an occurrence whose continuation starts
    /// where a longer one's did is skipped.
    public func continuations(_ tokens: [Int], length: Int) -> [Continuation] {
        var found: [Continuation] = []
        var starts = Set<Int>()  // where the continuations found so far start
        let end = tokens.count
        var n = min(maxNgram, end - 1)
        while n >= minNgram, found.count < candidates {
            let suffix = tokens[(end - n)...]
            var taken = 0
            // earlier occurrences begin at 0 ... end - 1 - n (the n-gram ending the text excluded)
            for begin in stride(from: end - 1 - n, through: 0, by: -1) where tokens[begin..<(begin + n)].elementsEqual(suffix) {
                let start = begin + n
                guard starts.insert(start).inserted else { continue }
                found.append(Continuation(match: n, tokens: Array(tokens[start..<min(start + length, end)])))
                taken += 1
                if taken == matches || found.count == candidates { break }
            }
            n -= 1
        }
        return found
    }

    public mutating func draft(_ tokens: [Int], k: Int) -> DraftTree {
        guard let root = tokens.last else { preconditionFailure("a draft needs at least the root token") }
        if let last {
            self.last = nil
            chances.learn(tokens, after: last.text, tree: last.tree, keys: last.keys)
        }
        var tree = DraftTree(root: root)
        guard k >= 1 else { return tree }
        var match = [0], votes = [0]  // per node: the longest match proposing it, its continuations
        for continuation in continuations(tokens, length: length) {
            var node = 0
            for (depth, token) in continuation.tokens.enumerated() {
                let size = tree.count
                node = tree.add(token, under: node)
                if tree.count > size {
                    match.append(continuation.match + depth)
                    votes.append(1)
                } else {
                    match[node] = max(match[node], continuation.match + depth)
                    votes[node] += 1
                }
            }
        }
        let classes = (1..<tree.count).map { LookupChances.Key(match: match[$0], votes: votes[$0]) }
        tree.estimate([1] + classes.map { chances.chance($0) })
        last = LastDraft(text: tokens, tree: tree, keys: [nil] + classes)
        return tree.best(k)
    }
}
