import Foundation

/// A Hugging Face `tokenizer.json` BPE tokenizer: byte-level BPE (Llama 3, SmolLM2, GPT-2) and
/// SentencePiece-style BPE with `<0xNN>` byte fallback (Llama 2), with added/special tokens.
///
/// `encode` and `decode` give the same ids and text as Hugging Face `tokenizers` for the
/// components LlamaANE implements; any other component is refused when the file is read.
public final class Tokenizer: @unchecked Sendable {
    private let normalizer: Normalizer?
    private let preTokenizer: PreTokenizer?
    private let model: BPEModel
    private let decoder: TokenDecoder?
    private let postProcessor: PostProcessor?
    private let rawMatcher: AddedTokenMatcher
    private let normalizedMatcher: AddedTokenMatcher
    private let addedById: [Int: AddedToken]

    /// The added tokens (special or not), in file order.
    public let addedTokens: [AddedToken]
    /// Settings from tokenizer_config.json, which the manifest may override.
    public var bosToken: String?
    public var eosToken: String?
    public var chatTemplate: String?

    /// Reads `tokenizer.json` (and the optional `tokenizer_config.json`) from their bytes.
    public init(tokenizerJSON: Data, tokenizerConfigJSON: Data? = nil) throws {
        let root: JSONValue
        do { root = try JSONValue.parse(tokenizerJSON) } catch {
            throw TokenizerError.unreadable(path: "tokenizer.json", reason: "\(error)")
        }
        guard let modelJSON = root["model"] else { throw TokenizerError.malformed("no \"model\" section") }
        model = try BPEModel(json: modelJSON)
        normalizer = try Normalizer.from(json: root["normalizer"])
        preTokenizer = try PreTokenizer.from(json: root["pre_tokenizer"])
        decoder = try TokenDecoder.from(json: root["decoder"])
        postProcessor = try PostProcessor.from(json: root["post_processor"])
        addedTokens = try (root["added_tokens"]?.arrayValue ?? []).map { try AddedToken(json: $0) }
        rawMatcher = AddedTokenMatcher(addedTokens.filter { !$0.normalized })
        normalizedMatcher = AddedTokenMatcher(addedTokens.filter { $0.normalized })
        addedById = Dictionary(addedTokens.map { ($0.id, $0) }, uniquingKeysWith: { a, _ in a })

        if let configData = tokenizerConfigJSON {
            let config: JSONValue
            do { config = try JSONValue.parse(configData) } catch {
                throw TokenizerError.unreadable(path: "tokenizer_config.json", reason: "\(error)")
            }
            bosToken = Self.tokenString(config["bos_token"])
            eosToken = Self.tokenString(config["eos_token"])
            if let template = config["chat_template"]?.stringValue {
                chatTemplate = template
            } else if let list = config["chat_template"]?.arrayValue {
                // A list of named templates: use "default".
                chatTemplate = list.first { $0["name"]?.stringValue == "default" }?["template"]?.stringValue
            }
        }
    }

    /// Reads `tokenizer.json` and, when present, `tokenizer_config.json` in `directory`.
    public convenience init(directory: URL) throws {
        let jsonURL = directory.appendingPathComponent("tokenizer.json")
        let data: Data
        do { data = try Data(contentsOf: jsonURL) } catch {
            throw TokenizerError.unreadable(path: jsonURL.path, reason: "the file is missing or unreadable")
        }
        let configURL = directory.appendingPathComponent("tokenizer_config.json")
        try self.init(tokenizerJSON: data, tokenizerConfigJSON: try? Data(contentsOf: configURL))
    }

    private static func tokenString(_ value: JSONValue?) -> String? {
        value?.stringValue ?? value?["content"]?.stringValue
    }

    /// The ids of `text`. With `addSpecialTokens` the post-processor's tokens (e.g. Llama's BOS) are added.
    public func encode(_ text: String, addSpecialTokens: Bool = true) -> [Int] {
        var ids: [Int] = []
        for segment in rawMatcher.split(text, atStart: true) {
            switch segment {
            case let .token(id):
                ids.append(id)
            case let .text(raw, atStart):
                let normalized = normalizer?.apply(raw) ?? raw
                for inner in normalizedMatcher.split(normalized, atStart: atStart) {
                    switch inner {
                    case let .token(id):
                        ids.append(id)
                    case let .text(piece, pieceAtStart):
                        let start = TextPiece(text: piece, atStart: pieceAtStart)
                        for word in preTokenizer?.apply([start]) ?? [start] {
                            ids.append(contentsOf: model.tokenize(word.text))
                        }
                    }
                }
            }
        }
        if addSpecialTokens, let postProcessor { ids = postProcessor.apply(ids) }
        return ids
    }

    /// The text of `ids`; unknown ids are skipped.
    public func decode(_ ids: [Int], skipSpecialTokens: Bool = false) -> String {
        let tokens: [String] = ids.compactMap { id in
            if let added = addedById[id] { return skipSpecialTokens && added.special ? nil : added.content }
            return model.idToToken[id]
        }
        guard let decoder else { return tokens.joined(separator: " ") }
        return decoder.decodeChain(tokens).joined()
    }

    /// The id of a token string (added tokens first, then the vocabulary).
    public func tokenId(_ token: String) -> Int? {
        if let added = addedTokens.first(where: { $0.content.utf8.elementsEqual(token.utf8) }) { return added.id }
        return model.tokenId(token)
    }

    /// The string of a token id.
    public func token(forId id: Int) -> String? {
        addedById[id]?.content ?? model.idToToken[id]
    }

    /// Whether `id` is a special added token.
    public func isSpecial(_ id: Int) -> Bool { addedById[id]?.special ?? false }
}
