/// Turns a growing list of token ids into text deltas. A delta is held back while the tail decodes
/// to U+FFFD (an incomplete UTF-8 sequence split over byte tokens), and text is decoded from a
/// short recent window so that decoders that strip a leading space affect both sides equally.
public struct StreamingDetokenizer {
    private let decode: ([Int]) -> String
    private var ids: [Int] = []
    private var prefixOffset = 0
    private var readOffset = 0

    /// `decode` is usually `{ tokenizer.decode($0, skipSpecialTokens: true) }`.
    public init(decode: @escaping ([Int]) -> String) {
        self.decode = decode
    }

    /// Adds `id` and returns the text it completes (possibly empty).
    public mutating func append(_ id: Int) -> String {
        ids.append(id)
        return delta(allowIncomplete: false)
    }

    /// The text still held back (an incomplete character decodes as U+FFFD here).
    public mutating func finish() -> String {
        delta(allowIncomplete: true)
    }

    private mutating func delta(allowIncomplete: Bool) -> String {
        let prefixScalars = Array(decode(Array(ids[prefixOffset..<readOffset])).unicodeScalars)
        let newScalars = Array(decode(Array(ids[prefixOffset...])).unicodeScalars)
        guard newScalars.count > prefixScalars.count, allowIncomplete || newScalars.last != "\u{FFFD}" else { return "" }
        var common = 0
        while common < prefixScalars.count, prefixScalars[common] == newScalars[common] { common += 1 }
        prefixOffset = readOffset
        readOffset = ids.count
        var text = String.UnicodeScalarView()
        text.append(contentsOf: newScalars[common...])
        return String(text)
    }
}
