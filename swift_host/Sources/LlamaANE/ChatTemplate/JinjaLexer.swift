/// A piece of template source: literal text, a `{{ expression }}` or a `{% statement %}`.
enum JinjaSegment: Equatable {
    case text(String)
    case expression(String)
    case statement(String)
}

/// Cuts a template into segments, applying whitespace control the way transformers configures
/// Jinja (`trim_blocks` and `lstrip_blocks` on) plus the `-` and `+` tag modifiers.
enum JinjaLexer {
    static func segments(_ source: String) throws -> [JinjaSegment] {
        let s = Array(source.unicodeScalars)
        var out: [JinjaSegment] = []
        var text: [Unicode.Scalar] = []
        var i = 0
        var trimNextNewline = false
        var stripNextWhitespace = false

        func flushText() {
            if !text.isEmpty { out.append(.text(String(String.UnicodeScalarView(text)))) }
            text = []
        }

        while i < s.count {
            let isTagStart = s[i] == "{" && i + 1 < s.count && (s[i + 1] == "{" || s[i + 1] == "%" || s[i + 1] == "#")
            if !isTagStart {
                if stripNextWhitespace, s[i].properties.isWhitespace { i += 1; continue }
                stripNextWhitespace = false
                if trimNextNewline {
                    trimNextNewline = false
                    if s[i] == "\n" { i += 1; continue }
                    if s[i] == "\r", i + 1 < s.count, s[i + 1] == "\n" { i += 2; continue }
                }
                text.append(s[i])
                i += 1
                continue
            }
            stripNextWhitespace = false
            trimNextNewline = false
            let kind = s[i + 1]
            let close: Unicode.Scalar = kind == "{" ? "}" : kind == "%" ? "%" : "#"
            var start = i + 2
            let minus = start < s.count && s[start] == "-"
            let plus = start < s.count && s[start] == "+"
            if minus || plus { start += 1 }
            // Find the closing tag (strings in expressions may contain it; skip quoted text).
            var j = start
            var quote: Unicode.Scalar?
            while j + 1 < s.count {
                if let q = quote {
                    if s[j] == "\\" { j += 2; continue }
                    if s[j] == q { quote = nil }
                } else if kind != "#", s[j] == "'" || s[j] == "\"" {
                    quote = s[j]
                } else if s[j] == close, s[j + 1] == "}" {
                    break
                }
                j += 1
            }
            guard j + 1 < s.count else {
                throw TokenizerError.chatTemplate("unclosed \(kind == "{" ? "{{" : kind == "%" ? "{%" : "{#") tag")
            }
            var end = j
            let rightMinus = end > start && s[end - 1] == "-"
            if rightMinus { end -= 1 }
            let body = String(String.UnicodeScalarView(s[start..<max(start, end)]))

            // Whitespace before the tag.
            if minus {
                while let last = text.last, last.properties.isWhitespace { text.removeLast() }
            } else if kind != "{", !plus {
                // lstrip_blocks: drop spaces and tabs between a line start (in the source) and a block tag.
                var k = i
                while k > 0, s[k - 1] == " " || s[k - 1] == "\t" { k -= 1 }
                if k == 0 || s[k - 1] == "\n" {
                    var strip = i - k
                    while strip > 0, let last = text.last, last == " " || last == "\t" { text.removeLast(); strip -= 1 }
                }
            }
            flushText()
            switch kind {
            case "{": out.append(.expression(body))
            case "%": out.append(.statement(body))
            default: break  // comment
            }
            i = j + 2
            if rightMinus {
                stripNextWhitespace = true
            } else if kind != "{" {
                trimNextNewline = true  // trim_blocks
            }
        }
        flushText()
        return out
    }
}

/// A token of a Jinja expression or statement.
enum JinjaToken: Equatable {
    case name(String)
    case string(String)
    case int(Int)
    case double(Double)
    case op(String)
}

/// Splits the inside of a tag into tokens.
enum JinjaTokenizer {
    private static let operators = ["//", "**", "==", "!=", "<=", ">=", "+", "-", "*", "/", "%", "~", "<", ">",
                                    "(", ")", "[", "]", "{", "}", ",", ".", ":", "|", "="]

    static func tokens(_ source: String) throws -> [JinjaToken] {
        let s = Array(source.unicodeScalars)
        var out: [JinjaToken] = []
        var i = 0
        while i < s.count {
            let c = s[i]
            if c.properties.isWhitespace { i += 1; continue }
            if c == "'" || c == "\"" {
                var value = String.UnicodeScalarView()
                i += 1
                while i < s.count, s[i] != c {
                    if s[i] == "\\", i + 1 < s.count {
                        i += 1
                        switch s[i] {
                        case "n": value.append("\n")
                        case "t": value.append("\t")
                        case "r": value.append("\r")
                        default: value.append(s[i])
                        }
                    } else {
                        value.append(s[i])
                    }
                    i += 1
                }
                guard i < s.count else { throw TokenizerError.chatTemplate("unterminated string in \(source)") }
                i += 1
                out.append(.string(String(value)))
                continue
            }
            if ("0"..."9").contains(c) {
                var j = i
                while j < s.count, ("0"..."9").contains(s[j]) || s[j] == "." || s[j] == "_" { j += 1 }
                let text = String(String.UnicodeScalarView(s[i..<j])).replacingOccurrences(of: "_", with: "")
                if text.contains("."), let d = Double(text) { out.append(.double(d)) } else if let n = Int(text) { out.append(.int(n)) } else {
                    throw TokenizerError.chatTemplate("bad number \(text)")
                }
                i = j
                continue
            }
            if c == "_" || c.properties.isAlphabetic {
                var j = i
                while j < s.count, s[j] == "_" || s[j].properties.isAlphabetic || ("0"..."9").contains(s[j]) { j += 1 }
                out.append(.name(String(String.UnicodeScalarView(s[i..<j]))))
                i = j
                continue
            }
            guard let op = operators.first(where: { op in
                let o = Array(op.unicodeScalars)
                return i + o.count <= s.count && Array(s[i..<i + o.count]) == o
            }) else {
                throw TokenizerError.chatTemplate("unexpected character \"\(c)\" in \(source)")
            }
            out.append(.op(op))
            i += op.unicodeScalars.count
        }
        return out
    }
}
