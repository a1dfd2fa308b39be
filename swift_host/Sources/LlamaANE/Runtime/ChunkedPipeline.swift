/// The exported models seen as steps, so that the order of calls lives in one place and can be
/// tested without Core ML. `Activations` is whatever flows between the steps (hidden states, RoPE
/// tables and mask); the backend keeps the caches and each chunk's new K/V itself.
public protocol PipelineBackend: AnyObject, Sendable {
    associatedtype Activations
    /// Block chunks in execution order.
    var chunkCount: Int { get }
    /// embeddings(the window's phase at context bucket `bucket`): token ids and position -> hidden
    /// states, cos, sin, mask (whose cache columns are the bucket's `bucket` positions).
    func embed(_ window: TokenWindow, bucket: Int) async throws -> Activations
    /// embeddings(prefill at context bucket `bucket`) of an export whose prefill window decodes
    /// (`Manifest.prefillDecodes`): the window's ids and each row's position -> hidden states, cos,
    /// sin; the backend keeps the window's masks (over the bucket's positions) and, with state
    /// caches, its write position for the chunks, which read them. The default refuses: a backend
    /// that does not implement it cannot run such an export.
    func embed(_ window: HostWindow, bucket: Int) async throws -> Activations
    /// chunk_i(phase at `bucket`, see `ContextBuckets.functionName`): reads the first `bucket`
    /// positions of chunk i's cache, returns the next activations and keeps k_new, v_new.
    func runChunk(_ index: Int, _ input: Activations, phase: Phase, bucket: Int) async throws -> Activations
    /// cache_update(chunk i's function for phase at `bucket`): writes the kept k_new, v_new at
    /// `position` into the first `bucket` positions of the cache (the rest stay as they are).
    func updateCache(_ index: Int, phase: Phase, bucket: Int, position: Int) async throws
    /// lm_head(phase): the logits (all vocabulary splits, concatenated) of window column `column`.
    /// With the head folded into the last chunk (`PipelineWiring.headFolded`) no head model runs:
    /// the logits are the ones the last `runChunk` of this step output.
    func logits(_ input: Activations, phase: Phase, column: Int) async throws -> [Float]
    /// The logits of several window columns (a cascade step's branch rows through the prefill window),
    /// in that order; the default asks `logits(_:phase:column:)` for each.
    func logits(_ input: Activations, phase: Phase, columns: [Int]) async throws -> [[Float]]
    /// Empties every cache.
    func resetCaches() async throws
}

extension PipelineBackend {
    public func embed(_ window: HostWindow, bucket: Int) async throws -> Activations {
        throw PipelineError.unwiredInput(model: "embeddings (prefill)", input: TensorNames.positions)
    }

    public func logits(_ input: Activations, phase: Phase, columns: [Int]) async throws -> [[Float]] {
        var out: [[Float]] = []
        for column in columns { out.append(try await logits(input, phase: phase, column: column)) }
        return out
    }
}

/// Runs a window through embeddings, every chunk and the LM head, the way docs/manifest.md
/// describes: each chunk's cache update starts in the background as soon as the chunk has
/// produced its new K/V, and must finish before that chunk runs again.
///
/// A window ending at position p runs in the smallest context bucket T >= p (`ContextBuckets`):
/// every function of the step reads and writes only the first T positions of each cache. The
/// positions past T hold no token of the window's history (they are at or past its position), so
/// leaving them as they are is what a whole-context run would do with them: mask them.
///
/// The pipeline keeps no position of its own: each window says where it goes. A window below
/// positions written earlier (a rewound cache, see `KVCacheState`) needs nothing special: the
/// functions mask everything from its position on, and its cache updates, queued per chunk after
/// the earlier ones, overwrite the stale K/V.
///
/// Where the prefill window decodes (`hostMasks`, format_version 4) every window runs the prefill
/// functions: a decoded token is a window of one real token padded to `prefillLength`. The
/// pipeline hands the backend each row's position, the masks the chunks read (`HostMasks`) and the
/// column the window's K/V are written at (`HostWindow`); with state caches those have room for
/// the padding of a window at the context's end (`Manifest.cacheLength`), so every window is
/// padded. Its cascade steps through the same window (`windowCascadeWidth`, see
/// `decodeBranchesInWindow`).
public final class ChunkedPipeline<Backend: PipelineBackend>: TokenPredictor, @unchecked Sendable {
    public let backend: Backend
    public let contextLength: Int
    public let prefillLength: Int
    /// The cache lengths with their own functions (the whole context alone without buckets).
    public let buckets: ContextBuckets
    /// The caches are Core ML states that the chunks' prefill and decode functions write
    /// themselves (`--kv-cache state`): no cache update runs for those phases.
    public let cacheInStates: Bool
    /// Tokens a rewind may forget where the sliding layers keep a ring buffer (see `KVCacheState`).
    public let rewindLimit: Int?
    /// Where the prefill window decodes (`Manifest.prefillDecodes`): the masks the host makes for
    /// every window; nil for an export with decode functions, whose embeddings make them.
    public let hostMasks: HostMasks?
    /// B where the cascade steps through the prefill window (`Manifest.windowCascade`), else 0.
    public let windowCascadeWidth: Int
    /// Cache updates of windows and of accepted verify trees, per chunk.
    let updates = CacheUpdateQueue()
    /// Suffix-cache updates of cascade steps (see `decodeBranches`).
    let branchUpdates = CacheUpdateQueue()

    public init(backend: Backend, contextLength: Int, prefillLength: Int, cacheInStates: Bool = false,
                buckets: ContextBuckets? = nil, rewindLimit: Int? = nil, hostMasks: HostMasks? = nil,
                windowCascadeWidth: Int = 0) {
        precondition(buckets == nil || buckets?.contextLength == contextLength, "the last context bucket must be the context length")
        precondition(windowCascadeWidth == 0 || (hostMasks != nil && windowCascadeWidth <= prefillLength),
                     "a cascade through the prefill window needs host masks and at most \(prefillLength) branches")
        self.backend = backend
        self.contextLength = contextLength
        self.buckets = buckets ?? ContextBuckets(contextLength: contextLength)
        self.prefillLength = prefillLength
        self.cacheInStates = cacheInStates
        self.rewindLimit = rewindLimit
        self.hostMasks = hostMasks
        self.windowCascadeWidth = windowCascadeWidth
    }

    /// The pipeline of `manifest`'s export on `backend`: its context, buckets, cache kind, rewind
    /// limit, and where its prefill window decodes, the host's masks and the window cascade's width.
    public convenience init(backend: Backend, manifest: Manifest) {
        self.init(backend: backend, contextLength: manifest.contextLength, prefillLength: manifest.prefillLength,
                  cacheInStates: manifest.cache.inStates, buckets: manifest.buckets, rewindLimit: manifest.rewindLimit,
                  hostMasks: manifest.prefillDecodes ? HostMasks(manifest: manifest) : nil,
                  windowCascadeWidth: manifest.windowCascade ? manifest.branchWidth ?? 0 : 0)
    }

    /// State caches written a whole window at a time must hold its padding: tokens near the end run
    /// one at a time, but where the prefill window decodes, whose states have room for it.
    public var paddedWindowsMustFit: Bool { cacheInStates && hostMasks == nil }

    public var decodesInPrefillWindow: Bool { hostMasks != nil }

    public func predict(_ window: TokenWindow) async throws -> [Float] {
        if let hostMasks {
            let bucket = buckets.bucket(holding: window.position + window.count)
            let x = try await run(HostWindow.sequence(window, prefillLength: prefillLength, bucket: bucket, masks: hostMasks),
                                  bucket: bucket)
            return try await backend.logits(x, phase: .prefill, column: window.count - 1)
        }
        let backend = self.backend
        let bucket = self.bucket(of: window)
        let x = try await runChunks(try await backend.embed(window, bucket: bucket), phase: window.phase, bucket: bucket) { i in
            if self.cacheInStates { return }  // the chunk wrote its window into its states
            await self.updates.submit(i) {
                try await backend.updateCache(i, phase: window.phase, bucket: bucket, position: window.position)
            }
        }
        return try await backend.logits(x, phase: window.phase, column: window.count - 1)
    }

    /// A window of an export whose prefill window decodes through the prefill functions at `bucket`:
    /// the embeddings on its ids and row positions, each chunk, and with input caches each chunk's
    /// prefill cache update writing the window at `window.position` (with state caches the chunks
    /// write it there themselves). Returns the last chunk's activations.
    func run(_ window: HostWindow, bucket: Int) async throws -> Backend.Activations {
        let backend = self.backend
        return try await runChunks(try await backend.embed(window, bucket: bucket), phase: .prefill, bucket: bucket) { i in
            if self.cacheInStates { return }  // the chunk wrote its window into its states
            await self.updates.submit(i) {
                try await backend.updateCache(i, phase: .prefill, bucket: bucket, position: window.position)
            }
        }
    }

    /// The context bucket `window` runs in: the smallest that holds its real tokens.
    public func bucket(of window: TokenWindow) -> Int {
        ContextBuckets.isBucketed(window.phase) ? buckets.bucket(holding: window.position + window.count) : contextLength
    }

    /// The chunks of `phase` at `bucket` in manifest order on `x`: chunk i runs once its previous
    /// cache update has finished, and `afterChunk(i)` follows at once (where a window submits its update).
    func runChunks(_ x: Backend.Activations, phase: Phase, bucket: Int,
                   afterChunk: (Int) async -> Void) async throws -> Backend.Activations {
        var x = x
        for i in 0..<backend.chunkCount {
            try await updates.wait(i)
            x = try await backend.runChunk(i, x, phase: phase, bucket: bucket)
            await afterChunk(i)
        }
        return x
    }

    /// Waits for the cache updates still running (e.g. before reading or saving the caches).
    public func finishUpdates() async throws { try await updates.waitAll() }

    public func reset() async throws {
        try await updates.waitAll()
        try await branchUpdates.waitAll()
        try await backend.resetCaches()
    }
}
