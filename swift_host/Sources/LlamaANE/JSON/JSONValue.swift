import Foundation

/// A parsed JSON document that keeps object keys in file order and strings exactly as written.
///
/// `tokenizer.json` is read with this instead of `JSONSerialization` because Swift compares
/// `String`s by canonical equivalence: two vocabulary entries such as `"é"` (U+00E9) and `"e\u{301}"`
/// would collapse into one dictionary key. Here object keys stay a list of pairs, and the tokenizer
/// keys its tables by UTF-8 bytes.
enum JSONValue: Equatable {
    case null
    case bool(Bool)
    case number(Double)
    case string(String)
    case array([JSONValue])
    case object([(String, JSONValue)])

    static func == (lhs: JSONValue, rhs: JSONValue) -> Bool {
        switch (lhs, rhs) {
        case (.null, .null): return true
        case let (.bool(a), .bool(b)): return a == b
        case let (.number(a), .number(b)): return a == b
        case let (.string(a), .string(b)): return Array(a.utf8) == Array(b.utf8)
        case let (.array(a), .array(b)): return a == b
        case let (.object(a), .object(b)):
            return a.count == b.count && zip(a, b).allSatisfy { Array($0.0.utf8) == Array($1.0.utf8) && $0.1 == $1.1 }
        default: return false
        }
    }

    /// Parses UTF-8 JSON text.
    static func parse(_ data: Data) throws -> JSONValue {
        var parser = JSONParser(bytes: [UInt8](data))
        return try parser.parseDocument()
    }

    /// The value of `key` in an object (first occurrence), or nil.
    subscript(key: String) -> JSONValue? {
        guard case let .object(pairs) = self else { return nil }
        return pairs.first { $0.0 == key }?.1
    }

    var stringValue: String? { if case let .string(s) = self { return s }; return nil }
    var boolValue: Bool? { if case let .bool(b) = self { return b }; return nil }
    var doubleValue: Double? { if case let .number(n) = self { return n }; return nil }
    var intValue: Int? {
        guard case let .number(n) = self, n == n.rounded(), abs(n) < 9.0e15 else { return nil }
        return Int(n)
    }
    var arrayValue: [JSONValue]? { if case let .array(a) = self { return a }; return nil }
    var objectValue: [(String, JSONValue)]? { if case let .object(o) = self { return o }; return nil }
    var isNull: Bool { if case .null = self { return true }; return false }
}

/// A JSON syntax error with the byte offset where parsing stopped.
struct JSONParseError: Error, CustomStringConvertible {
    let offset: Int
    let reason: String
    var description: String { "invalid JSON at byte \(offset): \(reason)" }
}

private struct JSONParser {
    let bytes: [UInt8]
    var pos = 0

    init(bytes: [UInt8]) { self.bytes = bytes }

    mutating func parseDocument() throws -> JSONValue {
        let value = try parseValue()
        skipWhitespace()
        if pos != bytes.count { throw fail("unexpected trailing characters") }
        return value
    }

    func fail(_ reason: String) -> JSONParseError { JSONParseError(offset: pos, reason: reason) }

    mutating func skipWhitespace() {
        while pos < bytes.count, [0x20, 0x09, 0x0A, 0x0D].contains(bytes[pos]) { pos += 1 }
    }

    mutating func parseValue() throws -> JSONValue {
        skipWhitespace()
        guard pos < bytes.count else { throw fail("unexpected end of input") }
        switch bytes[pos] {
        case UInt8(ascii: "{"): return try parseObject()
        case UInt8(ascii: "["): return try parseArray()
        case UInt8(ascii: "\""): return .string(try parseString())
        case UInt8(ascii: "t"): try expect("true"); return .bool(true)
        case UInt8(ascii: "f"): try expect("false"); return .bool(false)
        case UInt8(ascii: "n"): try expect("null"); return .null
        default: return try parseNumber()
        }
    }

    mutating func expect(_ word: String) throws {
        let w = Array(word.utf8)
        guard pos + w.count <= bytes.count, Array(bytes[pos..<pos + w.count]) == w else { throw fail("expected \(word)") }
        pos += w.count
    }

    mutating func parseObject() throws -> JSONValue {
        pos += 1
        var pairs: [(String, JSONValue)] = []
        skipWhitespace()
        if pos < bytes.count, bytes[pos] == UInt8(ascii: "}") { pos += 1; return .object(pairs) }
        while true {
            skipWhitespace()
            guard pos < bytes.count, bytes[pos] == UInt8(ascii: "\"") else { throw fail("expected an object key") }
            let key = try parseString()
            skipWhitespace()
            guard pos < bytes.count, bytes[pos] == UInt8(ascii: ":") else { throw fail("expected ':'") }
            pos += 1
            pairs.append((key, try parseValue()))
            skipWhitespace()
            guard pos < bytes.count else { throw fail("unterminated object") }
            if bytes[pos] == UInt8(ascii: ",") { pos += 1; continue }
            if bytes[pos] == UInt8(ascii: "}") { pos += 1; return .object(pairs) }
            throw fail("expected ',' or '}'")
        }
    }

    mutating func parseArray() throws -> JSONValue {
        pos += 1
        var items: [JSONValue] = []
        skipWhitespace()
        if pos < bytes.count, bytes[pos] == UInt8(ascii: "]") { pos += 1; return .array(items) }
        while true {
            items.append(try parseValue())
            skipWhitespace()
            guard pos < bytes.count else { throw fail("unterminated array") }
            if bytes[pos] == UInt8(ascii: ",") { pos += 1; continue }
            if bytes[pos] == UInt8(ascii: "]") { pos += 1; return .array(items) }
            throw fail("expected ',' or ']'")
        }
    }

    mutating func parseHex4() throws -> UInt32 {
        guard pos + 4 <= bytes.count else { throw fail("short \\u escape") }
        var v: UInt32 = 0
        for _ in 0..<4 {
            let c = bytes[pos]
            let d: UInt32
            switch c {
            case 0x30...0x39: d = UInt32(c - 0x30)
            case 0x41...0x46: d = UInt32(c - 0x41 + 10)
            case 0x61...0x66: d = UInt32(c - 0x61 + 10)
            default: throw fail("bad hex digit in \\u escape")
            }
            v = v * 16 + d
            pos += 1
        }
        return v
    }

    mutating func parseString() throws -> String {
        pos += 1
        var out: [UInt8] = []
        while true {
            guard pos < bytes.count else { throw fail("unterminated string") }
            let c = bytes[pos]
            if c == UInt8(ascii: "\"") { pos += 1; break }
            if c != UInt8(ascii: "\\") { out.append(c); pos += 1; continue }
            pos += 1
            guard pos < bytes.count else { throw fail("unterminated escape") }
            let e = bytes[pos]
            pos += 1
            switch e {
            case UInt8(ascii: "\""): out.append(0x22)
            case UInt8(ascii: "\\"): out.append(0x5C)
            case UInt8(ascii: "/"): out.append(0x2F)
            case UInt8(ascii: "b"): out.append(0x08)
            case UInt8(ascii: "f"): out.append(0x0C)
            case UInt8(ascii: "n"): out.append(0x0A)
            case UInt8(ascii: "r"): out.append(0x0D)
            case UInt8(ascii: "t"): out.append(0x09)
            case UInt8(ascii: "u"):
                var scalar = try parseHex4()
                if (0xD800..<0xDC00).contains(scalar), pos + 1 < bytes.count,
                   bytes[pos] == UInt8(ascii: "\\"), bytes[pos + 1] == UInt8(ascii: "u") {
                    let save = pos
                    pos += 2
                    let low = try parseHex4()
                    if (0xDC00..<0xE000).contains(low) {
                        scalar = 0x10000 + ((scalar - 0xD800) << 10) + (low - 0xDC00)
                    } else {
                        pos = save
                    }
                }
                // A lone surrogate cannot be UTF-8; Python's json writes it, we read U+FFFD.
                let s = Unicode.Scalar(scalar) ?? "\u{FFFD}"
                out.append(contentsOf: Array(String(s).utf8))
            default: throw fail("unknown escape \\\(Character(Unicode.Scalar(e)))")
            }
        }
        return String(decoding: out, as: UTF8.self)
    }

    mutating func parseNumber() throws -> JSONValue {
        let start = pos
        while pos < bytes.count, "+-0123456789.eE".utf8.contains(bytes[pos]) { pos += 1 }
        guard pos > start, let text = String(bytes: bytes[start..<pos], encoding: .utf8), let n = Double(text) else {
            pos = start
            throw fail("unexpected character")
        }
        return .number(n)
    }
}
