/// How a `Generator` decodes speculatively: a drafter proposes token trees and one "verify" window
/// checks each, with the same tokens as plain decoding when greedy (the same distribution when
/// sampling).
public struct SpeculativeDecoding: Sendable {
    public var drafter: any Drafter
    /// The most drafted tokens of one tree, 1...W-1 (W the export's verify window); nil: W - 1.
    public var draftTokens: Int?
    /// Verify a tree only when it beats plain decoding by `times` (see `SpeculativeDecoder`);
    /// false: every drafted tree.
    public var adaptive: Bool
    /// The seconds of plain and verify steps: measured as the generation runs by default.
    public var times: any StepTimeModel

    public init(drafter: any Drafter, draftTokens: Int? = nil, adaptive: Bool = true,
                times: any StepTimeModel = MeasuredStepTimes()) {
        self.drafter = drafter
        self.draftTokens = draftTokens
        self.adaptive = adaptive
        self.times = times
    }

    /// Prompt lookup (`PromptLookupDrafter` with n-grams of 8 down to 1 tokens), a fresh drafter
    /// for each generation.
    public static func promptLookup(draftTokens: Int? = nil, adaptive: Bool = true,
                                    times: any StepTimeModel = MeasuredStepTimes()) -> SpeculativeDecoding {
        SpeculativeDecoding(drafter: PromptLookupDrafter(), draftTokens: draftTokens, adaptive: adaptive, times: times)
    }
}
