/// One function a runtime holds loaded: its model and function in the manifest, the package file
/// that holds it and its name there, and that package's weight bytes (`Manifest.Weights.residentBytes`:
/// 0 where the manifest records none, as for the cache updates' package). Python's `Loaded`
/// (`contract/resident.py`).
public struct PlannedFunction: Hashable, Sendable, CustomStringConvertible {
    /// The model's name in the manifest ("embeddings", "chunk_0", "lm_head", "cache_update").
    public let model: String
    /// The function's name in the manifest ("prefill", "decode_512", "decode_l3").
    public let function: String
    /// The package file that holds it.
    public let file: String
    /// Its name inside that package (the function a multifunction package is loaded with).
    public let functionName: String
    /// The weight bytes of its package.
    public let weightBytes: Int

    public init(model: String, function: String, file: String, functionName: String, weightBytes: Int) {
        self.model = model
        self.function = function
        self.file = file
        self.functionName = functionName
        self.weightBytes = weightBytes
    }

    /// Function `function` of model `model` as the manifest names it.
    init(_ manifest: Manifest, model: String, function: String) throws {
        let f = try manifest.function(model, function)
        self.init(model: model, function: function, file: f.file, functionName: f.functionName,
                  weightBytes: manifest.weightBytes(of: model))
    }

    public var description: String { "\(model).\(function)" }
}

/// The functions of one stage of the pipeline: a phase at one context bucket, as `CoreMLBackend`
/// runs it. The first embeddings part, the chunks and their cache updates run the stage's own
/// function (the phase's, or its bucket's copy: "decode_512", and "decode_512_l3" for an update);
/// the later embeddings parts and the LM head run the phase's in every bucket (they have no
/// bucketed functions).
public struct StagePlan: Equatable, Sendable {
    public let phase: Phase
    /// The cache length its functions read: a context bucket, or the whole context.
    public let bucket: Int
    /// The stage's function name: the phase's ("decode") or its bucket's ("decode_512").
    public let function: String
    /// The embeddings parts in manifest order (`embeddings.models`).
    public let embeddings: [PlannedFunction]
    /// The block chunks in execution order.
    public let chunks: [PlannedFunction]
    /// Per chunk, its cache update; nil where it has none (a state export's prefill and decode, a
    /// chunk of conv or KV-shared layers only).
    public let updates: [PlannedFunction?]
    /// The LM head models in manifest order; none where the head is folded into the last chunk.
    public let lmHeads: [PlannedFunction]

    /// Every function the stage holds, each once (chunks of as many layers share one cache update
    /// function), in the order above.
    public var functions: [PlannedFunction] {
        Self.unique(embeddings + chunks + updates.compactMap { $0 } + lmHeads)
    }

    /// `functions` without repeats, first occurrences in order.
    static func unique(_ functions: [PlannedFunction]) -> [PlannedFunction] {
        var seen = Set<PlannedFunction>()
        return functions.filter { seen.insert($0).inserted }
    }
}

/// The functions a runtime loads to run an export, by stage: each phase the export has
/// (`PipelineWiring.phases`) at the whole context, then each smaller context bucket's prefill and
/// decode (prefill alone where the prefill window decodes: one function per model and bucket, which
/// a decoded token and, with `cascade` "window", a cascade step run too). A host loads a stage's functions on the first use of that phase and bucket and keeps
/// them (`PlannedStages`); a session that runs every stage ends holding `functions`: every function
/// of the manifest's models, the set Python's `load_plan` (`contract/resident.py`) names.
///
/// What holding them costs is `ResidentModel`'s to say: on the Neural Engine each loaded function
/// is modelled as its own copy of its package's weights.
public struct LoadPlan: Equatable, Sendable {
    /// The stages: every phase at the whole context, then the smaller buckets' prefill and decode.
    public let stages: [StagePlan]
    /// The runtime the export's packages load in (Core AI for a `--target coreai` export, else Core ML).
    public let runtime: ResidentModel.Runtime
    /// The export's context buckets.
    public let buckets: ContextBuckets
    /// The phase a decoded token runs (`Manifest.decodePhase`): `.prefill` where the prefill window
    /// decodes, which has no decode stages.
    public let decodePhase: Phase

    /// The plan of `manifest`; throws where a chunk that keeps K/V names no cache update for a
    /// stage, or a named function is missing (`Manifest.decode` has checked both).
    public init(manifest: Manifest) throws {
        let buckets = manifest.buckets
        var stages: [StagePlan] = []
        for phase in PipelineWiring.phases(of: manifest) {
            stages.append(try Self.stage(phase, bucket: buckets.contextLength, manifest: manifest))
        }
        for bucket in buckets.sizes.dropLast() {
            for phase in manifest.windowPhases {
                stages.append(try Self.stage(phase, bucket: bucket, manifest: manifest))
            }
        }
        self.stages = stages
        self.buckets = buckets
        decodePhase = manifest.decodePhase
        runtime = ResidentModel.runtime(of: manifest)
    }

    /// The stage of `phase` at context bucket `bucket` (`contextLength` for the whole context),
    /// nil where the export has none. Where the prefill window decodes, decode is the prefill stage.
    public func stage(_ phase: Phase, bucket: Int) -> StagePlan? {
        let phase = phase == .decode ? decodePhase : phase
        return stages.first { $0.phase == phase && $0.bucket == bucket }
    }

    /// Every function of every stage, each once, in stage order.
    public var functions: [PlannedFunction] { StagePlan.unique(stages.flatMap(\.functions)) }

    /// Why there is no stage of `phase` at `bucket`: the export has no such phase, or no such bucket.
    func missingStage(_ phase: Phase, bucket: Int) -> Error {
        switch phase {
        case .verify where !stages.contains { $0.phase == .verify }: return GenerationError.noVerifyWindow
        case .decodeBranches where !stages.contains { $0.phase == .decodeBranches }: return GenerationError.noBranchWidth
        default:
            return ManifestError.inconsistent("the export has no \(phase.rawValue) function at context bucket \(bucket) "
                + "(context buckets \(buckets.sizes); \(Phase.decodeBranches.rawValue) and \(Phase.verify.rawValue) "
                + "run at the whole context)")
        }
    }

    /// The functions of `phase` at `bucket`, as `CoreMLBackend` loads them.
    private static func stage(_ phase: Phase, bucket: Int, manifest: Manifest) throws -> StagePlan {
        let p = phase.rawValue
        let fn = manifest.buckets.functionName(phase, bucket: bucket)
        guard let firstPart = manifest.embeddings.models.first else {
            throw ManifestError.inconsistent("embeddings models is empty")
        }
        let embeddings = try [PlannedFunction(manifest, model: firstPart, function: fn)]
            + manifest.embeddings.models.dropFirst().map { try PlannedFunction(manifest, model: $0, function: p) }
        let chunks = try manifest.chunks.map { try PlannedFunction(manifest, model: $0.model, function: fn) }
        // A state export's prefill and decode write their caches in the chunk: no cache update;
        // nor has a chunk of conv layers only, which keeps no K/V.
        let writesInChunk = manifest.cache.inStates && (phase == .prefill || phase == .decode)
        let updates = try manifest.chunks.map { chunk -> PlannedFunction? in
            if writesInChunk { return nil }
            guard let name = chunk.cacheUpdate[fn] else {
                guard manifest.keepsKV(chunk) else { return nil }
                throw ManifestError.inconsistent("chunk \(chunk.model) names no \(fn) cache update")
            }
            return try PlannedFunction(manifest, model: "cache_update", function: name)
        }
        let heads = try manifest.lmHead.models.map { try PlannedFunction(manifest, model: $0, function: p) }
        return StagePlan(phase: phase, bucket: bucket, function: fn, embeddings: embeddings, chunks: chunks,
                         updates: updates, lmHeads: heads)
    }
}

extension Manifest {
    /// The weight bytes of `model`'s package as the Neural Engine holds them (`Weights.residentBytes`),
    /// 0 where `weights` records none.
    public func weightBytes(of model: String) -> Int { weights?[model]?.residentBytes ?? 0 }
}
