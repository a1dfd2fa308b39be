/// Where the functions of a load plan are loaded from: `CoreMLModelStore` (an `MLModel` per
/// function) on Apple platforms, a stand-in that counts its loads in tests.
public protocol FunctionStore: Sendable {
    /// A loaded function (`MLModel` for Core ML).
    associatedtype Loaded
    /// Loads `function`. `PlannedStages` asks for each function of its plan once, on the first use of
    /// a stage that holds it, and keeps what it gets.
    func load(_ function: PlannedFunction) async throws -> Loaded
}

/// The loaded functions of one stage, in the order of its `StagePlan`.
public struct LoadedStage<Loaded> {
    public let plan: StagePlan
    /// The embeddings parts in manifest order: the first part's function, then the later parts'.
    public let embeddings: [Loaded]
    public let chunks: [Loaded]
    /// Per chunk, its cache update (nil where it has none).
    public let updates: [Loaded?]
    public let lmHeads: [Loaded]
}

/// The stages of an export's pipeline, each made on the first use of its phase and context bucket,
/// once, and kept: its functions are loaded through `store` (in `StagePlan` order), then `make`
/// turns them into the stage (`CoreMLBackend`: the models with their preallocated buffers).
///
/// Nothing outside the plan is loaded, nothing before it is used, and nothing twice: a function
/// that several stages hold (the LM head's, which every context bucket runs) is loaded for the
/// first of them and shared. On the Neural Engine each loaded function is modelled as its own copy
/// of its package's weights (`ResidentModel`), so a session holds the copies of the stages it ran,
/// not of every stage the export has. Concurrent first uses of a stage or a function share one
/// load; a load that fails is not kept, so a later use tries again.
public actor PlannedStages<Store: FunctionStore, Stage> {
    public nonisolated let plan: LoadPlan
    public nonisolated let store: Store
    private let make: @Sendable (LoadedStage<Store.Loaded>) throws -> Stage
    /// By stage function name ("decode", "decode_512"): the stage, made or being made.
    private var stages: [String: Task<Unchecked<Stage>, Error>] = [:]
    /// Each function of the plan loaded or being loaded.
    private var functions: [PlannedFunction: Task<Unchecked<Store.Loaded>, Error>] = [:]
    /// The functions loaded so far, in the order they were loaded.
    public private(set) var loaded: [PlannedFunction] = []

    public init(plan: LoadPlan, store: Store, make: @escaping @Sendable (LoadedStage<Store.Loaded>) throws -> Stage) {
        self.plan = plan
        self.store = store
        self.make = make
    }

    /// The stage of `phase` at context bucket `bucket` (the whole context's length for the whole
    /// context), made with its functions on first use. Throws `GenerationError.noBranchWidth` or
    /// `.noVerifyWindow` for a phase the export does not have.
    public func stage(_ phase: Phase, bucket: Int) async throws -> Stage {
        guard let planned = plan.stage(phase, bucket: bucket) else { throw plan.missingStage(phase, bucket: bucket) }
        if let task = stages[planned.function] { return try await task.value.value }
        let make = self.make
        let task = Task<Unchecked<Stage>, Error> {
            let loaded = try await self.load(planned)
            return Unchecked(try make(loaded))
        }
        stages[planned.function] = task
        do {
            return try await task.value.value
        } catch {
            stages[planned.function] = nil  // let a later use try again
            throw error
        }
    }

    /// What the functions loaded so far keep wired, modelled (`ResidentModel`).
    public var resident: ResidentModel { ResidentModel(runtime: plan.runtime, holding: loaded) }

    /// The functions of `stage`, each loaded once.
    private func load(_ stage: StagePlan) async throws -> LoadedStage<Store.Loaded> {
        var embeddings: [Store.Loaded] = [], chunks: [Store.Loaded] = [], heads: [Store.Loaded] = []
        var updates: [Store.Loaded?] = []
        for f in stage.embeddings { embeddings.append(try await load(f)) }
        for f in stage.chunks { chunks.append(try await load(f)) }
        for f in stage.updates {
            if let f { updates.append(try await load(f)) } else { updates.append(nil) }
        }
        for f in stage.lmHeads { heads.append(try await load(f)) }
        return LoadedStage(plan: stage, embeddings: embeddings, chunks: chunks, updates: updates, lmHeads: heads)
    }

    /// `function` from the store, on first use; concurrent callers share one load.
    private func load(_ function: PlannedFunction) async throws -> Store.Loaded {
        if let task = functions[function] { return try await task.value.value }
        let store = self.store
        let task = Task<Unchecked<Store.Loaded>, Error> { Unchecked(try await store.load(function)) }
        functions[function] = task
        do {
            let value = try await task.value.value
            loaded.append(function)
            return value
        } catch {
            functions[function] = nil  // let a later use try again
            throw error
        }
    }
}

/// A value handed between tasks of `PlannedStages`' actor: a loaded model and the stage made from
/// it are used by one pipeline, which orders its calls itself.
private struct Unchecked<Value>: @unchecked Sendable {
    let value: Value
    init(_ value: Value) { self.value = value }
}
