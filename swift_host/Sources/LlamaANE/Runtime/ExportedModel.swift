import Foundation

/// An export folder opened for generation: its checked manifest, its tokenizer (with the special
/// tokens and chat template the exporter recorded), and the prompt and generator built from them.
/// The model itself is any `TokenPredictor`: `makeCoreMLPredictor()` on Apple platforms.
public struct ExportedModel {
    public let folder: URL
    public let manifest: Manifest
    public let tokenizer: Tokenizer

    /// Opens `folder`: loads and checks manifest.json, then reads the tokenizer files it names.
    public init(folder: URL, verifyHashes: Bool = false) throws {
        self.folder = folder
        manifest = try Manifest.load(from: folder, verifyHashes: verifyHashes)
        guard manifest.tokenizer.files.contains("tokenizer.json") else {
            throw ManifestError.inconsistent("the tokenizer files \(manifest.tokenizer.files) do not include tokenizer.json")
        }
        tokenizer = try Tokenizer(directory: folder)
        if let template = manifest.tokenizer.chatTemplate { tokenizer.chatTemplate = template }
        if let bos = manifest.tokenizer.bosTokenId, let token = tokenizer.token(forId: bos) { tokenizer.bosToken = token }
        if let eos = eosTokenIds.sorted().first, let token = tokenizer.token(forId: eos) { tokenizer.eosToken = token }
    }

    /// The ids that end generation (the exporter's list, plus the config's).
    public var eosTokenIds: Set<Int> { Set(manifest.tokenizer.eosTokenIds + manifest.config.eosTokenId) }

    /// The ids of a plain prompt, with BOS where the tokenizer or the exporter asks for it.
    public func promptTokens(_ text: String) -> [Int] {
        var ids = tokenizer.encode(text, addSpecialTokens: true)
        if manifest.tokenizer.addBosToken, let bos = manifest.tokenizer.bosTokenId, ids.first != bos { ids.insert(bos, at: 0) }
        return ids
    }

    /// A generator over `predictor` that stops at this model's end-of-sequence ids and streams text.
    public func generator(predictor: TokenPredictor) -> Generator {
        let tokenizer = self.tokenizer
        return Generator(predictor: predictor, eosTokenIds: eosTokenIds) { tokenizer.decode($0, skipSpecialTokens: true) }
    }

    /// A conversation on `generator`'s cache, rendered with the exporter's chat template; each turn
    /// prefills only its new tokens. Throws when the export has no chat template.
    public func conversation(generator: Generator, system: String? = nil) throws -> Conversation {
        try Conversation(generator: generator, tokenizer: tokenizer, system: system)
    }

    /// The ids of a conversation rendered with the exporter's chat template, ready for generation.
    public func chatPromptTokens(_ messages: [ChatMessage], addGenerationPrompt: Bool = true) throws -> [Int] {
        try tokenizer.applyChatTemplate(messages, addGenerationPrompt: addGenerationPrompt)
    }
}
