/// One branch of a cascade decode: tokens to feed first (e.g. a question after a shared document;
/// empty to start by sampling from the prefix's logits), how to sample, and how many new tokens.
public struct BranchRequest: Equatable, Sendable {
    public var forcedTokens: [Int]
    public var sampling: SamplingParameters
    public var maxNewTokens: Int

    public init(forcedTokens: [Int] = [], sampling: SamplingParameters = .greedy, maxNewTokens: Int) {
        self.forcedTokens = forcedTokens
        self.sampling = sampling
        self.maxNewTokens = maxNewTokens
    }
}

/// A finished branch: the tokens it generated (forced tokens not included).
public struct BranchResult: Equatable, Sendable {
    public var tokens: [Int]
    public var stopReason: FinishReason
}

/// One call of the "decode_branches" function: `branchWidth` slots, each with one input token
/// written to that slot's private suffix cache at `suffixPositions[slot]` and attending to the
/// shared prefix (`prefixLength` tokens) plus its own suffix. Inactive slots (finished branches,
/// or no branch) carry token 0 and must not change anything; the model masks them out.
public struct BranchStep: Equatable, Sendable {
    public var group: Int
    /// The branch index each slot holds, nil for an unused slot.
    public var branches: [Int?]
    public var tokens: [Int32]
    public var active: [Bool]
    public var suffixPositions: [Int]
    public var prefixLength: Int
    /// True on a group's first step: the slots' suffix caches start empty.
    public var startsGroup: Bool
    /// Each slot's branch's tokens written so far (its suffix cache's length; through the prefill
    /// window, its tokens in the cache after the prefix), finished branches' too; 0 for an unused slot.
    public var written: [Int]
    /// The steps its group ran before this one (0 on the group's first).
    public var step: Int
}

/// The cascade branch scheduler of the device runtime, as pure logic. B branches share one prefix
/// cache and have private suffix caches (or, through the prefill window, their tokens side by side
/// after the prefix in the one cache); more branches than the exported width run in groups of
/// `branchWidth`; branches that stop are masked out while the rest of their group continues.
/// Each branch has its own sampler, so its tokens do not depend on the grouping.
public struct CascadeScheduler: Sendable {
    public let branchWidth: Int
    public let prefixLength: Int
    /// Positions of each slot's private suffix cache.
    public let suffixCapacity: Int
    public let eosTokenIds: Set<Int>

    public init(branchWidth: Int, prefixLength: Int, suffixCapacity: Int, eosTokenIds: Set<Int>) {
        self.branchWidth = branchWidth
        self.prefixLength = prefixLength
        self.suffixCapacity = suffixCapacity
        self.eosTokenIds = eosTokenIds
    }

    private struct BranchState {
        var toFeed: [Int]
        var generated: [Int] = []
        var suffixLength = 0
        var sampler: Sampler
        var stop: FinishReason?
        let maxNewTokens: Int

        /// Samples the next token from `logits` and decides whether the branch goes on.
        mutating func take(_ logits: [Float], eos: Set<Int>) {
            let token = sampler.sample(logits)
            generated.append(token)
            if eos.contains(token) {
                stop = .eos
            } else if generated.count >= maxNewTokens {
                stop = .length
            } else {
                toFeed = [token]
            }
        }
    }

    /// Runs every branch to its end. `prefixLogits` are the logits after the shared prefix; `step`
    /// runs the model on one `BranchStep` and returns logits for each of the `branchWidth` slots.
    public func run(_ requests: [BranchRequest], prefixLogits: [Float],
                    step: (BranchStep) async throws -> [[Float]]) async throws -> [BranchResult] {
        guard branchWidth > 0 else { throw GenerationError.noBranchWidth }
        var states = requests.map { r -> BranchState in
            var s = BranchState(toFeed: r.forcedTokens, sampler: Sampler(r.sampling), maxNewTokens: r.maxNewTokens)
            if r.maxNewTokens <= 0 {
                s.stop = .length
            } else if r.forcedTokens.isEmpty {
                s.take(prefixLogits, eos: eosTokenIds)
            }
            return s
        }
        for (group, start) in stride(from: 0, to: requests.count, by: branchWidth).enumerated() {
            let members = Array(start..<min(start + branchWidth, requests.count))
            var first = true
            var stepsRun = 0
            while true {
                for b in members where states[b].stop == nil && states[b].suffixLength >= suffixCapacity {
                    states[b].stop = .context
                }
                let slots: [Int?] = (0..<branchWidth).map { $0 < members.count ? members[$0] : nil }
                let active = slots.map { b in b.map { states[$0].stop == nil } ?? false }
                guard active.contains(true) else { break }
                let request = BranchStep(
                    group: group,
                    branches: slots,
                    tokens: zip(slots, active).map { b, on in on ? Int32(truncatingIfNeeded: states[b!].toFeed[0]) : 0 },
                    active: active,
                    suffixPositions: zip(slots, active).map { b, on in on ? states[b!].suffixLength : 0 },
                    prefixLength: prefixLength,
                    startsGroup: first,
                    written: slots.map { b in b.map { states[$0].suffixLength } ?? 0 },
                    step: stepsRun)
                first = false
                stepsRun += 1
                let logits = try await step(request)
                guard logits.count == branchWidth else {
                    throw GenerationError.badLogits(expected: branchWidth, got: logits.count)
                }
                for (slot, b) in slots.enumerated() where active[slot] {
                    let b = b!
                    states[b].toFeed.removeFirst()
                    states[b].suffixLength += 1
                    if states[b].toFeed.isEmpty { states[b].take(logits[slot], eos: eosTokenIds) }
                }
            }
        }
        return states.map { BranchResult(tokens: $0.generated, stopReason: $0.stop ?? .length) }
    }
}
