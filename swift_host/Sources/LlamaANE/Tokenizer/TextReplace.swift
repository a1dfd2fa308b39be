import Foundation

/// Exact, scalar-for-scalar text helpers. Foundation's string search may treat canonically
/// equivalent text as equal; tokenizers must not, so these work on UTF-8 bytes.
enum TextReplace {
    /// `text` with every occurrence of `pattern` replaced by `replacement` (left to right, no overlap).
    static func replacingAll(in text: String, of pattern: String, with replacement: String) -> String {
        let p = Array(pattern.utf8)
        guard !p.isEmpty else { return text }
        let t = Array(text.utf8)
        let r = Array(replacement.utf8)
        var out: [UInt8] = []
        out.reserveCapacity(t.count)
        var i = 0
        while i < t.count {
            if t[i] == p[0], i + p.count <= t.count, t[i..<i + p.count].elementsEqual(p) {
                out.append(contentsOf: r)
                i += p.count
            } else {
                out.append(t[i])
                i += 1
            }
        }
        return String(decoding: out, as: UTF8.self)
    }

    /// Whether `text` starts with `prefix`, comparing scalars (not grapheme clusters).
    static func hasPrefix(_ text: String, _ prefix: String) -> Bool {
        text.utf8.starts(with: prefix.utf8)
    }

    /// `text` with every match of `regex` replaced by the literal `replacement`.
    static func replacingMatches(in text: String, of regex: NSRegularExpression, with replacement: String) -> String {
        let ns = NSString(string: text)
        var out = ""
        var cursor = 0
        for m in regex.matches(in: text, options: [], range: NSRange(location: 0, length: ns.length)) {
            out += ns.substring(with: NSRange(location: cursor, length: m.range.location - cursor))
            out += replacement
            cursor = m.range.location + m.range.length
        }
        out += ns.substring(from: cursor)
        return out
    }
}
