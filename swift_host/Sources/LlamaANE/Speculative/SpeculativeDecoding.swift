/// How a `Generator` decodes speculatively: a drafter proposes token trees and one "verify" window
/// checks each, with the same tokens as plain decoding when greedy (the same distribution when
/// sampling).
public struct SpeculativeDecoding: Sendable {
    public var drafter: any Drafter
    /// The most drafted tokens of one tree, 1...W-1 (W the export's verify window); nil: W - 1.
    public var draftTokens: Int?
    /// Size trees by what pays: estimated trees by `costs`, others by how far they were accepted,
    /// pausing drafting while it does not pay (see `SpeculativeDecoder`).
    public var adaptive: Bool
    /// What verify windows cost in plain steps: measured as the generation runs by default.
    public var costs: any StepCostModel

    public init(drafter: any Drafter, draftTokens: Int? = nil, adaptive: Bool = true,
                costs: any StepCostModel = MeasuredStepCosts()) {
        self.drafter = drafter
        self.draftTokens = draftTokens
        self.adaptive = adaptive
        self.costs = costs
    }

    /// Prompt lookup (`PromptLookupDrafter` with n-grams of 8 down to 1 tokens), a fresh drafter
    /// for each generation.
    public static func promptLookup(draftTokens: Int? = nil, adaptive: Bool = true,
                                    costs: any StepCostModel = MeasuredStepCosts()) -> SpeculativeDecoding {
        SpeculativeDecoding(drafter: PromptLookupDrafter(), draftTokens: draftTokens, adaptive: adaptive, costs: costs)
    }
}
