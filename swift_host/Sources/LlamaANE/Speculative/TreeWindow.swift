/// One call of the "verify" function: a `DraftTree` laid out in a window of the exported W tokens
/// after `position` cached tokens, exactly as Python's `Pipeline.verify_tree` lays it out.
///
/// The first `count` columns hold the tree (token 0 the root); the rest is padding that sees only
/// itself and that nothing sees. Token i sits at cache position `position + depths[i]` (its RoPE
/// row). Nothing reaches the cache until the accepted path is known (`slots(keeping:)`).
public struct TreeWindow: Equatable, Sendable {
    /// W: the window's length, the exported `verify_window`.
    public let width: Int
    /// The tree's nodes: real tokens at the start of the window.
    public let count: Int
    /// Tokens already cached: where depth 0 goes.
    public let position: Int
    /// `input_ids` (1, W): the tree's tokens, padded with 0.
    public let tokens: [Int32]
    /// `depths` (W,): each token's depth in the tree (the root's is 0), padded with 0.
    public let depths: [Int32]
    /// `tree_mask` (1, 1, W, W) row-major [query][key], additive: the tree's mask (0 where the key
    /// is the query or one of its ancestors, `DraftTree.hidden` else) in the first `count` rows and
    /// columns; a padding row sees only its own column.
    public let treeMask: [Float]

    /// Lays `tree` out in a window of `width` tokens after `position` cached tokens.
    public init(tree: DraftTree, position: Int, width: Int) {
        precondition(tree.count >= 1 && tree.count <= width, "a verify window holds 1...\(width) tokens, got \(tree.count)")
        self.width = width
        count = tree.count
        self.position = position
        let padding = width - tree.count
        tokens = tree.tokens.map { Int32(truncatingIfNeeded: $0) } + Array(repeating: 0, count: padding)
        depths = tree.depths.map { Int32($0) } + Array(repeating: 0, count: padding)
        var mask = [Float](repeating: DraftTree.hidden, count: width * width)
        for i in 0..<width { mask[i * width + i] = 0 }
        let own = tree.mask()
        for i in 0..<tree.count {
            for j in 0..<tree.count { mask[i * width + j] = own[i * tree.count + j] }
        }
        treeMask = mask
    }

    /// Cache positions the tree reaches: one past its deepest token.
    public var end: Int { position + Int(depths.prefix(count).max() ?? 0) + 1 }

    /// `slots` (W,) of the verify cache update that keeps `path` (window indices from the root down
    /// one branch, root first): `path[k]` goes to cache position `position + k`, every other column
    /// to -1 (dropped).
    public func slots(keeping path: [Int]) -> [Int32] {
        precondition(path.first == 0, "an accepted path starts at the root (index 0), got \(path)")
        var slots = [Int32](repeating: -1, count: width)
        for (k, node) in path.enumerated() {
            precondition(node < count, "node \(node) is not in a tree of \(count) tokens")
            slots[node] = Int32(position + k)
        }
        return slots
    }

    /// The tokens `path` keeps, root first: what the cache holds after `slots(keeping: path)`.
    public func tokens(along path: [Int]) -> [Int] { path.map { Int(tokens[$0]) } }
}
