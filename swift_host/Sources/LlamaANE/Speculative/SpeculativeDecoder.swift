/// The decisions of a speculative generation, as Python's `SpeculativeDecoder`, without the model
/// calls (the `Generator` makes them): which tree to verify next, which of its tokens to keep, and
/// when drafting stops paying.
///
/// Each step starts from the root, the last sampled token. The first step is always a plain
/// decode step (to measure one). Every step's plain and verify seconds go to the cost model.
///
/// With `adaptive`, trees are sized by what pays:
///   * a drafter with estimates (prompt lookup) is asked every step (it learns from how the text
///     went on, even on the first) for as many tokens as the window takes, and its tree is cut to
///     the nodes that maximise expected tokens per cost (`DraftTree.planned(by:)`), or to the root
///     alone (a plain step) when no part of it beats a plain step;
///   * a drafter without estimates proposes `draftLength` tokens at most: it grows by 2 after a
///     tree accepted down to a leaf and shrinks by 1 otherwise, and when the last verify steps give
///     fewer tokens per second than plain steps, drafting pauses for a cool-down of plain steps
///     (16, doubled after each further pause, up to 256).
/// Without `adaptive`, every tree has up to `maxDraft` tokens.
struct SpeculativeDecoder {
    /// Verify steps measured before the fallback may judge (trees without estimates).
    static let minimumSteps = 4
    /// Drafted tokens of the first tree without estimates.
    static let firstDraft = 4
    static let firstCooldown = 16
    static let maximumCooldown = 256
    /// Verify steps the fallback looks back on.
    static let recentSteps = 8

    private(set) var drafter: any Drafter
    private(set) var costs: any StepCostModel
    let sampling: SamplingParameters
    let maxDraft: Int
    let adaptive: Bool
    private(set) var draftLength: Int
    private(set) var stats = SpeculativeStats()
    private var rng: SeededRandom
    /// Plain steps left before drafting again.
    private var paused = 0
    private var cooldown = firstCooldown
    /// (seconds, tokens) of the last verify steps.
    private var recent: [(seconds: Double, tokens: Int)] = []

    /// Throws when the export has no verify window or `draftTokens` does not fit in it.
    init(_ options: SpeculativeDecoding, sampling: SamplingParameters, verifyWindow: Int) throws {
        guard verifyWindow > 0 else { throw GenerationError.noVerifyWindow }
        if let d = options.draftTokens, d < 1 || d > verifyWindow - 1 {
            throw GenerationError.draftTokensOutOfRange(d, verifyWindow: verifyWindow)
        }
        drafter = options.drafter
        costs = options.costs
        self.sampling = sampling
        maxDraft = options.draftTokens ?? verifyWindow - 1
        adaptive = options.adaptive
        draftLength = min(Self.firstDraft, maxDraft)
        rng = SeededRandom(seed: sampling.seed)
    }

    /// The next token from logits after one token (the prompt's last, or a plain step's).
    mutating func draw(_ logits: [Float]) -> Int {
        TreeAcceptance.draw(TreeAcceptance.probabilities(logits, sampling), rng: &rng)
    }

    /// The tree to verify after `text` (ending with the root) when `room` cache positions are free
    /// after the root's: the root alone (a plain step) on the first step, while drafting is paused,
    /// when nothing fits or is found, or when no part of an estimated tree pays.
    mutating func tree(after text: [Int], room: Int) -> DraftTree {
        guard let root = text.last else { preconditionFailure("speculative decoding needs a root token") }
        let estimates = drafter.estimates
        let first = stats.decodeSteps == 0
        if paused > 0 || (first && !estimates) {
            paused = max(0, paused - 1)
            return DraftTree(root: root)
        }
        let k = min(adaptive && !estimates ? draftLength : maxDraft, room)
        let tree = k >= 1 ? drafter.draft(text, k: k) : DraftTree(root: root)
        if first { return DraftTree(root: root) }
        return adaptive && tree.estimated ? tree.planned(by: costs) : tree
    }

    /// The accepted path of `tree` and the next token (see `TreeAcceptance.choose`).
    mutating func choose(_ tree: DraftTree, logits: [[Float]]) -> (path: [Int], next: Int) {
        TreeAcceptance.choose(tree, logits: logits, sampling: sampling, rng: &rng)
    }

    /// Records a plain step of `seconds`.
    mutating func recordDecode(seconds: Double) {
        stats.decodeSteps += 1
        stats.decodeSeconds += seconds
        costs.plain(seconds: seconds)
    }

    /// Records a verify step of `seconds` that kept `path` of `tree`: adapts the tree size and,
    /// for a tree without estimates, pauses drafting when it does not pay.
    mutating func recordVerify(seconds: Double, tree: DraftTree, path: [Int]) {
        let leaf = tree.children(of: path[path.count - 1]).isEmpty
        draftLength = leaf ? min(draftLength + 2, maxDraft) : max(1, draftLength - 1)
        let accepted = path.count - 1
        stats.verifySteps += 1
        stats.verifySeconds += seconds
        stats.draftedTokens += tree.count - 1
        stats.acceptedTokens += accepted
        costs.verify(nodes: tree.count, seconds: seconds)
        recent = Array((recent + [(seconds: seconds, tokens: accepted + 1)]).suffix(Self.recentSteps))
        if adaptive, !tree.estimated, !pays {
            stats.fallbacks += 1
            paused = cooldown
            cooldown = min(2 * cooldown, Self.maximumCooldown)
            recent = []
        }
    }

    /// Whether the recent verify steps give at least as many tokens per second as plain steps
    /// (true until both have been measured enough to tell).
    var pays: Bool {
        guard recent.count >= Self.minimumSteps, stats.decodeSteps > 0 else { return true }
        let perDecode = stats.decodeSeconds / Double(stats.decodeSteps)
        let seconds = recent.map(\.seconds).reduce(0, +)
        let tokens = Double(recent.map(\.tokens).reduce(0, +))
        guard seconds > 0, perDecode > 0 else { return true }
        return tokens / seconds >= 1 / perDecode
    }

    /// Plain steps left before drafting again.
    var pausedSteps: Int { paused }
}
