/// The decisions of a speculative generation, as Python's `SpeculativeDecoder`, without the model
/// calls (the `Generator` makes them): which tree to verify next and which of its tokens to keep.
///
/// Each step starts from the root, the last sampled token. The drafter is asked every step for up
/// to `maxDraft` tokens (it may learn from how the text went on). With `adaptive`, a drafted tree
/// is verified only when its expected tokens (`DraftTree.expectedTokens`) per second of a verify
/// step beat one token per second of a plain step (`StepTimeModel.worthVerifying`); otherwise,
/// and on the first step (which measures a plain one), the root is fed the plain way. Without
/// `adaptive`, every drafted tree is verified.
struct SpeculativeDecoder {
    private(set) var drafter: any Drafter
    private(set) var times: any StepTimeModel
    let sampling: SamplingParameters
    let maxDraft: Int
    let adaptive: Bool
    private(set) var stats = SpeculativeStats()
    private var rng: SeededRandom

    /// Throws when the export has no verify window or `draftTokens` does not fit in it.
    init(_ options: SpeculativeDecoding, sampling: SamplingParameters, verifyWindow: Int) throws {
        guard verifyWindow > 0 else { throw GenerationError.noVerifyWindow }
        guard sampling.repetitionPenalty == 1 else { throw GenerationError.repetitionPenaltyWithSpeculative }
        if let d = options.draftTokens, d < 1 || d > verifyWindow - 1 {
            throw GenerationError.draftTokensOutOfRange(d, verifyWindow: verifyWindow)
        }
        drafter = options.drafter
        times = options.times
        self.sampling = sampling
        maxDraft = options.draftTokens ?? verifyWindow - 1
        adaptive = options.adaptive
        rng = SeededRandom(seed: sampling.seed)
    }

    /// The next token from logits after one token (the prompt's last, or a plain step's).
    mutating func draw(_ logits: [Float]) -> Int {
        TreeAcceptance.draw(TreeAcceptance.probabilities(logits, sampling), rng: &rng)
    }

    /// The tree to verify after `text` (ending with the root) when `room` cache positions are free
    /// after the root's, or the root alone (a plain step) when nothing fits or is drafted, or when
    /// the tree is not worth a verify step.
    mutating func tree(after text: [Int], room: Int) -> DraftTree {
        guard let root = text.last else { preconditionFailure("speculative decoding needs a root token") }
        let k = min(maxDraft, room)
        let tree = k >= 1 ? drafter.draft(text, k: k) : DraftTree(root: root)
        if tree.count == 1 || !adaptive || times.worthVerifying(expected: tree.expectedTokens) { return tree }
        return DraftTree(root: root)
    }

    /// The accepted path of `tree` and the next token (see `TreeAcceptance.choose`).
    mutating func choose(_ tree: DraftTree, logits: [[Float]]) -> (path: [Int], next: Int) {
        TreeAcceptance.choose(tree, logits: logits, sampling: sampling, rng: &rng)
    }

    /// Records a plain step of `seconds`.
    mutating func recordDecode(seconds: Double) {
        stats.decodeSteps += 1
        stats.decodeSeconds += seconds
        times.plain(seconds: seconds)
    }

    /// Records a verify step of `seconds` (drafting included) that kept `path` of `tree`.
    mutating func recordVerify(seconds: Double, tree: DraftTree, path: [Int]) {
        stats.verifySteps += 1
        stats.verifySeconds += seconds
        stats.draftedTokens += tree.count - 1
        stats.acceptedTokens += path.count - 1
        times.verify(seconds: seconds)
    }
}
