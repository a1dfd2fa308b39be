/// Proposes token trees for speculative decoding. A drafter sees the text so far (the prompt and
/// the generated tokens, ending with the root: the last sampled token, not verified yet) and never
/// decides what is generated: the verify step keeps only what the model itself would produce.
/// Each node's `confidence` (its chance of acceptance once its parent is accepted; 1 where the
/// drafter gives none) is what the decoder weighs a tree by.
///
/// A drafter may learn from the texts it is shown (each call's text usually extends the last), so
/// drafting mutates it; a `SpeculativeDecoder` works on its own copy.
public protocol Drafter: Sendable {
    /// A tree under the root `tokens.last` with at most `k` drafted tokens (just the root when it
    /// has nothing to propose).
    mutating func draft(_ tokens: [Int], k: Int) -> DraftTree
}
