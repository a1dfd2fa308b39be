/// Why an export folder was refused. Each message names the problem and what to do about it.
public enum ManifestError: Error, CustomStringConvertible, Equatable {
    case missingManifest(folder: String)
    case invalidJSON(path: String, reason: String)
    case unsupportedFormatVersion(found: Int?, supported: [Int])
    /// A format version this package no longer reads (`Manifest.retiredFormatVersions`): what it was,
    /// and the version a new export of the same kind has.
    case retiredFormatVersion(found: Int, was: String, current: Int)
    case notAnObject(kind: String)
    case unsafePath(String)
    case linkOutside(name: String, link: String, target: String)
    case missingHash(name: String, field: String)
    case invalidHash(String)
    case noHashes
    case missingFile(String)
    case hashMismatch(String)
    case inconsistent(String)
    case unknownConfigField(String)
    /// A config field of an export this host does not run (`ModelConfig.refusedFields`), with what it lacks.
    case unsupportedConfigField(String, lacks: String)

    public var description: String {
        switch self {
        case let .missingManifest(folder):
            return "\(folder) is not a llama-ane export: manifest.json is missing. "
                + "Pass the folder written by `llama-ane export` (an export that did not finish leaves no manifest)."
        case let .invalidJSON(path, reason):
            return "\(path) is not a valid manifest: \(reason). Re-export the model with `llama-ane export`."
        case let .unsupportedFormatVersion(found, supported):
            let listed = supported.map(String.init)
            let reads = listed.count > 1 ? listed.dropLast().joined(separator: ", ") + " and " + (listed.last ?? "")
                : listed.joined()
            guard let found else {
                return "manifest.json has no format_version, but this LlamaANE reads \(reads). "
                    + "Re-export the model with `llama-ane export`."
            }
            if let newest = supported.max(), found > newest {
                return "manifest.json has format_version \(found), from a newer llama-ane, but this LlamaANE reads \(reads). "
                    + "Update the Swift package, or re-export with a llama-ane that writes a supported version."
            }
            return "manifest.json has format_version \(found), from an older llama-ane, but this LlamaANE reads \(reads). "
                + "Re-export the model with `llama-ane export`."
        case let .retiredFormatVersion(found, was, current):
            return "manifest.json has format_version \(found) (\(was)), which is no longer read. "
                + "Re-export the model with `llama-ane export` (format_version \(current))."
        case let .notAnObject(kind):
            return "manifest.json holds \(kind), not an object. The manifest was edited or damaged: re-export the model."
        case let .unsafePath(name):
            return "manifest.json names the file \"\(name)\", which is not a plain relative name inside the export folder "
                + "(absolute paths, \"..\" and backslashes are refused). The manifest was edited or damaged: re-export the model."
        case let .linkOutside(name, link, target):
            return "manifest.json names \"\(name)\", but \(link) is a link to \(target), outside the export folder. "
                + "Copy the real files into the export, or re-export the model."
        case let .missingHash(name, field):
            return "manifest.json: files has no sha256 of \"\(name)\", which \(field) names: without it the file could be "
                + "changed unnoticed. The manifest was edited or damaged: re-export the model."
        case let .invalidHash(name):
            return "manifest.json: files.\(name) is not a sha256 hex digest (64 lowercase hex digits). "
                + "The manifest was edited or damaged: re-export the model."
        case .noHashes:
            return "manifest.json: files is empty, so nothing in the export could be checked. "
                + "The manifest was edited or damaged: re-export the model."
        case let .missingFile(name):
            return "\(name) is named in manifest.json but missing from the export folder. Copy the whole folder, or re-export."
        case let .hashMismatch(name):
            return "\(name) does not match its sha256 in manifest.json: it was modified or corrupted. Re-export or copy it again."
        case let .unknownConfigField(name):
            return "manifest.json: config.\(name) is a model setting this LlamaANE does not know, so it cannot tell "
                + "whether it would run the export right. Update the Swift package, or re-export with the llama-ane "
                + "release that matches it."
        case let .unsupportedConfigField(name, lacks):
            return "manifest.json: config.\(name) belongs to an export this LlamaANE does not run: it has no \(lacks). "
                + "Run the export from Python (llama_ane.load), or export a model this host runs."
        case let .inconsistent(reason):
            return "manifest.json is inconsistent: \(reason). Re-export the model with `llama-ane export`."
        }
    }
}
