/// A tree of drafted tokens to verify in one window (speculative decoding), as Python's
/// `runtime/drafters.py` `DraftTree`: node 0 is the root, the last sampled token (not cached yet);
/// every other node is a drafted continuation of its parent, and `parents[i] < i`.
///
/// `probabilities[i]` is the drafter's distribution over the vocabulary of node i's token given its
/// parent, or nil when the token was picked deterministically (a point mass: prompt lookup).
public struct DraftTree: Equatable, Sendable {
    /// The additive mask value of a hidden key, as the exported functions use it (`MASK_VALUE`).
    public static let hidden: Float = -1.0e4

    public private(set) var tokens: [Int]
    /// Each node's parent index; -1 for the root.
    public private(set) var parents: [Int]
    public private(set) var probabilities: [[Double]?]

    /// A tree holding only the root `token`.
    public init(root token: Int) {
        tokens = [token]
        parents = [-1]
        probabilities = [nil]
    }

    /// Nodes, the root included.
    public var count: Int { tokens.count }

    /// The node for `token` under `parent`: an existing child with that token, or a new node.
    @discardableResult
    public mutating func add(_ token: Int, under parent: Int, probabilities q: [Double]? = nil) -> Int {
        precondition(parent >= 0 && parent < count, "node \(parent) is not in a tree of \(count) nodes")
        if let existing = children(of: parent).first(where: { tokens[$0] == token }) { return existing }
        tokens.append(token)
        parents.append(parent)
        probabilities.append(q)
        return count - 1
    }

    /// The children of `node`, in the order they were added.
    public func children(of node: Int) -> [Int] {
        parents.indices.filter { parents[$0] == node }
    }

    /// Each node's depth (the root's is 0): its position after the cached tokens, (n,).
    public var depths: [Int] {
        var d = [Int](repeating: 0, count: count)
        for (i, p) in parents.enumerated() where p >= 0 { d[i] = d[p] + 1 }
        return d
    }

    /// The additive tree mask [query][key], (n, n) row-major: 0 where the key is the query itself or
    /// one of its ancestors, `hidden` elsewhere.
    public func mask(hidden: Float = DraftTree.hidden) -> [Float] {
        let n = count
        var allowed = [Bool](repeating: false, count: n * n)
        for i in 0..<n {
            allowed[i * n + i] = true
            if parents[i] >= 0 {
                for j in 0..<n where allowed[parents[i] * n + j] { allowed[i * n + j] = true }
            }
        }
        return allowed.map { $0 ? 0 : hidden }
    }

    /// The nodes from the root down to `node`, root first.
    public func path(to node: Int) -> [Int] {
        var path = [node]
        while let last = path.last, parents[last] >= 0 { path.append(parents[last]) }
        return path.reversed()
    }
}
