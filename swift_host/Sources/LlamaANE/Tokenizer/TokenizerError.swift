/// Why a `tokenizer.json` (or a chat template) could not be used.
public enum TokenizerError: Error, CustomStringConvertible, Equatable {
    /// The file is missing or is not valid JSON.
    case unreadable(path: String, reason: String)
    /// A component type this package does not implement (e.g. a WordPiece model).
    case unsupported(component: String, type: String)
    /// The file is JSON but a required field is missing or malformed.
    case malformed(String)
    /// A chat template could not be parsed or rendered.
    case chatTemplate(String)

    public var description: String {
        switch self {
        case let .unreadable(path, reason):
            return "cannot read tokenizer file \(path): \(reason). Re-export the model or copy tokenizer.json next to manifest.json."
        case let .unsupported(component, type):
            return "tokenizer.json uses a \(component) of type \"\(type)\", which LlamaANE does not implement. "
                + "Supported: BPE models (byte-level or with byte fallback) as used by Llama 2, Llama 3 and SmolLM2."
        case let .malformed(reason):
            return "malformed tokenizer.json: \(reason)"
        case let .chatTemplate(reason):
            return "chat template error: \(reason)"
        }
    }
}
