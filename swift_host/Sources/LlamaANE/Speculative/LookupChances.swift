import Foundation

/// The prompt-lookup drafter's estimates of how likely a proposal is accepted, as Python's
/// `PromptLookupDrafter.chance` and `_learn`: counts of how proposals fared, by the length of the
/// match they continue and their votes (how many continuations propose them), starting from a
/// prior by match length.
public struct LookupChances: Equatable, Sendable {
    /// A class of proposals: match length clamped to 1...8, votes clamped to 1...3.
    public struct Key: Hashable, Sendable {
        public let match: Int
        public let votes: Int

        public init(match: Int, votes: Int) {
            precondition(match >= 1 && votes >= 1, "a proposal continues a match of at least one token and has a vote, got \(match), \(votes)")
            self.match = min(match, LookupChances.prior.count)
            self.votes = min(votes, LookupChances.maximumVotes)
        }
    }

    /// Accepted and tried proposals of one class.
    private struct Tally: Equatable, Sendable {
        var accepted = 0.0
        var tried = 0.0
    }

    /// The chance that a proposal with one vote is accepted, by match length 1...8, before counting.
    public static let prior = [0.2, 0.35, 0.5, 0.65, 0.75, 0.8, 0.85, 0.9]
    /// Pseudo-observations of each prior.
    public static let priorWeight = 4.0
    /// Votes are counted up to this.
    public static let maximumVotes = 3

    private var tallies: [Key: Tally] = [:]

    public init() {}

    /// The estimated chance that a proposal continuing a match of `match` tokens, made by `votes`
    /// continuations, is accepted once its parent is: (accepted + w prior) / (tried + w), with
    /// prior = 1 - (1 - prior(match))^votes.
    public func chance(match: Int, votes: Int) -> Double { chance(Key(match: match, votes: votes)) }

    public func chance(_ key: Key) -> Double {
        let prior = 1 - pow(1 - Self.prior[key.match - 1], Double(key.votes))
        let tally = tallies[key] ?? Tally()
        return (tally.accepted + Self.priorWeight * prior) / (tally.tried + Self.priorWeight)
    }

    /// Counts how the proposals of `tree` (drafted after `text`, `keys[i]` node i's class, the
    /// root's unused) fared against `tokens`, the text as it went on: walking down the path the
    /// text took, every child of each node on it was tried, and the one the text chose accepted.
    /// Nothing is counted when `tokens` does not extend `text` (another text: a context shift, a
    /// new prompt).
    mutating func learn(_ tokens: [Int], after text: [Int], tree: DraftTree, keys: [Key?]) {
        guard tokens.count > text.count, tokens.starts(with: text) else { return }
        var node = 0
        for token in tokens[text.count...] {
            var next: Int?
            for child in tree.children(of: node) {
                guard let key = keys[child] else { continue }
                let accepted = tree.tokens[child] == token
                tallies[key, default: Tally()].accepted += accepted ? 1 : 0
                tallies[key, default: Tally()].tried += 1
                if accepted { next = child }
            }
            guard let next else { return }
            node = next
        }
    }
}
