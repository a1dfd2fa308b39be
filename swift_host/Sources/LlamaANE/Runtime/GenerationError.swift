/// Why generation stopped with an error.
public enum GenerationError: Error, CustomStringConvertible, Equatable {
    /// The KV cache cannot take `requested` more tokens at `position` (it holds `capacity`).
    case contextFull(position: Int, requested: Int, capacity: Int)
    /// The prompt has no tokens.
    case emptyPrompt
    /// A model returned logits of the wrong size.
    case badLogits(expected: Int, got: Int)
    /// Branch decoding was asked of an export without "decode_branches" functions.
    case noBranchWidth
    /// Speculative decoding was asked of a model without "verify" functions.
    case noVerifyWindow
    /// The most drafted tokens asked for do not fit the export's verify window.
    case draftTokensOutOfRange(Int, verifyWindow: Int)
    /// A repetition penalty was asked of speculative decoding, which does not take one (as in Python).
    case repetitionPenaltyWithSpeculative

    public var description: String {
        switch self {
        case let .contextFull(position, requested, capacity):
            return "the context is full: \(position) of \(capacity) cache positions are used and \(requested) more were needed. "
                + "Shorten the prompt or max new tokens, or export with a larger --context-length."
        case .emptyPrompt:
            return "the prompt encodes to no tokens; pass some text (or a BOS token) to start from."
        case let .badLogits(expected, got):
            return "the model returned \(got) logits where the manifest promises \(expected); the export and its manifest disagree: re-export."
        case .noBranchWidth:
            return "this export has no decode_branches functions (branch_width is 0); export with branch decoding enabled."
        case .noVerifyWindow:
            return "this export has no verify function for speculative decoding (verify_window is 0, or its caches are "
                + "Core ML states); re-export it with --verify-window W (e.g. 16) and --kv-cache inputs."
        case let .draftTokensOutOfRange(tokens, window):
            return "draft tokens must be 1...\(window - 1) (the export's verify window is \(window)), got \(tokens)."
        case .repetitionPenaltyWithSpeculative:
            return "a repetition penalty cannot be combined with speculative decoding; drop one."
        }
    }
}
