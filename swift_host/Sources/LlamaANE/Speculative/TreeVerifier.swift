/// A `TokenPredictor` that can also run the "verify" function: a drafted token tree in one window
/// over the cached tokens, with only the accepted path written to the cache afterwards.
public protocol TreeVerifier: TokenPredictor {
    /// W: tokens one verify window holds (0 when the model has no verify function).
    var verifyWindow: Int { get }
    /// Runs `window` (its tree after the `window.position` cached tokens) and returns the logits
    /// after each of its `window.count` tree tokens, vocabulary sized. Nothing reaches the cache.
    func verify(_ window: TreeWindow) async throws -> [[Float]]
    /// Writes the K/V of the last verified window's tokens along `path` (window indices, root
    /// first) to the cache at `window.position ..< window.position + path.count`, and nothing else.
    func accept(_ window: TreeWindow, path: [Int]) async throws
}
