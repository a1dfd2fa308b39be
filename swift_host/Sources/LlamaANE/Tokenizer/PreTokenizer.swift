import Foundation

/// A piece of text on its way to the BPE model. `atStart` says whether it begins at offset 0 of
/// the caller's text: Metaspace with `prepend_scheme: "first"` only prefixes that piece.
struct TextPiece: Equatable {
    var text: String
    var atStart: Bool
}

/// Whether and when a Metaspace pre-tokenizer prefixes "▁".
enum PrependScheme: String {
    case always, first, never

    /// The scheme of a Metaspace pre-tokenizer or decoder; older files say `add_prefix_space`.
    init(metaspace json: JSONValue) throws {
        if let name = json["prepend_scheme"]?.stringValue {
            guard let scheme = PrependScheme(rawValue: name) else {
                throw TokenizerError.unsupported(component: "Metaspace prepend_scheme", type: name)
            }
            self = scheme
        } else {
            self = json["add_prefix_space"]?.boolValue == false ? .never : .always
        }
    }
}

/// The `pre_tokenizer` section of tokenizer.json: splits text into the words BPE runs on.
indirect enum PreTokenizer {
    case sequence([PreTokenizer])
    /// Byte-level: optional leading space, optional GPT-2 regex split, then bytes -> scalars.
    case byteLevel(addPrefixSpace: Bool, splitter: RegexSplitter?)
    case split(RegexSplitter)
    case metaspace(replacement: String, prependScheme: PrependScheme, splitter: RegexSplitter?)

    static func from(json: JSONValue?) throws -> PreTokenizer? {
        guard let json, !json.isNull else { return nil }
        guard let type = json["type"]?.stringValue else { throw TokenizerError.malformed("pre_tokenizer without a type") }
        switch type {
        case "Sequence":
            return .sequence(try (json["pretokenizers"]?.arrayValue ?? []).compactMap { try from(json: $0) })
        case "ByteLevel":
            let useRegex = json["use_regex"]?.boolValue ?? true
            return .byteLevel(addPrefixSpace: json["add_prefix_space"]?.boolValue ?? true,
                              splitter: useRegex ? try RegexSplitter(pattern: ByteLevel.gpt2Pattern, behavior: .isolated) : nil)
        case "Split":
            let behaviorName = json["behavior"]?.stringValue ?? "Isolated"
            guard let behavior = SplitBehavior(rawValue: behaviorName) else {
                throw TokenizerError.unsupported(component: "Split behavior", type: behaviorName)
            }
            let invert = json["invert"]?.boolValue ?? false
            if let literal = json["pattern"]?["String"]?.stringValue {
                return .split(try RegexSplitter(literal: literal, behavior: behavior, invert: invert))
            }
            if let pattern = json["pattern"]?["Regex"]?.stringValue {
                return .split(try RegexSplitter(pattern: pattern, behavior: behavior, invert: invert))
            }
            throw TokenizerError.malformed("Split pre-tokenizer without a String or Regex pattern")
        case "Metaspace":
            let replacement = json["replacement"]?.stringValue ?? "▁"
            let scheme = try PrependScheme(metaspace: json)
            let split = json["split"]?.boolValue ?? true
            return .metaspace(replacement: replacement, prependScheme: scheme,
                              splitter: split ? try RegexSplitter(literal: replacement, behavior: .mergedWithNext) : nil)
        case "Digits":
            let individual = json["individual_digits"]?.boolValue ?? false
            return .split(try RegexSplitter(pattern: #"\p{N}"#, behavior: individual ? .isolated : .contiguous))
        case "Whitespace":
            return .split(try RegexSplitter(pattern: #"\w+|[^\w\s]+"#, behavior: .removed, invert: true))
        case "WhitespaceSplit":
            return .split(try RegexSplitter(pattern: #"\s+"#, behavior: .removed))
        default:
            throw TokenizerError.unsupported(component: "pre_tokenizer", type: type)
        }
    }

    func apply(_ pieces: [TextPiece]) -> [TextPiece] {
        switch self {
        case let .sequence(items):
            return items.reduce(pieces) { $1.apply($0) }
        case let .byteLevel(addPrefixSpace, splitter):
            return pieces.flatMap { piece -> [TextPiece] in
                var text = piece.text
                if addPrefixSpace, !TextReplace.hasPrefix(text, " ") { text = " " + text }
                let parts = Self.split(TextPiece(text: text, atStart: piece.atStart), with: splitter)
                return parts.map { TextPiece(text: ByteLevel.encode($0.text), atStart: $0.atStart) }
            }
        case let .split(splitter):
            return pieces.flatMap { Self.split($0, with: splitter) }
        case let .metaspace(replacement, scheme, splitter):
            return pieces.flatMap { piece -> [TextPiece] in
                var text = TextReplace.replacingAll(in: piece.text, of: " ", with: replacement)
                let starts = TextReplace.hasPrefix(text, replacement)
                if !starts, scheme == .always || (scheme == .first && piece.atStart) { text = replacement + text }
                return Self.split(TextPiece(text: text, atStart: piece.atStart), with: splitter)
            }
        }
    }

    private static func split(_ piece: TextPiece, with splitter: RegexSplitter?) -> [TextPiece] {
        guard let splitter else { return piece.text.isEmpty ? [] : [piece] }
        return splitter.split(piece.text).enumerated().map { TextPiece(text: $1, atStart: piece.atStart && $0 == 0) }
    }
}
