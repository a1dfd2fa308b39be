/// Ranking a tree's nodes by their chance of acceptance and cutting it to the best of them, as
/// Python's `DraftTree.ranked`, `keep` and `best`.
extension DraftTree {
    /// A node below the root with the chance that it and every ancestor are accepted (the product
    /// of their `confidence`).
    public struct RankedNode: Equatable, Sendable {
        public let node: Int
        public let chance: Double
    }

    /// The nodes below the root, most likely to be accepted first (ties: the lower index first), (n - 1,).
    /// A node always comes after its parent, since its chance is at most its parent's.
    public func ranked() -> [RankedNode] {
        var kids = [[Int]](repeating: [], count: count)
        for i in 1..<count { kids[parents[i]].append(i) }
        var out: [RankedNode] = []
        out.reserveCapacity(count - 1)
        var frontier = kids[0].map { RankedNode(node: $0, chance: confidence[$0]) }
        while !frontier.isEmpty {
            var best = 0
            for i in frontier.indices.dropFirst() {
                let a = frontier[i], b = frontier[best]
                if a.chance > b.chance || (a.chance == b.chance && a.node < b.node) { best = i }
            }
            frontier.swapAt(best, frontier.count - 1)
            let next = frontier.removeLast()
            out.append(next)
            frontier += kids[next.node].map { RankedNode(node: $0, chance: next.chance * confidence[$0]) }
        }
        return out
    }

    /// The tree of the root and `nodes` (each node's parent among them), in index order, with their
    /// probabilities and confidence.
    public func keep(_ nodes: [Int]) -> DraftTree {
        var tree = DraftTree(root: tokens[0])
        var index = [0: 0]  // node here -> node in `tree`
        for v in Set(nodes).subtracting([0]).sorted() {
            guard let parent = index[parents[v]] else { preconditionFailure("node \(v) is kept without its parent \(parents[v])") }
            index[v] = tree.add(tokens[v], under: parent, probabilities: probabilities[v], confidence: confidence[v])
        }
        return tree
    }

    /// The tokens a verify step of this tree is expected to give, as Python's
    /// `DraftTree.expected_tokens`: the model's own next token plus, for every node, the chance
    /// that it and its ancestors are accepted.
    public var expectedTokens: Double {
        ranked().reduce(1) { $0 + $1.chance }
    }

    /// The `k` nodes most likely to be accepted (see `ranked`), with the root.
    public func best(_ k: Int) -> DraftTree {
        keep(ranked().prefix(max(k, 0)).map(\.node))
    }
}
