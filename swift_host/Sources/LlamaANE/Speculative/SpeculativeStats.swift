/// The accounting of one speculative generation, as Python's `SpeculativeStats`.
public struct SpeculativeStats: Equatable, Sendable {
    /// Verify windows run.
    public var verifySteps = 0
    /// Plain one-token steps (nothing drafted, or no tree worth a verify step).
    public var decodeSteps = 0
    /// Tree nodes below the root, over all verify steps.
    public var draftedTokens = 0
    /// Drafted tokens kept.
    public var acceptedTokens = 0
    public var verifySeconds = 0.0
    public var decodeSeconds = 0.0

    public init() {}

    /// Tokens produced per verify step: the accepted drafts plus the model's own next token (NaN
    /// before any verify step).
    public var tokensPerStep: Double {
        verifySteps > 0 ? Double(acceptedTokens + verifySteps) / Double(verifySteps) : .nan
    }

    /// Accepted drafted tokens over drafted tokens (NaN when nothing was drafted).
    public var acceptanceRate: Double {
        draftedTokens > 0 ? Double(acceptedTokens) / Double(draftedTokens) : .nan
    }
}
