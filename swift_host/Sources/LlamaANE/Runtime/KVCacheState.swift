/// Bookkeeping of one KV cache: the token ids whose K/V it holds, in order, and how a run of tokens
/// is cut into windows. Position = number of tokens in the cache; a window never starts past the
/// real tokens and a run that would overflow the cache is refused before anything runs.
///
/// The cache can be rewound to keep only a prefix of its tokens (to reuse it for a prompt that
/// starts the same way). The K/V past the position then stay where they are, stale: every exported
/// function masks the positions at and past the one it is given, and the next windows overwrite them.
///
/// Where the sliding layers keep a ring buffer (`cache.sliding`), position p lives in slot p mod R,
/// and the slots of forgotten tokens are taken for older positions by the masks: a rewind that
/// forgets more than `rewindLimit` tokens cannot serve the ones it keeps, and keeps none. Where the
/// model has conv layers (`cache.conv`), their state holds only the last tokens' values and cannot
/// go back at all: `rewindLimit` is 0, and a rewind by any token keeps none.
public struct KVCacheState: Equatable, Sendable {
    public let capacity: Int
    public let prefillLength: Int
    /// A prefill window must fit in the cache whole, padding included (the caches are Core ML
    /// states, written a whole window at a time): tokens too close to the end run one at a time.
    public let paddedWindowsMustFit: Bool
    /// Tokens a rewind may forget and still keep the rest (`Manifest.rewindLimit`); nil: any.
    public let rewindLimit: Int?
    /// The prefill window decodes (`Manifest.prefillDecodes`, format_version 4): a decoded token runs
    /// as a prefill window of one real token padded to `prefillLength`, there being no decode functions.
    public let decodesInPrefillWindow: Bool
    /// The token ids whose K/V the cache holds, in position order.
    public private(set) var tokens: [Int] = []

    public init(capacity: Int, prefillLength: Int, paddedWindowsMustFit: Bool = false, rewindLimit: Int? = nil,
                decodesInPrefillWindow: Bool = false) {
        precondition(capacity > 0 && prefillLength > 0, "cache capacity and prefill length must be positive")
        self.capacity = capacity
        self.prefillLength = prefillLength
        self.paddedWindowsMustFit = paddedWindowsMustFit
        self.rewindLimit = rewindLimit
        self.decodesInPrefillWindow = decodesInPrefillWindow
    }

    /// Filled positions: where the next window starts.
    public var position: Int { tokens.count }

    /// Free positions.
    public var remaining: Int { capacity - position }

    /// How many leading tokens of `prompt` the cache can keep: the longest common prefix of the two,
    /// but never the whole prompt, since its last token must run to give the next-token logits;
    /// none where keeping them would forget more than `rewindLimit` tokens.
    public func reusablePrefix(of prompt: [Int]) -> Int {
        let common = zip(tokens, prompt).prefix { $0 == $1 }.count
        return servable(max(min(common, prompt.count - 1), 0))
    }

    /// Keeps the first `count` tokens and forgets the rest (their K/V become stale, see above), or,
    /// where that forgets more than `rewindLimit` tokens, keeps none. Returns the tokens kept.
    @discardableResult
    public mutating func rewind(to count: Int) -> Int {
        precondition(count >= 0 && count <= position, "cannot rewind a cache of \(position) tokens to \(count)")
        let kept = servable(count)
        tokens.removeLast(position - kept)
        return kept
    }

    /// `count`, or 0 where keeping only `count` tokens would forget more than `rewindLimit`.
    private func servable(_ count: Int) -> Int {
        guard let limit = rewindLimit, position - count > limit else { return count }
        return 0
    }

    /// The prefill windows for `tokens` at the current position: chunks of `prefillLength`, the last
    /// padded with 0 (with `paddedWindowsMustFit`, one-token decode windows where a padded window
    /// would pass the end; where the prefill window decodes, the states have room for its padding and
    /// the predictor does not ask for that). Throws `contextFull` when they do not fit.
    public func prefillWindows(_ tokens: [Int]) throws -> [TokenWindow] {
        guard !tokens.isEmpty else { throw GenerationError.emptyPrompt }
        guard tokens.count <= remaining else {
            throw GenerationError.contextFull(position: position, requested: tokens.count, capacity: capacity)
        }
        var windows: [TokenWindow] = []
        var start = 0
        while start < tokens.count {
            if paddedWindowsMustFit, position + start + prefillLength > capacity {
                windows.append(oneToken(tokens[start], at: position + start))
                start += 1
                continue
            }
            let real = tokens[start..<min(start + prefillLength, tokens.count)].map { Int32(truncatingIfNeeded: $0) }
            let padded = real + Array(repeating: 0, count: prefillLength - real.count)
            windows.append(TokenWindow(phase: .prefill, tokens: padded, count: real.count, position: position + start))
            start += prefillLength
        }
        return windows
    }

    /// The decode window for one token (with `decodesInPrefillWindow`, a prefill window of that one
    /// real token). Throws `contextFull` when the cache is full.
    public func decodeWindow(_ token: Int) throws -> TokenWindow {
        guard remaining >= 1 else { throw GenerationError.contextFull(position: position, requested: 1, capacity: capacity) }
        return oneToken(token, at: position)
    }

    /// The window of one token at `position`: a decode window, or where the prefill window decodes, a
    /// prefill window of one real token padded with 0.
    private func oneToken(_ token: Int, at position: Int) -> TokenWindow {
        let id = Int32(truncatingIfNeeded: token)
        guard decodesInPrefillWindow else { return TokenWindow(phase: .decode, tokens: [id], count: 1, position: position) }
        return TokenWindow(phase: .prefill, tokens: [id] + Array(repeating: 0, count: prefillLength - 1), count: 1,
                           position: position)
    }

    /// Records that `window` ran: its real tokens are now in the cache.
    public mutating func commit(_ window: TokenWindow) {
        precondition(window.position == position, "window at \(window.position) committed at position \(position)")
        precondition(window.count <= remaining, "window overflows the cache")
        tokens += window.tokens[..<window.count].map { Int($0) }
    }

    /// Records that a verify step's accepted `tokens` (its tree's root and the drafts kept) were
    /// written to the cache at the current position.
    public mutating func commitAccepted(_ tokens: [Int]) {
        precondition(tokens.count <= remaining, "\(tokens.count) accepted tokens overflow the cache at \(position) of \(capacity)")
        self.tokens += tokens
    }

    /// Empties the cache.
    public mutating func reset() { tokens = [] }

    /// Tokens a context shift keeps: the first `keep` and half of the cache's other positions.
    /// Throws `contextFull` when keeping `keep` tokens leaves no room to go on.
    public func shiftLimit(keep: Int) throws -> Int {
        guard keep >= 0, keep <= capacity - 2 else {
            throw GenerationError.contextFull(position: keep, requested: 2, capacity: capacity)
        }
        return keep + (capacity - keep) / 2
    }

    /// Context shift: the first `keep` tokens (e.g. the system prompt) and the most recent ones, at
    /// most `shiftLimit(keep:)` in all; `tokens` itself when they are no more.
    public func shifted(_ tokens: [Int], keep: Int) throws -> [Int] {
        let limit = try shiftLimit(keep: keep)
        guard tokens.count > limit else { return tokens }
        return Array(tokens.prefix(keep)) + Array(tokens.suffix(limit - keep))
    }
}
