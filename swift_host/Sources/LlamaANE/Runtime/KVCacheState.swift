/// Bookkeeping of one KV cache: how many positions are filled, and how a run of tokens is cut
/// into windows. Position = number of tokens already in the cache; a window never starts past
/// the real tokens and a run that would overflow the cache is refused before anything runs.
public struct KVCacheState: Equatable, Sendable {
    public let capacity: Int
    public let prefillLength: Int
    public private(set) var position = 0

    public init(capacity: Int, prefillLength: Int) {
        precondition(capacity > 0 && prefillLength > 0, "cache capacity and prefill length must be positive")
        self.capacity = capacity
        self.prefillLength = prefillLength
    }

    /// Free positions.
    public var remaining: Int { capacity - position }

    /// The prefill windows for `tokens` at the current position: chunks of `prefillLength`, the last
    /// padded with 0. Throws `contextFull` when they do not fit.
    public func prefillWindows(_ tokens: [Int]) throws -> [TokenWindow] {
        guard !tokens.isEmpty else { throw GenerationError.emptyPrompt }
        guard tokens.count <= remaining else {
            throw GenerationError.contextFull(position: position, requested: tokens.count, capacity: capacity)
        }
        var windows: [TokenWindow] = []
        var start = 0
        while start < tokens.count {
            let real = tokens[start..<min(start + prefillLength, tokens.count)].map { Int32(truncatingIfNeeded: $0) }
            let padded = real + Array(repeating: 0, count: prefillLength - real.count)
            windows.append(TokenWindow(phase: .prefill, tokens: padded, count: real.count, position: position + start))
            start += prefillLength
        }
        return windows
    }

    /// The decode window for one token. Throws `contextFull` when the cache is full.
    public func decodeWindow(_ token: Int) throws -> TokenWindow {
        guard remaining >= 1 else { throw GenerationError.contextFull(position: position, requested: 1, capacity: capacity) }
        return TokenWindow(phase: .decode, tokens: [Int32(truncatingIfNeeded: token)], count: 1, position: position)
    }

    /// Records that `window` ran: its real tokens are now in the cache.
    public mutating func commit(_ window: TokenWindow) {
        precondition(window.position == position, "window at \(window.position) committed at position \(position)")
        precondition(window.count <= remaining, "window overflows the cache")
        position += window.count
    }

    /// Empties the cache.
    public mutating func reset() { position = 0 }
}
