/// How a `Generator` decodes speculatively: a drafter proposes token trees and one "verify" window
/// checks each, with the same tokens as plain decoding when greedy (the same distribution when
/// sampling).
public struct SpeculativeDecoding: Sendable {
    public var drafter: any Drafter
    /// The most drafted tokens of one tree, 1...W-1 (W the export's verify window); nil: W - 1.
    public var draftTokens: Int?
    /// Adapt the tree size and pause drafting while it does not pay (see `SpeculativeDecoder`).
    public var adaptive: Bool

    public init(drafter: any Drafter, draftTokens: Int? = nil, adaptive: Bool = true) {
        self.drafter = drafter
        self.draftTokens = draftTokens
        self.adaptive = adaptive
    }

    /// Prompt lookup (`PromptLookupDrafter` with n-grams of 4 down to 1 tokens).
    public static func promptLookup(draftTokens: Int? = nil, adaptive: Bool = true) -> SpeculativeDecoding {
        SpeculativeDecoding(drafter: PromptLookupDrafter(), draftTokens: draftTokens, adaptive: adaptive)
    }
}
