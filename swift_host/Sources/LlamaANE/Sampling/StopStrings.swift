/// Cuts a stream of text at the first stop string, as Python's `TextStream` does
/// (`llama_ane/runtime/text_stream.py`): the text ends just before the earliest occurrence of any stop
/// string, and the generation should then finish with `FinishReason.stop`.
///
/// Push the text deltas a generation streams (`GenerationEvent.token`'s text) in order. Text is
/// counted in Unicode scalars, Python's characters. Deltas are shown as they come: a stop string that
/// begins in text already shown is still found, but only the delta that completes it is cut, so the
/// shown text may end with the stop string's first characters while `text` does not.
public struct StopStrings: Sendable {
    /// The stop strings (empty ones are dropped: they would stop before anything).
    public let stops: [String]
    /// The text so far, cut before the first stop string once one has appeared.
    public var text: String { String(String.UnicodeScalarView(scalars)) }
    /// Whether a stop string has appeared; later pushes show nothing.
    public private(set) var stopped = false

    private let stopScalars: [[Unicode.Scalar]]
    private let longest: Int
    private var scalars: [Unicode.Scalar] = []

    public init(_ stops: [String]) {
        self.stops = stops.filter { !$0.isEmpty }
        stopScalars = self.stops.map { Array($0.unicodeScalars) }
        longest = stopScalars.map(\.count).max() ?? 0
    }

    /// Adds the next text delta and returns the part of it to show: all of it, or, when it completes
    /// a stop string, what comes before the stop string.
    public mutating func push(_ delta: String) -> String {
        guard !stopped, !delta.isEmpty else { return "" }
        let added = Array(delta.unicodeScalars)
        let start = max(0, scalars.count - longest + 1)  // a stop string may begin in text already shown
        scalars += added
        guard let cut = stopScalars.compactMap({ firstIndex(of: $0, from: start) }).min() else { return delta }
        stopped = true
        let shown = max(0, added.count - (scalars.count - cut))
        scalars.removeLast(scalars.count - cut)
        return String(String.UnicodeScalarView(added.prefix(shown)))
    }

    private func firstIndex(of needle: [Unicode.Scalar], from start: Int) -> Int? {
        guard scalars.count >= needle.count, start <= scalars.count - needle.count else { return nil }
        return (start...(scalars.count - needle.count)).first { i in
            scalars[i..<(i + needle.count)].elementsEqual(needle)
        }
    }
}
