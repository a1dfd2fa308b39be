/// Why the model pipeline could not be built or run.
public enum PipelineError: Error, CustomStringConvertible, Equatable {
    /// Core ML is not available on this platform (Linux, Windows).
    case unavailable
    /// A multifunction export needs iOS 18 / macOS 15.
    case multifunctionNeedsNewerOS
    /// The manifest names a tensor the pipeline does not know how to feed.
    case unwiredInput(model: String, input: String)
    /// A buffer could not be allocated.
    case allocationFailed(String)

    public var description: String {
        switch self {
        case .unavailable:
            return "Core ML is not available on this platform; run on macOS 13+ or iOS 16+ (the manifest and tokenizer still load here)."
        case .multifunctionNeedsNewerOS:
            return "this export keeps several functions in one package (multifunction), which needs macOS 15 / iOS 18. "
                + "Run on a newer OS, or export with an older --target to get one package per function."
        case let .unwiredInput(model, input):
            return "\(model) expects an input \"\(input)\" that no earlier stage produces; the export and this LlamaANE disagree: "
                + "update the Swift package or re-export."
        case let .allocationFailed(what):
            return "could not allocate \(what); free memory or use a smaller context length."
        }
    }
}
