/// Which set of exported functions runs: "prefill" (S = prefill_length), "decode" (S = 1; where the
/// prefill window decodes there are none, and a decoded token is a prefill window, `Manifest.runs`),
/// "decode_branches" (one token for each of `branch_width` cascade branches), or "verify" (a
/// drafted token tree of `verify_window` W tokens, for speculative decoding).
public enum Phase: String, Sendable, CaseIterable {
    case prefill
    case decode
    case decodeBranches = "decode_branches"
    case verify
}

/// One model call: `tokens` padded with 0 to the phase's length, of which the first `count` are real,
/// written to the cache at `position ..< position + count`.
public struct TokenWindow: Equatable, Sendable {
    public var phase: Phase
    public var tokens: [Int32]
    public var count: Int
    public var position: Int

    public init(phase: Phase, tokens: [Int32], count: Int, position: Int) {
        self.phase = phase
        self.tokens = tokens
        self.count = count
        self.position = position
    }
}

/// Something that turns token windows into next-token logits while keeping its own KV cache:
/// the Core ML pipeline on Apple platforms, or a closure in tests.
public protocol TokenPredictor: AnyObject {
    /// Tokens the cache holds.
    var contextLength: Int { get }
    /// Length of a prefill window.
    var prefillLength: Int { get }
    /// Runs `window` and returns the logits (vocabulary size) of its last real token.
    ///
    /// `window.position` may lie below positions written before: the generator rewinds the cache
    /// to reuse a common prefix. What the cache holds at and past `window.position` is stale; the
    /// model must not attend to it (the exported functions mask every position from the one they
    /// are given) and the window's K/V overwrite it.
    func predict(_ window: TokenWindow) async throws -> [Float]
    /// Forgets the cached tokens (the next window starts at position 0).
    func reset() async throws
    /// A prefill window must fit in the cache whole, padding included (see `KVCacheState`).
    var paddedWindowsMustFit: Bool { get }
    /// Tokens a rewind may forget and still keep the rest: a ring buffer's limit
    /// (`Manifest.rewindLimit`: 0 with conv layers), nil where any rewind keeps what it is asked to.
    var rewindLimit: Int? { get }
    /// A decoded token runs as a prefill window of one real token (`Manifest.prefillDecodes`): the
    /// export has no decode functions (see `KVCacheState.decodeWindow`).
    var decodesInPrefillWindow: Bool { get }
}

extension TokenPredictor {
    public var paddedWindowsMustFit: Bool { false }
    public var rewindLimit: Int? { nil }
    public var decodesInPrefillWindow: Bool { false }

    /// An empty cache's bookkeeping for this predictor.
    public func emptyCache() -> KVCacheState {
        KVCacheState(capacity: contextLength, prefillLength: prefillLength, paddedWindowsMustFit: paddedWindowsMustFit,
                     rewindLimit: rewindLimit, decodesInPrefillWindow: decodesInPrefillWindow)
    }
}

/// A `TokenPredictor` whose model is a closure: a stand-in for the exported model in tests and
/// previews.
public final class ClosurePredictor: TokenPredictor, @unchecked Sendable {
    public let contextLength: Int
    public let prefillLength: Int
    public let rewindLimit: Int?
    public let decodesInPrefillWindow: Bool
    private let body: (TokenWindow) async throws -> [Float]
    private let onReset: () -> Void

    public init(contextLength: Int, prefillLength: Int, rewindLimit: Int? = nil, decodesInPrefillWindow: Bool = false,
                onReset: @escaping () -> Void = {}, _ body: @escaping (TokenWindow) async throws -> [Float]) {
        self.contextLength = contextLength
        self.prefillLength = prefillLength
        self.rewindLimit = rewindLimit
        self.decodesInPrefillWindow = decodesInPrefillWindow
        self.body = body
        self.onReset = onReset
    }

    public func predict(_ window: TokenWindow) async throws -> [Float] { try await body(window) }
    public func reset() async throws { onReset() }
}
