/// Where a function input comes from. Resolved once from the manifest's tensor names, so the
/// exporter and the host share no list of tensors beyond the role names of docs/manifest.md.
public enum TensorSource: Equatable, Sendable {
    /// The previous stage's hidden states.
    case hiddenStates
    /// An output of the embeddings function of the same phase (cos, sin, masks).
    case embeddingsOutput(String)
    /// The chunk's prefix KV cache (k_cache, v_cache).
    case cache(String)
    /// The chunk's per-branch suffix cache (k_suffix, v_suffix).
    case suffixCache(String)
    /// An output of the chunk that just ran (k_new, v_new).
    case chunkOutput(String)
    /// An int32 the host writes (position, suffix_positions, input_ids of a later embeddings part).
    case value(String)
}

/// The data flow of an export: for each phase and chunk, where every chunk and cache-update input
/// comes from, and which cache tensors each cache update rewrites (its outputs `X_out` are the new
/// `X`); for each later embeddings part, where its inputs come from. Building it checks that every
/// input is produced somewhere.
public struct PipelineWiring: Equatable, Sendable {
    /// Per phase, for each embeddings part after the first (`manifest.embeddings.models[1...]`):
    /// `.hiddenStates` (the previous part's) and `.value` (the int32s the first part reads too).
    /// Each outputs `hidden_states_out`, shaped like the first part's `hidden_states`.
    public let embeddingInputs: [Phase: [[String: TensorSource]]]
    public let chunkInputs: [Phase: [[String: TensorSource]]]
    public let updateInputs: [Phase: [[String: TensorSource]]]
    /// Per phase and chunk: the cache tensors the update rewrites, with their specs.
    public let updatedState: [Phase: [[Manifest.TensorSpec]]]

    /// The phases the export has: prefill and decode, plus decode_branches with a branch width.
    public static func phases(of manifest: Manifest) -> [Phase] {
        (manifest.branchWidth ?? 0) > 0 ? Phase.allCases : [.prefill, .decode]
    }

    public init(manifest: Manifest) throws {
        var embeddingInputs: [Phase: [[String: TensorSource]]] = [:]
        var chunkInputs: [Phase: [[String: TensorSource]]] = [:]
        var updateInputs: [Phase: [[String: TensorSource]]] = [:]
        var updatedState: [Phase: [[Manifest.TensorSpec]]] = [:]
        for phase in Self.phases(of: manifest) {
            let p = phase.rawValue
            guard let firstPart = manifest.embeddings.models.first else {
                throw ManifestError.inconsistent("embeddings models is empty")
            }
            let first = try manifest.function(firstPart, p)
            let embeddings = Set(first.outputs.map(\.name))
            embeddingInputs[phase] = try manifest.embeddings.models.dropFirst().map {
                try Self.embeddingPartInputs($0, p, first: first, firstName: firstPart, manifest: manifest)
            }
            var chunks: [[String: TensorSource]] = [], updates: [[String: TensorSource]] = [], states: [[Manifest.TensorSpec]] = []
            for chunk in manifest.chunks {
                guard let updateName = chunk.cacheUpdate[p] else {
                    throw ManifestError.inconsistent("chunk \(chunk.model) names no \(p) cache update")
                }
                let run = try manifest.function(chunk.model, p)
                let update = try manifest.function("cache_update", updateName)
                let state = try Self.state(of: update)
                let stateNames = Set(state.map(\.name))
                // Decode's cache update rewrites the prefix cache; decode_branches' the suffix caches.
                let prefixNames = phase == .decodeBranches
                    ? Set(try Self.state(of: manifest.function("cache_update", chunk.cacheUpdate[Phase.decode.rawValue] ?? "")).map(\.name))
                    : stateNames
                var inputs: [String: TensorSource] = [:]
                for spec in run.inputs {
                    if spec.name == TensorNames.hiddenStates {
                        inputs[spec.name] = .hiddenStates
                    } else if embeddings.contains(spec.name) {
                        inputs[spec.name] = .embeddingsOutput(spec.name)
                    } else if prefixNames.contains(spec.name) {
                        inputs[spec.name] = .cache(spec.name)
                    } else if phase == .decodeBranches, stateNames.contains(spec.name) {
                        inputs[spec.name] = .suffixCache(spec.name)
                    } else {
                        throw PipelineError.unwiredInput(model: "\(chunk.model) (\(p))", input: spec.name)
                    }
                }
                let outputs = Set(run.outputs.map(\.name))
                var updateSources: [String: TensorSource] = [:]
                for spec in update.inputs {
                    if spec.dtype == "int32" {
                        updateSources[spec.name] = .value(spec.name)
                    } else if stateNames.contains(spec.name) {
                        updateSources[spec.name] = phase == .decodeBranches ? .suffixCache(spec.name) : .cache(spec.name)
                    } else if outputs.contains(spec.name) {
                        updateSources[spec.name] = .chunkOutput(spec.name)
                    } else {
                        throw PipelineError.unwiredInput(model: "cache_update (\(updateName))", input: spec.name)
                    }
                }
                chunks.append(inputs)
                updates.append(updateSources)
                states.append(state)
            }
            chunkInputs[phase] = chunks
            updateInputs[phase] = updates
            updatedState[phase] = states
        }
        self.embeddingInputs = embeddingInputs
        self.chunkInputs = chunkInputs
        self.updateInputs = updateInputs
        self.updatedState = updatedState
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
        var inputs: [String: TensorSource] = [:]
        for spec in part.inputs {
            if spec.name == TensorNames.hiddenStates {
                inputs[spec.name] = .hiddenStates
            } else if spec.dtype == "int32", first.input(spec.name) == spec {
                inputs[spec.name] = .value(spec.name)
            } else {
                throw PipelineError.unwiredInput(model: "\(name) (\(p))", input: spec.name)
            }
        }
        return inputs
    }

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
