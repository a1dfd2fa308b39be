/// Turns a generation's tokens into stream events: the text each one completes, and whether it
/// ends the generation.
struct TokenEvents {
    let maxNewTokens: Int
    let eosTokenIds: Set<Int>
    /// Holds back the bytes of incomplete characters; nil leaves the texts empty.
    var text: StreamingDetokenizer?

    /// The event for the next generated `token`, and whether it ends the generation (an
    /// end-of-sequence id, recorded as `.eos` in `stats`, or the `maxNewTokens`-th token).
    mutating func next(_ token: Int, stats: inout GenerationStats) -> (event: GenerationEvent, done: Bool) {
        stats.generatedTokens += 1
        var piece = text?.append(token) ?? ""
        let endOfSequence = eosTokenIds.contains(token)
        let done = endOfSequence || stats.generatedTokens >= maxNewTokens
        if done, var t = text { piece += t.finish() }
        if endOfSequence { stats.stopReason = .eos }
        return (.token(id: token, text: piece), done)
    }
}
