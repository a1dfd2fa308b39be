/// Where a function input comes from. Resolved once from the manifest's tensor names, so the
/// exporter and the host share no list of tensors beyond the role names of docs/manifest.md.
public enum TensorSource: Equatable, Sendable {
    /// The previous stage's hidden states.
    case hiddenStates
    /// An output of the embeddings function of the same phase (cos, sin, masks).
    case embeddingsOutput(String)
    /// A mask the host makes (mask, sliding_mask) where the prefill window decodes: its embeddings
    /// output none (`HostMasks`, `HostWindow`).
    case hostMask(String)
    /// The chunk's prefix KV cache (k_cache, v_cache, and the sliding layers' ring k_ring, v_ring).
    case cache(String)
    /// The chunk's per-branch suffix cache (k_suffix, v_suffix).
    case suffixCache(String)
    /// An output of the chunk that just ran (k_new, v_new, k_ring_new, v_ring_new).
    case chunkOutput(String)
    /// An int32 the host writes (position, suffix_positions, slots, ring_slots, input_ids of a later
    /// embeddings part, a state export's window_tokens).
    case value(String)
    /// The chunk's conv or recurrent state (conv_state, delta_state), which the host carries from
    /// the chunk's conv_new or delta_new.
    case carriedState(CarriedState)
    /// Each cascade branch's conv or recurrent state (conv_branches, delta_branches): the prefix's,
    /// copied at a group's first step, then moved on by each step's conv_new or delta_new.
    case carriedBranches(CarriedState)
    /// The per-layer inputs so far (per_layer_inputs): a later embeddings file's, from the file before it.
    case perLayerInputs
    /// Rows the host copies from tensors it holds, in order along `axis` (Gemma 4: a chunk's rows of
    /// the per-layer inputs, along the channels; its KV-shared layers' producers' K/V, along the
    /// layers), see `Manifest.hostRows`.
    case gathered(axis: Int, rows: [HostRows])
}

/// How a chunk's carried state (`CarriedState`: `cache.conv`, `cache.delta`) moves on in one phase.
public enum CarryMode: Equatable, Sendable {
    /// The chunk has no layers with that state.
    case none
    /// The chunk reads the state (conv_state, delta_state) as an input and returns conv_new (the
    /// window's values) or delta_new (the state after the window's real tokens), from which the
    /// host takes the state (`CarriedState.afterWindow`).
    case fromOutput
    /// The state is a Core ML state the chunk writes itself, from `window_tokens`.
    case inState
    /// The chunk reads the branches' states (conv_branches, delta_branches) and returns conv_new or
    /// delta_new, by which the host moves each branch on (`CarriedState.afterBranchStep`).
    case branches
}

/// The data flow of an export: for each phase and chunk, where every chunk and cache-update input
/// comes from, which cache tensors each cache update rewrites (its outputs `X_out` are the new
/// `X`) and which states the chunk holds; for each later embeddings part, where its inputs come
/// from. Building it checks that every input is produced somewhere.
public struct PipelineWiring: Equatable, Sendable {
    /// Per phase, for each embeddings part after the first (`manifest.embeddings.models[1...]`):
    /// `.hiddenStates` (the previous part's), `.value` (the int32s the first part reads too) and,
    /// where the first outputs Gemma 4's per-layer inputs, `.perLayerInputs` (the previous part's).
    /// Each outputs `hidden_states_out` (and `per_layer_inputs_out`), shaped like the first part's
    /// `hidden_states` (and `per_layer_inputs`).
    public let embeddingInputs: [Phase: [[String: TensorSource]]]
    public let chunkInputs: [Phase: [[String: TensorSource]]]
    public let updateInputs: [Phase: [[String: TensorSource]]]
    /// Per phase and chunk: the cache tensors the update rewrites, with their specs (none for the
    /// prefill and decode of a state export, whose chunks write their caches themselves).
    public let updatedState: [Phase: [[Manifest.TensorSpec]]]
    /// Per phase and chunk: the Core ML states the chunk function reads (and, for prefill and
    /// decode, writes): k_cache and v_cache, and k_ring and v_ring where the chunk has sliding
    /// layers with a ring buffer, in a state export; none otherwise.
    ///
    /// Where the prefill window decodes there is no decode phase (`phases(of:)`): a decoded token
    /// runs the prefill phase's wiring (`Manifest.runs`).
    public let chunkStates: [Phase: [[Manifest.TensorSpec]]]
    /// The LM head models run on the last chunk's hidden states after every step, in manifest
    /// order; empty when the head is folded into the last chunk (`headFolded`).
    public let headModels: [String]
    /// The last chunk outputs the logits itself in every function, bucket copies included
    /// (`lm_head.folded_into`): a step reads them from that chunk's outputs and calls no head model.
    public let headFolded: Bool
    /// Per phase, the logits outputs in vocabulary order (logits_0, logits_1, ...), of the head
    /// models or of the last chunk.
    public let logitsOutputs: [Phase: [String]]
    /// Per phase and chunk: how each of its carried states moves on (`.none` without such layers).
    public let stateCarry: [Phase: [[CarriedState: CarryMode]]]

    /// How chunk `index`'s `state` moves on in `phase`.
    public func carry(_ state: CarriedState, _ phase: Phase, chunk index: Int) -> CarryMode {
        stateCarry[phase]?[index][state] ?? .none
    }

    /// The phases the export has: prefill and decode (prefill alone where the prefill window decodes:
    /// a decoded token runs it, `Manifest.runs`), plus decode_branches with a branch width (none where
    /// the cascade steps through the prefill window) and verify with a verify window.
    public static func phases(of manifest: Manifest) -> [Phase] {
        var phases = manifest.windowPhases
        if (manifest.branchWidth ?? 0) > 0, !manifest.windowCascade { phases.append(.decodeBranches) }
        if (manifest.verifyWindow ?? 0) > 0 { phases.append(.verify) }
        return phases
    }

    /// Resolves every phase's wiring; each context bucket's prefill and decode functions must be
    /// wired as the whole context's are (only their cache widths differ), so one wiring per phase
    /// serves every bucket.
    public init(manifest: Manifest) throws {
        var embeddingInputs: [Phase: [[String: TensorSource]]] = [:]
        var chunkInputs: [Phase: [[String: TensorSource]]] = [:]
        var updateInputs: [Phase: [[String: TensorSource]]] = [:]
        var updatedState: [Phase: [[Manifest.TensorSpec]]] = [:]
        var chunkStates: [Phase: [[Manifest.TensorSpec]]] = [:]
        var logitsOutputs: [Phase: [String]] = [:]
        var stateCarry: [Phase: [[CarriedState: CarryMode]]] = [:]
        for phase in Self.phases(of: manifest) {
            logitsOutputs[phase] = try Self.logitsOutputs(phase.rawValue, manifest: manifest)
            embeddingInputs[phase] = try Self.embeddingWiring(phase.rawValue, manifest: manifest)
            let chunks = try Self.chunkWiring(phase, function: phase.rawValue, manifest: manifest)
            chunkInputs[phase] = chunks.map(\.inputs)
            updateInputs[phase] = chunks.map(\.update)
            updatedState[phase] = chunks.map(\.state)
            chunkStates[phase] = chunks.map(\.states)
            stateCarry[phase] = chunks.map(\.carry)
        }
        let buckets = manifest.buckets
        for bucket in buckets.sizes.dropLast() {
            for phase in manifest.windowPhases {
                let name = buckets.functionName(phase, bucket: bucket)
                let chunks = try Self.chunkWiring(phase, function: name, manifest: manifest)
                for (i, chunk) in chunks.enumerated()
                where chunk.inputs != chunkInputs[phase]?[i] || chunk.update != updateInputs[phase]?[i]
                    || chunk.state.map(\.name) != updatedState[phase]?[i].map(\.name) || chunk.carry != stateCarry[phase]?[i] {
                    throw ManifestError.inconsistent("\(manifest.chunks[i].model) (\(name)) and its cache update take other "
                        + "inputs than \(phase.rawValue): a context bucket's functions must differ only in their cache length")
                }
                if manifest.lmHead.foldedInto != nil, try Self.logitsOutputs(name, manifest: manifest) != logitsOutputs[phase] {
                    throw ManifestError.inconsistent("\(manifest.lmHead.foldedInto ?? "") (\(name)) outputs other logits than "
                        + "\(phase.rawValue): a context bucket's functions must differ only in their cache length")
                }
            }
        }
        self.embeddingInputs = embeddingInputs
        self.chunkInputs = chunkInputs
        self.updateInputs = updateInputs
        self.updatedState = updatedState
        self.chunkStates = chunkStates
        self.headModels = manifest.lmHead.foldedInto == nil ? manifest.lmHead.models : []
        self.headFolded = manifest.lmHead.foldedInto != nil
        self.logitsOutputs = logitsOutputs
        self.stateCarry = stateCarry
    }

    /// The logits outputs of function `p` of the head models (or of the chunk carrying the head),
    /// in vocabulary order; `Manifest.decode` has checked that they are logits_0..logits_{n-1}.
    private static func logitsOutputs(_ p: String, manifest: Manifest) throws -> [String] {
        let names = try manifest.lmHead.logitsModels.flatMap { model in
            try manifest.function(model, p).outputs.map(\.name).filter { $0.hasPrefix(TensorNames.logitsPrefix) }
        }
        return names.sorted { Int($0.dropFirst(TensorNames.logitsPrefix.count)) ?? 0 < Int($1.dropFirst(TensorNames.logitsPrefix.count)) ?? 0 }
    }

    /// Where the inputs of each later embeddings part come from in function `p`.
    private static func embeddingWiring(_ p: String, manifest: Manifest) throws -> [[String: TensorSource]] {
        guard let firstPart = manifest.embeddings.models.first else {
            throw ManifestError.inconsistent("embeddings models is empty")
        }
        let first = try manifest.function(firstPart, p)
        return try manifest.embeddings.models.dropFirst().map {
            try Self.embeddingPartInputs($0, p, first: first, firstName: firstPart, manifest: manifest)
        }
    }

    /// One chunk's wiring in one function: its inputs, its cache update's inputs, the tensors the
    /// update rewrites, the states the chunk holds and how its carried states move on.
    private struct ChunkWiring {
        let inputs: [String: TensorSource]
        let update: [String: TensorSource]
        let state: [Manifest.TensorSpec]
        let states: [Manifest.TensorSpec]
        let carry: [CarriedState: CarryMode]
    }

    /// Every chunk's wiring in function `p` of `phase` (the phase's own name, or a context bucket's).
    private static func chunkWiring(_ phase: Phase, function p: String, manifest: Manifest) throws -> [ChunkWiring] {
        guard let firstPart = manifest.embeddings.models.first else {
            throw ManifestError.inconsistent("embeddings models is empty")
        }
        let embeddings = Set(try manifest.function(firstPart, p).outputs.map(\.name).filter { $0 != TensorNames.perLayerInputs })
        let perLayer = try manifest.function(firstPart, p).output(TensorNames.perLayerInputs)
        let inStates = manifest.cache.inStates
        return try manifest.chunks.enumerated().map { index, chunk in
            let gathered = manifest.hostRows(chunk: index, phase: phase)
            let run = try manifest.function(chunk.model, p)
            // A state export's prefill and decode write their caches themselves: no cache update;
            // nor has a chunk of conv layers only, which keeps no K/V.
            let updateName = chunk.cacheUpdate[p]
            if updateName == nil, manifest.keepsKV(chunk), !(inStates && phase != .decodeBranches) {
                throw ManifestError.inconsistent("chunk \(chunk.model) names no \(p) cache update")
            }
            let update = try updateName.map { try manifest.function("cache_update", $0) }
            let state = try update.map { try Self.state(of: $0) } ?? []
            let stateNames = Set(state.map(\.name))
            // Decode's cache update rewrites the prefix cache; decode_branches' the suffix caches.
            // In a state export the prefix caches are the chunks' states, never inputs.
            let prefixNames: Set<String>
            if inStates {
                prefixNames = []
            } else if phase == .decodeBranches {
                let decodeUpdate = try chunk.cacheUpdate[manifest.decodePhase.rawValue].map { try manifest.function("cache_update", $0) }
                prefixNames = Set(try decodeUpdate.map { try Self.state(of: $0) }?.map(\.name) ?? [])
            } else {
                prefixNames = stateNames
            }
            var inputs: [String: TensorSource] = [:]
            for spec in run.inputs {
                if spec.name == TensorNames.hiddenStates {
                    inputs[spec.name] = .hiddenStates
                } else if embeddings.contains(spec.name) {
                    inputs[spec.name] = .embeddingsOutput(spec.name)
                } else if manifest.prefillDecodes, phase == .prefill, TensorNames.hostMasks.contains(spec.name) {
                    inputs[spec.name] = .hostMask(spec.name)  // the window's masks, made by the host
                } else if prefixNames.contains(spec.name) {
                    inputs[spec.name] = .cache(spec.name)
                } else if phase == .decodeBranches, stateNames.contains(spec.name) {
                    inputs[spec.name] = .suffixCache(spec.name)
                } else if inStates, spec.name == TensorNames.position, spec.dtype == "int32" {
                    inputs[spec.name] = .value(spec.name)  // where the function writes the window into its states
                } else if inStates || manifest.cache.delta != nil, spec.name == TensorNames.windowTokens, spec.dtype == "int32" {
                    inputs[spec.name] = .value(spec.name)  // the window's real tokens, after which it keeps its states
                } else if !inStates, phase != .decodeBranches, let carried = CarriedState.allCases.first(where: { $0.stateName == spec.name }) {
                    inputs[spec.name] = .carriedState(carried)
                } else if phase == .decodeBranches, let carried = CarriedState.allCases.first(where: { $0.branchesName == spec.name }) {
                    inputs[spec.name] = .carriedBranches(carried)
                } else if let rows = gathered[spec.name], spec.name != TensorNames.perLayerInput || perLayer != nil {
                    let axis = spec.name == TensorNames.perLayerInput ? 1 : 0
                    let count = rows.reduce(0) { $0 + $1.rows.count }
                    guard spec.shape.count == 4, spec.shape[axis] == count else {
                        throw ManifestError.inconsistent("\(chunk.model) (\(p)) reads \(spec.name) of shape \(spec.shape), but its "
                            + "layers \(chunk.layers) take \(count) rows of it along axis \(axis)")
                    }
                    for block in rows { try Self.checkSource(block, of: spec.name, in: chunk.model, index, p, manifest: manifest) }
                    inputs[spec.name] = .gathered(axis: axis, rows: rows)
                } else {
                    throw PipelineError.unwiredInput(model: "\(chunk.model) (\(p))", input: spec.name)
                }
            }
            for spec in run.states where !TensorNames.caches.contains(spec.name) {
                throw PipelineError.unwiredInput(model: "\(chunk.model) (\(p))", input: spec.name)
            }
            let outputs = Set(run.outputs.map(\.name))
            var updateSources: [String: TensorSource] = [:]
            for spec in update?.inputs ?? [] {
                if spec.dtype == "int32" {
                    guard Self.updateValues[phase]?.contains(spec.name) ?? false else {
                        throw PipelineError.unwiredInput(model: "cache_update (\(updateName ?? p))", input: spec.name)
                    }
                    updateSources[spec.name] = .value(spec.name)
                } else if stateNames.contains(spec.name) {
                    updateSources[spec.name] = phase == .decodeBranches ? .suffixCache(spec.name) : .cache(spec.name)
                } else if outputs.contains(spec.name) {
                    updateSources[spec.name] = .chunkOutput(spec.name)
                } else {
                    throw PipelineError.unwiredInput(model: "cache_update (\(updateName ?? p))", input: spec.name)
                }
            }
            var carry: [CarriedState: CarryMode] = [:]
            for carried in CarriedState.allCases {
                carry[carried] = try Self.carry(carried, chunk, "\(chunk.model) (\(p))", run, inputs: inputs, manifest: manifest)
            }
            return ChunkWiring(inputs: inputs, update: updateSources, state: state, states: run.states, carry: carry)
        }
    }

    /// How chunk `chunk`'s `carried` state moves on in function `run` (`label`): a chunk that reads
    /// it must give the host what it needs to carry it (conv_new or delta_new; window_tokens for a
    /// state), and a chunk with such layers must read it.
    private static func carry(_ carried: CarriedState, _ chunk: Manifest.Chunk, _ label: String, _ run: Manifest.Function,
                              inputs: [String: TensorSource], manifest: Manifest) throws -> CarryMode {
        let returnsNew = run.output(carried.newName) != nil
        let carry: CarryMode
        if inputs[carried.stateName] == .carriedState(carried) {
            carry = .fromOutput
        } else if inputs[carried.branchesName] == .carriedBranches(carried) {
            carry = .branches
        } else if run.states.contains(where: { $0.name == carried.stateName }) {
            guard inputs[TensorNames.windowTokens] != nil else {
                throw PipelineError.unwiredInput(model: label, input: TensorNames.windowTokens)
            }
            carry = .inState
        } else {
            let rows = manifest.cacheRows(of: chunk)
            guard (carried == .conv ? rows.conv : rows.delta) == 0 else {
                throw ManifestError.inconsistent("\(label) reads no \(carried.stateName), but the chunk's layers \(chunk.layers) "
                    + "include layers that keep one (cache.\(carried.rawValue).layers "
                    + "\((carried == .conv ? manifest.cache.conv?.layers : manifest.cache.delta?.layers) ?? []))")
            }
            return .none
        }
        guard returnsNew == (carry != .inState) else {
            throw ManifestError.inconsistent("\(label) " + (returnsNew ? "returns" : "does not return") + " \(carried.newName), "
                + "but its \(carried.stateName) is " + (carry == .inState ? "a state it writes itself" : "carried by the host from it"))
        }
        return carry
    }

    /// The tensor `rows` names exists where it says and holds those rows: a chunk that runs before
    /// chunk `index` outputs it in function `p`, or reads it as its cache or suffix cache.
    private static func checkSource(_ rows: HostRows, of input: String, in model: String, _ index: Int, _ p: String,
                                    manifest: Manifest) throws {
        let spec: Manifest.TensorSpec?
        switch rows.place {
        case .perLayerInputs:
            return  // the shape check of the input covers the per-layer rows
        case let .cache(c), let .suffix(c):
            spec = try manifest.function(manifest.chunks[c].model, p).input(rows.tensor)
        case let .output(c):
            spec = c < index ? try manifest.function(manifest.chunks[c].model, p).output(rows.tensor) : nil
        }
        guard let spec, spec.shape.count == 4, rows.rows.upperBound <= spec.shape[0] else {
            throw ManifestError.inconsistent("\(model) (\(p)) reads \(input), whose rows \(rows.rows) come from \(rows.tensor) of "
                + "an earlier chunk (\(rows.place)), which it does not hold")
        }
    }

    /// Where the inputs of the later embeddings part `name` come from; checks that it takes and
    /// gives hidden states shaped like the first part's.
    private static func embeddingPartInputs(_ name: String, _ p: String, first: Manifest.Function, firstName: String,
                                            manifest: Manifest) throws -> [String: TensorSource] {
        guard let hidden = first.output(TensorNames.hiddenStates) else {
            throw ManifestError.inconsistent("\(firstName) (\(p)) has no output \(TensorNames.hiddenStates)")
        }
        let part = try manifest.function(name, p)
        func sameAsHidden(_ spec: Manifest.TensorSpec?) -> Bool { spec?.shape == hidden.shape && spec?.dtype == hidden.dtype }
        guard sameAsHidden(part.input(TensorNames.hiddenStates)), sameAsHidden(part.output(TensorNames.hiddenStatesOut)) else {
            throw ManifestError.inconsistent("embeddings part \(name) (\(p)) must take \(TensorNames.hiddenStates) and output "
                + "\(TensorNames.hiddenStatesOut), both \(hidden.dtype) \(hidden.shape) like the \(TensorNames.hiddenStates) of \(firstName)")
        }
        // Gemma 4's per-layer inputs pass through every later file as the hidden states do
        let perLayer = first.output(TensorNames.perLayerInputs)
        let reads = part.input(TensorNames.perLayerInputs), gives = part.output(TensorNames.perLayerInputsOut)
        guard (reads == nil && gives == nil && perLayer == nil)
                || (reads?.shape == perLayer?.shape && gives?.shape == perLayer?.shape && perLayer != nil) else {
            throw ManifestError.inconsistent("embeddings part \(name) (\(p)) must " + (perLayer == nil ? "neither take nor give"
                : "take \(TensorNames.perLayerInputs) and output \(TensorNames.perLayerInputsOut), both of shape "
                    + "\(perLayer?.shape ?? [])") + " as \(firstName) outputs \(TensorNames.perLayerInputs)")
        }
        var inputs: [String: TensorSource] = [:]
        for spec in part.inputs {
            if spec.name == TensorNames.hiddenStates {
                inputs[spec.name] = .hiddenStates
            } else if spec.name == TensorNames.perLayerInputs {
                inputs[spec.name] = .perLayerInputs
            } else if spec.dtype == "int32", first.input(spec.name) == spec {
                inputs[spec.name] = .value(spec.name)
            } else {
                throw PipelineError.unwiredInput(model: "\(name) (\(p))", input: spec.name)
            }
        }
        return inputs
    }

    /// The int32 inputs of each phase's cache updates that the host writes: where the window goes
    /// (its position; the branches' suffix positions; the accepted tree tokens' cache and ring slots).
    static let updateValues: [Phase: Set<String>] = [
        .prefill: [TensorNames.position], .decode: [TensorNames.position],
        .decodeBranches: [TensorNames.suffixPositions], .verify: [TensorNames.slots, TensorNames.ringSlots],
    ]

    /// The inputs X of a cache update that has an output X_out.
    static func state(of update: Manifest.Function) throws -> [Manifest.TensorSpec] {
        try update.outputs.map { out in
            let name = String(out.name.dropLast(TensorNames.updatedSuffix.count))
            guard out.name.hasSuffix(TensorNames.updatedSuffix), let spec = update.input(name) else {
                throw PipelineError.unwiredInput(model: "cache_update", input: out.name)
            }
            return spec
        }
    }
}
