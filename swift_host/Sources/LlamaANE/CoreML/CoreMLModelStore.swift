#if canImport(CoreML)
import CoreML
import Foundation

/// Loads the functions an export's manifest names. Each `.mlpackage` is compiled on first use and
/// the `.mlmodelc` is kept in a cache folder keyed by the package's sha256, so later launches load
/// directly; a `.mlmodelc` shipped next to the package (compiled by Xcode) is used as is.
///
/// `CoreMLBackend` asks for each function through its load plan (`FunctionStore`, `PlannedStages`):
/// on the first use of a stage that holds it, not before.
public actor CoreMLModelStore: FunctionStore {
    public let folder: URL
    public let manifest: Manifest
    public let computeUnits: MLComputeUnits
    public let cacheDirectory: URL
    private var compiling: [String: Task<URL, Error>] = [:]
    private var loaded: [String: MLModel] = [:]

    public init(folder: URL, manifest: Manifest, computeUnits: MLComputeUnits = .cpuAndNeuralEngine,
                cacheDirectory: URL? = nil) {
        self.folder = folder
        self.manifest = manifest
        self.computeUnits = computeUnits
        self.cacheDirectory = cacheDirectory
            ?? FileManager.default.urls(for: .cachesDirectory, in: .userDomainMask)[0].appendingPathComponent("LlamaANE")
    }

    /// The loaded model for one manifest function (loaded once, then shared).
    public func model(for function: Manifest.Function) async throws -> MLModel {
        try await model(file: function.file, functionName: function.functionName)
    }

    /// The loaded model for function `functionName` of package `file` (loaded once, then shared).
    private func model(file: String, functionName: String) async throws -> MLModel {
        let key = file + "#" + functionName
        if let model = loaded[key] { return model }
        let url = try await compiledURL(for: file)
        let configuration = MLModelConfiguration()
        configuration.computeUnits = computeUnits
        if manifest.multifunction {
            guard #available(macOS 15.0, iOS 18.0, *) else { throw PipelineError.multifunctionNeedsNewerOS }
            configuration.functionName = functionName
        }
        let model = try await MLModel.load(contentsOf: url, configuration: configuration)
        loaded[key] = model
        return model
    }

    /// The loaded model of one function of the load plan (`model(for:)`'s: loaded once, then shared).
    public func load(_ function: PlannedFunction) async throws -> MLModel {
        try await model(file: function.file, functionName: function.functionName)
    }

    /// The compiled model for a manifest file name; concurrent callers share one compilation.
    private func compiledURL(for file: String) async throws -> URL {
        if let task = compiling[file] { return try await task.value }
        let source = try Manifest.resolve(file, in: folder)
        let digest = String((manifest.files[file] ?? "unhashed").prefix(16))
        let target = cacheDirectory.appendingPathComponent("\(manifest.name)-\(digest)", isDirectory: true)
            .appendingPathComponent(source.deletingPathExtension().lastPathComponent + ".mlmodelc", isDirectory: true)
        let task = Task<URL, Error> {
            let fm = FileManager.default
            if source.pathExtension == "mlmodelc" { return source }
            let sibling = source.deletingPathExtension().appendingPathExtension("mlmodelc")
            if fm.fileExists(atPath: sibling.path) { return sibling }
            if fm.fileExists(atPath: target.path) { return target }
            let temporary = try await MLModel.compileModel(at: source)
            try fm.createDirectory(at: target.deletingLastPathComponent(), withIntermediateDirectories: true)
            try? fm.removeItem(at: target)
            try fm.moveItem(at: temporary, to: target)
            return target
        }
        compiling[file] = task
        do {
            return try await task.value
        } catch {
            compiling[file] = nil  // let a later call try again
            throw error
        }
    }
}
#endif
