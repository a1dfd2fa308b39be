/// Proposes token trees for speculative decoding. A drafter sees the text so far (the prompt and
/// the generated tokens, ending with the root: the last sampled token, not verified yet) and never
/// decides what is generated: the verify step keeps only what the model itself would produce.
public protocol Drafter: Sendable {
    /// A tree under the root `tokens.last` with at most `k` drafted tokens (just the root when it
    /// has nothing to propose).
    func draft(_ tokens: [Int], k: Int) -> DraftTree
}
