/// A tree of drafted tokens to verify in one window (speculative decoding), as Python's
/// `runtime/drafters.py` `DraftTree`: node 0 is the root, the last sampled token (not cached yet);
/// every other node is a drafted continuation of its parent, and `parents[i] < i`.
///
/// `probabilities[i]` is the drafter's distribution over the vocabulary of node i's token given its
/// parent, or nil when the token was picked deterministically (a point mass: prompt lookup).
/// `confidence[i]` is the drafter's estimate of the chance that node i is accepted once its parent
/// is (the root's is 1; 1 where the drafter gives none): what the decoder weighs a tree by.
public struct DraftTree: Equatable, Sendable {
    /// The additive mask value of a hidden key, as the exported functions use it (`MASK_VALUE`).
    public static let hidden: Float = -1.0e4

    /// A node's place in the tree: its parent and its token (at most one node each).
    private struct Edge: Hashable, Sendable {
        let parent: Int
        let token: Int
    }

    public private(set) var tokens: [Int]
    /// Each node's parent index; -1 for the root.
    public private(set) var parents: [Int]
    public private(set) var probabilities: [[Double]?]
    /// Each node's estimated chance of acceptance given its parent's, (n,); 1 for the root.
    public private(set) var confidence: [Double]
    /// (parent, token) -> node.
    private var nodes: [Edge: Int] = [:]

    /// A tree holding only the root `token`.
    public init(root token: Int) {
        tokens = [token]
        parents = [-1]
        probabilities = [nil]
        confidence = [1]
        nodes = [Edge(parent: -1, token: token): 0]
    }

    /// Nodes, the root included.
    public var count: Int { tokens.count }

    /// The node for `token` under `parent`: an existing child with that token, or a new node with
    /// `probabilities` and `confidence`.
    @discardableResult
    public mutating func add(_ token: Int, under parent: Int, probabilities q: [Double]? = nil, confidence c: Double = 1) -> Int {
        precondition(parent >= 0 && parent < count, "node \(parent) is not in a tree of \(count) nodes")
        let edge = Edge(parent: parent, token: token)
        if let existing = nodes[edge] { return existing }
        nodes[edge] = count
        tokens.append(token)
        parents.append(parent)
        probabilities.append(q)
        confidence.append(c)
        return count - 1
    }

    /// Sets every node's estimated chance of acceptance given its parent, (n,) with the root's 1.
    public mutating func estimate(_ chances: [Double]) {
        precondition(chances.count == count, "\(chances.count) chances for a tree of \(count) nodes")
        confidence = chances
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
