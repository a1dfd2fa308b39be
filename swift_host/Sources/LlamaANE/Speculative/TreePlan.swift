/// The part of an estimated tree worth verifying, as Python's `speculative.plan`.
extension DraftTree {
    /// The n best-ranked nodes (`ranked`) for the n that maximises the expected tokens per cost,
    /// (1 + the sum of their chances) / `costs.cost(nodes: n + 1)`; the root alone when no n gives
    /// more than a plain step (1 token per plain step).
    public func planned(by costs: some StepCostModel) -> DraftTree {
        var best = 0, bestRate = 1.0, expected = 1.0
        let ranked = ranked()
        for (i, node) in ranked.enumerated() {
            expected += node.chance
            let rate = expected / costs.cost(nodes: i + 2)
            if rate > bestRate { (best, bestRate) = (i + 1, rate) }
        }
        return keep(ranked.prefix(best).map(\.node))
    }
}
