import Foundation

/// The `normalizer` section of tokenizer.json: text rewrites applied before pre-tokenization
/// (Llama 2 prepends "▁" and turns spaces into "▁" here).
indirect enum Normalizer {
    case sequence([Normalizer])
    case prepend(String)
    case append(String)
    case replace(String, with: String)
    case replaceRegex(NSRegularExpression, with: String)
    case nfc, nfd, nfkc, nfkd
    case lowercase
    case strip(left: Bool, right: Bool)

    /// Builds the normalizer a JSON object describes, or nil for JSON null.
    static func from(json: JSONValue?) throws -> Normalizer? {
        guard let json, !json.isNull else { return nil }
        guard let type = json["type"]?.stringValue else { throw TokenizerError.malformed("normalizer without a type") }
        switch type {
        case "Sequence":
            let items = json["normalizers"]?.arrayValue ?? []
            return .sequence(try items.compactMap { try from(json: $0) })
        case "Prepend":
            return .prepend(json["prepend"]?.stringValue ?? "")
        case "Append":
            return .append(json["append"]?.stringValue ?? "")
        case "Replace":
            let content = json["content"]?.stringValue ?? ""
            if let literal = json["pattern"]?["String"]?.stringValue { return .replace(literal, with: content) }
            if let pattern = json["pattern"]?["Regex"]?.stringValue {
                do { return .replaceRegex(try NSRegularExpression(pattern: pattern), with: content) } catch {
                    throw TokenizerError.malformed("Replace normalizer regex \(pattern) does not compile")
                }
            }
            throw TokenizerError.malformed("Replace normalizer without a String or Regex pattern")
        case "NFC": return .nfc
        case "NFD": return .nfd
        case "NFKC": return .nfkc
        case "NFKD": return .nfkd
        case "Lowercase": return .lowercase
        case "Strip":
            return .strip(left: json["strip_left"]?.boolValue ?? true, right: json["strip_right"]?.boolValue ?? true)
        default:
            throw TokenizerError.unsupported(component: "normalizer", type: type)
        }
    }

    func apply(_ text: String) -> String {
        switch self {
        case let .sequence(items): return items.reduce(text) { $1.apply($0) }
        case let .prepend(p): return text.isEmpty ? text : p + text
        case let .append(a): return text.isEmpty ? text : text + a
        case let .replace(pattern, content): return TextReplace.replacingAll(in: text, of: pattern, with: content)
        case let .replaceRegex(regex, content): return TextReplace.replacingMatches(in: text, of: regex, with: content)
        case .nfc: return text.precomposedStringWithCanonicalMapping
        case .nfd: return text.decomposedStringWithCanonicalMapping
        case .nfkc: return text.precomposedStringWithCompatibilityMapping
        case .nfkd: return text.decomposedStringWithCompatibilityMapping
        case .lowercase: return text.lowercased()
        case let .strip(left, right):
            var scalars = Array(text.unicodeScalars)
            if left { while let f = scalars.first, f.properties.isWhitespace { scalars.removeFirst() } }
            if right { while let l = scalars.last, l.properties.isWhitespace { scalars.removeLast() } }
            var view = String.UnicodeScalarView()
            view.append(contentsOf: scalars)
            return String(view)
        }
    }
}
