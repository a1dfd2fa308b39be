import Foundation

/// How a `Split`-style pre-tokenizer treats the pieces its pattern matches
/// (the `behavior` field of Hugging Face's `Split`).
enum SplitBehavior: String {
    case removed = "Removed"
    case isolated = "Isolated"
    case mergedWithPrevious = "MergedWithPrevious"
    case mergedWithNext = "MergedWithNext"
    case contiguous = "Contiguous"
}

/// Splits text around the matches of an ICU regular expression, working on Unicode scalars
/// (never on grapheme clusters, which could glue a combining mark to the wrong piece).
struct RegexSplitter {
    let regex: NSRegularExpression
    let behavior: SplitBehavior
    let invert: Bool

    init(pattern: String, behavior: SplitBehavior, invert: Bool = false) throws {
        do {
            regex = try NSRegularExpression(pattern: pattern, options: [])
        } catch {
            throw TokenizerError.malformed("the regex \(pattern) does not compile: \(error)")
        }
        self.behavior = behavior
        self.invert = invert
    }

    init(literal: String, behavior: SplitBehavior, invert: Bool = false) throws {
        try self.init(pattern: NSRegularExpression.escapedPattern(for: literal), behavior: behavior, invert: invert)
    }

    /// The pieces of `text`; empty pieces are dropped, as Hugging Face does.
    func split(_ text: String) -> [String] {
        let ns = NSString(string: text)
        let full = NSRange(location: 0, length: ns.length)
        // Alternate (range, isMatch) spans covering the whole text.
        var spans: [(NSRange, Bool)] = []
        var cursor = 0
        for m in regex.matches(in: text, options: [], range: full) where m.range.length > 0 {
            if m.range.location > cursor {
                spans.append((NSRange(location: cursor, length: m.range.location - cursor), false))
            }
            spans.append((m.range, true))
            cursor = m.range.location + m.range.length
        }
        if cursor < ns.length { spans.append((NSRange(location: cursor, length: ns.length - cursor), false)) }
        if invert { spans = spans.map { ($0.0, !$0.1) } }

        // Mirrors Hugging Face: a match merges into its neighbour only when that neighbour is not
        // itself a match, so "▁▁a" split MergedWithNext on "▁" gives "▁", "▁a".
        var pieces: [NSRange] = []
        switch behavior {
        case .removed:
            pieces = spans.filter { !$0.1 }.map { $0.0 }
        case .isolated:
            pieces = spans.map { $0.0 }
        case .mergedWithPrevious:
            var previousWasMatch = false
            for (range, isMatch) in spans {
                if isMatch, !previousWasMatch, let last = pieces.popLast() {
                    pieces.append(NSUnionRange(last, range))
                } else {
                    pieces.append(range)
                }
                previousWasMatch = isMatch
            }
        case .mergedWithNext:
            var nextWasMatch = false
            for (range, isMatch) in spans.reversed() {
                if isMatch, !nextWasMatch, let last = pieces.popLast() {
                    pieces.append(NSUnionRange(last, range))
                } else {
                    pieces.append(range)
                }
                nextWasMatch = isMatch
            }
            pieces.reverse()
        case .contiguous:
            var previousWasMatch = false
            for (range, isMatch) in spans {
                if isMatch == previousWasMatch, let last = pieces.popLast() {
                    pieces.append(NSUnionRange(last, range))
                } else {
                    pieces.append(range)
                }
                previousWasMatch = isMatch
            }
        }
        return pieces.filter { $0.length > 0 }.map { ns.substring(with: $0) }
    }
}
