/// Proposes token trees for speculative decoding. A drafter sees the text so far (the prompt and
/// the generated tokens, ending with the root: the last sampled token, not verified yet) and never
/// decides what is generated: the verify step keeps only what the model itself would produce.
///
/// A drafter may learn from the texts it is shown (each call's text usually extends the last), so
/// drafting mutates it; a `SpeculativeDecoder` works on its own copy.
public protocol Drafter: Sendable {
    /// Whether its trees carry chances of acceptance (`DraftTree.estimated`), which the decoder
    /// sizes by cost; false: the decoder sizes them by how far recent trees were accepted.
    var estimates: Bool { get }

    /// A tree under the root `tokens.last` with at most `k` drafted tokens (just the root when it
    /// has nothing to propose).
    mutating func draft(_ tokens: [Int], k: Int) -> DraftTree
}

extension Drafter {
    public var estimates: Bool { false }
}
