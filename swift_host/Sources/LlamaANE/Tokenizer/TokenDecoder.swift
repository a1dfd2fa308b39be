/// The `decoder` section of tokenizer.json: turns token strings back into text.
/// Each stage maps a list of token strings to a new list, as Hugging Face's `decode_chain` does.
indirect enum TokenDecoder {
    case sequence([TokenDecoder])
    case byteLevel
    case replace(String, with: String)
    case byteFallback
    case fuse
    case strip(content: Unicode.Scalar, start: Int, stop: Int)
    case metaspace(replacement: Unicode.Scalar, prependScheme: PrependScheme)

    static func from(json: JSONValue?) throws -> TokenDecoder? {
        guard let json, !json.isNull else { return nil }
        guard let type = json["type"]?.stringValue else { throw TokenizerError.malformed("decoder without a type") }
        switch type {
        case "Sequence":
            return .sequence(try (json["decoders"]?.arrayValue ?? []).compactMap { try from(json: $0) })
        case "ByteLevel":
            return .byteLevel
        case "Replace":
            guard let pattern = json["pattern"]?["String"]?.stringValue else {
                throw TokenizerError.unsupported(component: "Replace decoder pattern", type: "Regex")
            }
            return .replace(pattern, with: json["content"]?.stringValue ?? "")
        case "ByteFallback":
            return .byteFallback
        case "Fuse":
            return .fuse
        case "Strip":
            let content = json["content"]?.stringValue?.unicodeScalars.first ?? " "
            return .strip(content: content, start: json["start"]?.intValue ?? 0, stop: json["stop"]?.intValue ?? 0)
        case "Metaspace":
            let replacement = json["replacement"]?.stringValue?.unicodeScalars.first ?? "▁"
            return .metaspace(replacement: replacement, prependScheme: try PrependScheme(metaspace: json))
        default:
            throw TokenizerError.unsupported(component: "decoder", type: type)
        }
    }

    func decodeChain(_ tokens: [String]) -> [String] {
        switch self {
        case let .sequence(items):
            return items.reduce(tokens) { $1.decodeChain($0) }
        case .byteLevel:
            var bytes: [UInt8] = []
            for t in tokens { bytes.append(contentsOf: ByteLevel.bytes(of: t) ?? Array(t.utf8)) }
            return [String(decoding: bytes, as: UTF8.self)]
        case let .replace(pattern, content):
            return tokens.map { TextReplace.replacingAll(in: $0, of: pattern, with: content) }
        case .byteFallback:
            var out: [String] = []
            var pending: [UInt8] = []
            func flush() {
                guard !pending.isEmpty else { return }
                if let s = String(validatingUTF8Bytes: pending) {
                    out.append(s)
                } else {
                    out.append(contentsOf: Array(repeating: "\u{FFFD}", count: pending.count))
                }
                pending.removeAll()
            }
            for t in tokens {
                if let b = Self.byteToken(t) {
                    pending.append(b)
                } else {
                    flush()
                    out.append(t)
                }
            }
            flush()
            return out
        case .fuse:
            return [tokens.joined()]
        case let .strip(content, start, stop):
            return tokens.map { token in
                let scalars = Array(token.unicodeScalars)
                var lo = 0
                while lo < min(start, scalars.count), scalars[lo] == content { lo += 1 }
                var hi = scalars.count
                var removed = 0
                while removed < stop, hi > lo, scalars[hi - 1] == content { hi -= 1; removed += 1 }
                var view = String.UnicodeScalarView()
                view.append(contentsOf: scalars[lo..<hi])
                return String(view)
            }
        case let .metaspace(replacement, scheme):
            return tokens.enumerated().map { i, token in
                var view = String.UnicodeScalarView()
                for s in token.unicodeScalars {
                    if s == replacement {
                        if i == 0, scheme != .never { continue }
                        view.append(" ")
                    } else {
                        view.append(s)
                    }
                }
                return String(view)
            }
        }
    }

    /// The byte a `<0xNN>` token stands for.
    static func byteToken(_ token: String) -> UInt8? {
        let u = Array(token.utf8)
        guard u.count == 6, u[0] == UInt8(ascii: "<"), u[1] == UInt8(ascii: "0"), u[2] == UInt8(ascii: "x"),
              u[5] == UInt8(ascii: ">") else { return nil }
        return UInt8(String(decoding: u[3..<5], as: UTF8.self), radix: 16)
    }
}

extension String {
    /// The string these bytes spell, or nil when they are not valid UTF-8.
    init?(validatingUTF8Bytes bytes: [UInt8]) {
        var iterator = bytes.makeIterator()
        var decoder = UTF8()
        var view = String.UnicodeScalarView()
        loop: while true {
            switch decoder.decode(&iterator) {
            case let .scalarValue(s): view.append(s)
            case .emptyInput: break loop
            case .error: return nil
            }
        }
        self = String(view)
    }
}
