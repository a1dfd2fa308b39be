/// One entry of `added_tokens` in tokenizer.json (special tokens such as `<|im_start|>` or `<s>`).
public struct AddedToken: Equatable, Sendable {
    public let id: Int
    public let content: String
    public let special: Bool
    let lstrip: Bool
    let rstrip: Bool
    let singleWord: Bool
    let normalized: Bool

    init(json: JSONValue) throws {
        guard let id = json["id"]?.intValue, let content = json["content"]?.stringValue else {
            throw TokenizerError.malformed("an added_tokens entry lacks id or content")
        }
        self.id = id
        self.content = content
        special = json["special"]?.boolValue ?? false
        lstrip = json["lstrip"]?.boolValue ?? false
        rstrip = json["rstrip"]?.boolValue ?? false
        singleWord = json["single_word"]?.boolValue ?? false
        normalized = json["normalized"]?.boolValue ?? !special
    }
}

/// A stretch of input: plain text for the normalizer and BPE, or an added token's id.
enum Segment: Equatable {
    case text(String, atStart: Bool)
    case token(Int)
}

/// Finds added tokens in text, leftmost first and longest at a position (Hugging Face's
/// Aho-Corasick `LeftmostLongest`), honouring `lstrip`, `rstrip` and `single_word`.
struct AddedTokenMatcher {
    private let byFirstByte: [UInt8: [(bytes: [UInt8], token: AddedToken)]]

    init(_ tokens: [AddedToken]) {
        var table: [UInt8: [(bytes: [UInt8], token: AddedToken)]] = [:]
        for t in tokens where !t.content.isEmpty {
            let b = Array(t.content.utf8)
            table[b[0], default: []].append((b, t))
        }
        for key in table.keys { table[key]!.sort { $0.bytes.count > $1.bytes.count } }
        byFirstByte = table
    }

    var isEmpty: Bool { byFirstByte.isEmpty }

    /// Splits `text` into text and token segments. `atStart` marks text that begins the input.
    func split(_ text: String, atStart: Bool) -> [Segment] {
        let bytes = Array(text.utf8)
        guard !byFirstByte.isEmpty else { return bytes.isEmpty ? [] : [.text(text, atStart: atStart)] }
        var segments: [Segment] = []
        var textStart = 0
        var i = 0
        while i < bytes.count {
            guard let candidates = byFirstByte[bytes[i]],
                  let hit = candidates.first(where: { c in
                      i + c.bytes.count <= bytes.count && bytes[i..<i + c.bytes.count].elementsEqual(c.bytes)
                          && (!c.token.singleWord || Self.isWordBoundary(bytes, i, i + c.bytes.count))
                  })
            else { i += 1; continue }
            var lo = i, hi = i + hit.bytes.count
            if hit.token.lstrip { while lo > textStart, Self.isSpace(bytes[lo - 1]) { lo -= 1 } }
            if hit.token.rstrip { while hi < bytes.count, Self.isSpace(bytes[hi]) { hi += 1 } }
            if lo > textStart {
                segments.append(.text(String(decoding: bytes[textStart..<lo], as: UTF8.self), atStart: atStart && textStart == 0))
            }
            segments.append(.token(hit.token.id))
            i = hi
            textStart = hi
        }
        if textStart < bytes.count {
            segments.append(.text(String(decoding: bytes[textStart...], as: UTF8.self), atStart: atStart && textStart == 0))
        }
        return segments
    }

    private static func isSpace(_ b: UInt8) -> Bool { b == 0x20 || (0x09...0x0D).contains(b) }

    private static func isWordByte(_ b: UInt8) -> Bool {
        b >= 0x80 || b == UInt8(ascii: "_") || (0x30...0x39).contains(b) || (0x41...0x5A).contains(b) || (0x61...0x7A).contains(b)
    }

    private static func isWordBoundary(_ bytes: [UInt8], _ start: Int, _ end: Int) -> Bool {
        (start == 0 || !isWordByte(bytes[start - 1])) && (end == bytes.count || !isWordByte(bytes[end]))
    }
}
