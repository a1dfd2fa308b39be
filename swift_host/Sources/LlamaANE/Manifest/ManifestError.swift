/// Why an export folder was refused. Each message names the problem and what to do about it.
public enum ManifestError: Error, CustomStringConvertible, Equatable {
    case missingManifest(folder: String)
    case invalidJSON(path: String, reason: String)
    case unsupportedFormatVersion(found: Int?, supported: [Int])
    case unsafePath(String)
    case missingFile(String)
    case hashMismatch(String)
    case inconsistent(String)

    public var description: String {
        switch self {
        case let .missingManifest(folder):
            return "\(folder) is not a llama-ane export: manifest.json is missing. "
                + "Pass the folder written by `llama-ane export` (an export that did not finish leaves no manifest)."
        case let .invalidJSON(path, reason):
            return "\(path) is not a valid manifest: \(reason). Re-export the model with `llama-ane export`."
        case let .unsupportedFormatVersion(found, supported):
            let f = found.map(String.init) ?? "none"
            return "manifest.json has format_version \(f), but this LlamaANE reads \(supported.map(String.init).joined(separator: ", ")). "
                + "Re-export with a llama-ane that writes a supported version, or update the Swift package."
        case let .unsafePath(name):
            return "manifest.json names the file \"\(name)\", which is not a plain relative name inside the export folder "
                + "(absolute paths, \"..\" and backslashes are refused). The manifest was edited or damaged: re-export the model."
        case let .missingFile(name):
            return "\(name) is named in manifest.json but missing from the export folder. Copy the whole folder, or re-export."
        case let .hashMismatch(name):
            return "\(name) does not match its sha256 in manifest.json: it was modified or corrupted. Re-export or copy it again."
        case let .inconsistent(reason):
            return "manifest.json is inconsistent: \(reason). Re-export the model with `llama-ane export`."
        }
    }
}
