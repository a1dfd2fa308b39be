import Foundation

extension Manifest {
    /// Reads and checks `folder/manifest.json`: the format version first, then the structure,
    /// every file name (plain relative names only) and every named file's presence.
    /// With `verifyHashes` each artifact's sha256 is checked too (slow for large models).
    public static func load(from folder: URL, verifyHashes: Bool = false) throws -> Manifest {
        let url = folder.appendingPathComponent(fileName)
        guard let data = try? Data(contentsOf: url) else { throw ManifestError.missingManifest(folder: folder.path) }
        let manifest = try decode(data, path: url.path)
        try manifest.checkFiles(in: folder, verifyHashes: verifyHashes)
        return manifest
    }

    /// Decodes manifest JSON, refusing unknown format versions before anything else.
    public static func decode(_ data: Data, path: String = fileName) throws -> Manifest {
        let top: Any
        do { top = try JSONSerialization.jsonObject(with: data, options: .fragmentsAllowed) } catch {
            throw ManifestError.invalidJSON(path: path, reason: "\(error.localizedDescription)")
        }
        guard let object = top as? [String: Any] else { throw ManifestError.notAnObject(kind: describeKind(top)) }
        struct VersionProbe: Decodable {
            let formatVersion: Int?
            enum CodingKeys: String, CodingKey { case formatVersion = "format_version" }
        }
        let probe: VersionProbe
        do { probe = try JSONDecoder().decode(VersionProbe.self, from: data) } catch {
            throw ManifestError.invalidJSON(path: path, reason: describe(error))
        }
        if let version = probe.formatVersion, let was = retiredFormatVersions[version] {
            throw ManifestError.retiredFormatVersion(found: version, was: was, current: prefillDecodesFormatVersion)
        }
        guard let version = probe.formatVersion, supportedFormatVersions.contains(version) else {
            throw ManifestError.unsupportedFormatVersion(found: probe.formatVersion, supported: supportedFormatVersions)
        }
        if let config = object["config"] as? [String: Any],
           let refused = config.keys.filter({ ModelConfig.refusedFields[$0] != nil }).min() {
            throw ManifestError.unsupportedConfigField(refused, lacks: ModelConfig.refusedFields[refused] ?? "")
        }
        if let config = object["config"] as? [String: Any],
           let unknown = config.keys.filter({ !ModelConfig.knownFields.contains($0) }).min() {
            throw ManifestError.unknownConfigField(unknown)
        }
        let manifest: Manifest
        do { manifest = try JSONDecoder().decode(Manifest.self, from: data) } catch {
            throw ManifestError.invalidJSON(path: path, reason: describe(error))
        }
        try manifest.checkDecodeFunction()
        try manifest.checkStructure()
        return manifest
    }

    /// `decode_function` and `cascade` hold known values, format_version 4 is written only where the
    /// prefill window decodes (as Python's reader checks), and the cascade steps through the prefill
    /// window only where that window decodes.
    func checkDecodeFunction() throws {
        guard ["decode", "prefill"].contains(decodeFunction ?? "decode") else {
            throw ManifestError.inconsistent("decode_function \"\(decodeFunction ?? "")\" is neither \"decode\" nor \"prefill\"")
        }
        guard ["function", "window"].contains(cascade ?? "function") else {
            throw ManifestError.inconsistent("cascade \"\(cascade ?? "")\" is neither \"function\" nor \"window\"")
        }
        if formatVersion == Self.prefillDecodesFormatVersion, !prefillDecodes {
            throw ManifestError.inconsistent("format_version \(formatVersion) is written only with decode_function \"prefill\", "
                + "but it has " + (decodeFunction.map { "\"\($0)\"" } ?? "none"))
        }
        if windowCascade, !prefillDecodes {
            throw ManifestError.inconsistent("cascade \"window\" steps through the prefill window, but decode_function is "
                + "\"\(decodeFunction ?? "decode")\", not \"prefill\"")
        }
        if windowCascade, (branchWidth ?? 0) > prefillLength {
            throw ManifestError.inconsistent("cascade \"window\" runs branch_width \(branchWidth ?? 0) branches as rows of the "
                + "prefill window, which holds \(prefillLength) (prefill_length)")
        }
    }

    /// The URL of `name` inside `folder`, refusing absolute paths, `..`, backslashes and empty names.
    public static func resolve(_ name: String, in folder: URL) throws -> URL {
        let parts = name.split(separator: "/", omittingEmptySubsequences: false)
        guard !name.isEmpty, !name.hasPrefix("/"), !name.contains("\\"), !name.hasPrefix("~"),
              !parts.contains(".."), !parts.contains(""), !parts.contains(".") else {
            throw ManifestError.unsafePath(name)
        }
        return folder.appendingPathComponent(name)
    }

    /// Every file name the manifest mentions: artifacts, function packages and tokenizer files.
    public var namedFiles: [String] {
        var names = Set(files.keys)
        for entry in models.values { for f in entry.functions.values { names.insert(f.file) } }
        names.formUnion(tokenizer.files)
        return names.sorted()
    }

    /// Every file the manifest names outside its `files` map -> the first field that names it: each
    /// function's package and the tokenizer's files.
    public var referencedFiles: [String: String] {
        var found: [String: String] = [:]
        for (model, entry) in models.sorted(by: { $0.key < $1.key }) {
            for (name, f) in entry.functions.sorted(by: { $0.key < $1.key }) where found[f.file] == nil {
                found[f.file] = "models.\(model).functions.\(name).file"
            }
        }
        for (i, name) in tokenizer.files.enumerated() where found[name] == nil { found[name] = "tokenizer.files[\(i)]" }
        return found
    }

    /// Checks names, hashes' presence, links, presence and (optionally) hashes of all named files in
    /// `folder`: every name is a plain relative name, `files` holds the sha256 of every file named
    /// anywhere, and no named file (nor anything inside a package) is a link leading outside `folder`.
    public func checkFiles(in folder: URL, verifyHashes: Bool = false) throws {
        for name in namedFiles { _ = try Self.resolve(name, in: folder) }
        guard !files.isEmpty else { throw ManifestError.noHashes }
        let hex = Set("0123456789abcdef")
        for (name, digest) in files.sorted(by: { $0.key < $1.key }) where digest.count != 64 || !digest.allSatisfy(hex.contains) {
            throw ManifestError.invalidHash(name)
        }
        for (name, field) in referencedFiles.sorted(by: { $0.key < $1.key }) where files[name] == nil {
            throw ManifestError.missingHash(name: name, field: field)
        }
        for name in namedFiles {
            let url = try Self.resolve(name, in: folder)
            guard FileManager.default.fileExists(atPath: url.path) else { throw ManifestError.missingFile(name) }
            try Self.checkInside(url, name: name, root: folder)
        }
        guard verifyHashes else { return }
        for (name, digest) in files.sorted(by: { $0.key < $1.key }) {
            let actual = try SHA256.manifestHash(of: try Self.resolve(name, in: folder))
            guard actual == digest.lowercased() else { throw ManifestError.hashMismatch(name) }
        }
    }

    /// Refuses `url` when it, or anything inside it, resolves to a place outside `root` (a link).
    private static func checkInside(_ url: URL, name: String, root: URL) throws {
        let base = root.resolvingSymlinksInPath().standardizedFileURL.path
        func inside(_ u: URL) -> Bool {
            let p = u.resolvingSymlinksInPath().standardizedFileURL.path
            return p == base || p.hasPrefix(base + "/")
        }
        var candidates = [url]
        var isDirectory: ObjCBool = false
        if inside(url), FileManager.default.fileExists(atPath: url.path, isDirectory: &isDirectory), isDirectory.boolValue,
           let walk = FileManager.default.enumerator(at: url, includingPropertiesForKeys: nil) {
            candidates += walk.compactMap { $0 as? URL }
        }
        for u in candidates where !inside(u) {
            throw ManifestError.linkOutside(name: name, link: u.path, target: u.resolvingSymlinksInPath().path)
        }
    }

    /// The function `function` of model `model`, or an error naming what is missing.
    public func function(_ model: String, _ function: String) throws -> Function {
        guard let entry = models[model] else {
            throw ManifestError.inconsistent("no model \"\(model)\" (models: \(models.keys.sorted().joined(separator: ", ")))")
        }
        guard let f = entry.functions[function] else {
            throw ManifestError.inconsistent("model \"\(model)\" has no function \"\(function)\" "
                + "(functions: \(entry.functions.keys.sorted().joined(separator: ", ")))")
        }
        return f
    }

    /// Cross-checks that do not need the files: the chunk plan, the functions of every embeddings,
    /// chunk and LM head model (or the chunk the head is folded into), the cache-update functions,
    /// the embeddings' vocabulary ranges and the LM head's vocabulary split.
    func checkStructure() throws {
        guard contextLength > 0, prefillLength > 0, prefillLength <= contextLength else {
            throw ManifestError.inconsistent("context_length \(contextLength) and prefill_length \(prefillLength) must satisfy 0 < prefill <= context")
        }
        try checkCacheShapes()
        try checkBuckets()
        let layers = chunks.flatMap(\.layers).sorted()
        guard layers == Array(0..<config.numHiddenLayers) else {
            throw ManifestError.inconsistent("chunks cover layers \(layers), not each of 0..<\(config.numHiddenLayers) exactly once")
        }
        try checkRing()
        try checkConv()
        try checkDelta()
        try checkKVSharing()
        try checkChunkCacheRows()
        try Self.checkModelList("embeddings", embeddings.models)
        try checkHead()
        // where the prefill window decodes there are no decode functions (nor decode cache updates)
        let windows = windowPhases.map(\.rawValue)
        for name in embeddings.models + lmHead.models {
            for phase in windows { _ = try function(name, phase) }
        }
        for chunk in chunks {
            // a state export's prefill and decode write their caches in the chunk (no cache update),
            // and a chunk of conv layers only keeps no K/V to update
            for phase in windows where chunk.cacheUpdate[phase] == nil && !cache.inStates && keepsKV(chunk) {
                throw ManifestError.inconsistent("chunk \(chunk.model) names no \(phase) cache update")
            }
            for (phase, update) in chunk.cacheUpdate {
                _ = try function(chunk.model, phase)
                _ = try function("cache_update", update)
            }
        }
        if prefillDecodes { try checkHostWindows() }
        var phases = windows
        if (branchWidth ?? 0) > 0, !windowCascade {
            guard (suffixLength ?? 0) > 0 else {
                throw ManifestError.inconsistent("branch_width is \(branchWidth ?? 0) but suffix_length is missing")
            }
            phases.append(Phase.decodeBranches.rawValue)
            for name in embeddings.models + lmHead.models + chunks.map(\.model) {
                _ = try function(name, Phase.decodeBranches.rawValue)
            }
        }
        if (verifyWindow ?? 0) > 0 {
            try checkVerify()
            phases.append(Phase.verify.rawValue)
        }
        try checkVocabRanges()
        guard lmHead.vocabSplits.reduce(0, +) == config.vocabSize else {
            throw ManifestError.inconsistent("lm_head vocab_splits \(lmHead.vocabSplits) do not add up to vocab_size \(config.vocabSize)")
        }
        for phase in phases { try checkLogits(phase) }
        if lmHead.foldedInto != nil {
            // the folded chunk's bucket copies output the logits too (head models have no bucket copies)
            let buckets = self.buckets
            for bucket in buckets.sizes.dropLast() {
                for phase in windowPhases { try checkLogits(buckets.functionName(phase, bucket: bucket)) }
            }
        }
    }

    /// The head's models, or (`lm_head.folded_into`) no model and the last chunk carrying the head.
    private func checkHead() throws {
        guard let folded = lmHead.foldedInto else {
            return try Self.checkModelList("lm_head", lmHead.models)
        }
        let last = chunks.last?.model ?? ""
        guard folded == last else {
            throw ManifestError.inconsistent("lm_head folded_into names \"\(folded)\", not the last chunk \"\(last)\"")
        }
        guard lmHead.models.isEmpty else {
            throw ManifestError.inconsistent("lm_head has both models \(lmHead.models) and folded_into \"\(folded)\"")
        }
    }

    /// `context_buckets` ascend strictly from a positive size to `context_length`, and each bucket
    /// below it has its prefill and decode functions in the first embeddings model and every chunk,
    /// with a cache update for each (unless the caches are Core ML states).
    private func checkBuckets() throws {
        guard let sizes = contextBuckets else { return }
        guard let first = sizes.first, first > 0, sizes.last == contextLength,
              zip(sizes, sizes.dropFirst()).allSatisfy({ $0 < $1 }) else {
            throw ManifestError.inconsistent("context_buckets \(sizes) must ascend to context_length \(contextLength)")
        }
        let buckets = ContextBuckets(sizes, contextLength: contextLength)
        for bucket in sizes.dropLast() {
            for phase in windowPhases {
                let name = buckets.functionName(phase, bucket: bucket)
                for model in embeddings.models.prefix(1) { _ = try function(model, name) }
                for chunk in chunks {
                    _ = try function(chunk.model, name)
                    if chunk.cacheUpdate[name] == nil && !cache.inStates && keepsKV(chunk) {
                        throw ManifestError.inconsistent("chunk \(chunk.model) names no \(name) cache update")
                    }
                }
            }
        }
    }

    /// The "verify" functions of a `verify_window` W > 0: every embeddings, chunk and LM head model
    /// has one, each chunk that keeps K/V names its verify cache update, and the first embeddings part reads the
    /// tree's `input_ids` (1, W), `depths` (W,) and `tree_mask` (1, 1, W, W) by those names.
    private func checkVerify() throws {
        let w = verifyWindow ?? 0
        guard !cache.inStates else {
            throw ManifestError.inconsistent("verify_window is \(w) but the caches are Core ML states, which the verify cache update cannot write")
        }
        guard cache.conv == nil, cache.delta == nil else {
            throw ManifestError.inconsistent("verify_window is \(w) but the export has "
                + (cache.delta == nil ? "conv layers (cache.conv)" : "linear-attention layers (cache.delta)")
                + ", whose state cannot go back to drop a rejected draft")
        }
        for name in embeddings.models + lmHead.models + chunks.map(\.model) {
            _ = try function(name, Phase.verify.rawValue)
        }
        for chunk in chunks where chunk.cacheUpdate[Phase.verify.rawValue] == nil && keepsKV(chunk) {
            throw ManifestError.inconsistent("chunk \(chunk.model) names no verify cache update")
        }
        let first = try function(embeddings.models[0], Phase.verify.rawValue)
        let expected = [TensorNames.inputIds: [1, w], TensorNames.depths: [w], TensorNames.treeMask: [1, 1, w, w]]
        for (name, shape) in expected.sorted(by: { $0.key < $1.key }) where first.input(name)?.shape != shape {
            throw ManifestError.inconsistent("\(embeddings.models[0]) (verify) must take \(name) of shape \(shape) "
                + "for verify_window \(w), not \(first.input(name).map { "\($0.shape)" } ?? "nothing")")
        }
    }

    /// Where the prefill window decodes: each bucket's prefill function of the first embeddings part
    /// takes the window's `input_ids` (1, S) and each row's `positions` (S,), int32, and every mask a
    /// chunk's prefill function reads that the embeddings do not output is one the host makes
    /// (`HostMasks`): "mask" (1, 1, S, T + S) over the function's context bucket T, "sliding_mask"
    /// over the ring's slots where there is one (R + S), fp16 or fp32.
    private func checkHostWindows() throws {
        let s = prefillLength
        for bucket in buckets.sizes {
            let name = buckets.functionName(.prefill, bucket: bucket)
            let first = try function(embeddings.models[0], name)
            let expected = [TensorNames.inputIds: [1, s], TensorNames.positions: [s]]
            for (input, shape) in expected.sorted(by: { $0.key < $1.key })
            where first.input(input)?.shape != shape || first.input(input)?.dtype != "int32" {
                throw ManifestError.inconsistent("\(embeddings.models[0]) (\(name)) must take \(input) of shape \(shape), int32, "
                    + "where the prefill window decodes (decode_function \"prefill\"), not "
                    + (first.input(input).map { "\($0.dtype) \($0.shape)" } ?? "nothing"))
            }
            let made = Set(first.outputs.map(\.name))
            for chunk in chunks {
                let f = try function(chunk.model, name)
                for spec in f.inputs where TensorNames.hostMasks.contains(spec.name) && !made.contains(spec.name) {
                    let columns = spec.name == TensorNames.slidingMask && cache.ringLength > 0 ? cache.ringLength : bucket
                    guard spec.shape == [1, 1, s, columns + s], ["float16", "float32"].contains(spec.dtype) else {
                        throw ManifestError.inconsistent("\(chunk.model) (\(name)) reads \(spec.name) of \(spec.dtype) \(spec.shape), but "
                            + "the host makes it float [1, 1, \(s), \(columns + s)] (\(columns) cache columns and the window's \(s))")
                    }
                }
            }
        }
    }

    /// The chunks' and cache updates' full-cache tensors and the sliding layers' ring tensors.
    private static let fullCacheTensors: Set<String> = ["k_cache", "v_cache", "k_cache_out", "v_cache_out"]
    private static let ringTensors: Set<String> = ["k_ring", "v_ring", "k_ring_out", "v_ring_out"]
    /// The chunks' conv layers' tensors: their state, the cascade's per-branch states, a window's values.
    private static let convTensors: Set<String> = [TensorNames.convState, TensorNames.convBranches, TensorNames.convNew]
    /// The chunks' linear-attention layers' tensors: their recurrent state, the cascade's per-branch
    /// states, the state after a window (or each branch's after its token).
    private static let deltaTensors: Set<String> = [TensorNames.deltaState, TensorNames.deltaBranches, TensorNames.deltaNew]

    /// Every K/V cache tensor holds its function's context bucket of positions (a state: the whole
    /// context) of `cache.channels` channels, as the packages were built for; every ring tensor the
    /// `cache.sliding.length` slots of the ring, in every bucket.
    private func checkCacheShapes() throws {
        let (full, ring) = (Self.fullCacheTensors, Self.ringTensors)
        let slots = cache.ringLength
        for (model, entry) in models.sorted(by: { $0.key < $1.key }) {
            for (name, f) in entry.functions.sorted(by: { $0.key < $1.key }) {
                let bucket = ContextBuckets.bucket(ofFunction: name, contextLength: contextLength)
                for (kind, tensors) in [("inputs", f.inputs), ("outputs", f.outputs), ("states", f.states)] {
                    for (i, t) in tensors.enumerated() where t.shape.count == 4 {
                        let field = "models.\(model).functions.\(name).\(kind)[\(i)] \"\(t.name)\" of \(f.file)"
                        if Self.convTensors.contains(t.name) {
                            try checkConvShape(t, field: field)
                            continue
                        }
                        if Self.deltaTensors.contains(t.name) {
                            try checkDeltaShape(t, field: field)
                            continue
                        }
                        guard full.union(ring).contains(t.name) else { continue }
                        guard !ring.contains(t.name) || slots > 0 else {
                            throw ManifestError.inconsistent("\(field) is a sliding layers' ring buffer, but cache.sliding "
                                + "names none")
                        }
                        let inRing = ring.contains(t.name)
                        let want = [t.shape[0], inRing ? cache.ringChannels : cache.channels, 1,
                                    inRing ? slots : kind == "states" ? cacheLength : bucket]
                        let given = inRing ? "cache.sliding.length \(slots) and channels \(cache.ringChannels)"
                            : "context_length \(contextLength)" + (kind == "states" && cacheLength != contextLength
                                ? " (states of \(cacheLength) columns, room for a prefill window's padding)" : "")
                                + " and cache.channels \(cache.channels)"
                        guard t.shape == want else {
                            throw ManifestError.inconsistent("\(field) has shape \(t.shape), but \(given) give \(want)")
                        }
                    }
                }
            }
        }
    }

    /// A conv tensor holds `cache.conv`'s channels: a state of `width` values per layer
    /// (`conv_state`) or per layer and cascade branch (`conv_branches`), or a window's values (`conv_new`).
    private func checkConvShape(_ t: TensorSpec, field: String) throws {
        guard let conv = cache.conv else {
            throw ManifestError.inconsistent("\(field) is a conv layers' tensor, but cache.conv names none")
        }
        let want = [t.shape[0], conv.channels, t.name == TensorNames.convBranches ? branchWidth ?? 0 : 1,
                    t.name == TensorNames.convNew ? t.shape[3] : conv.width]
        guard t.shape == want else {
            throw ManifestError.inconsistent("\(field) has shape \(t.shape), but cache.conv (channels \(conv.channels), width "
                + "\(conv.width)) and branch_width \(branchWidth ?? 0) give \(want)")
        }
    }

    /// A linear-attention tensor holds `cache.delta`'s state per layer (and, in the cascade, per
    /// layer and branch): `(rows, heads * key_dim, 1, value_dim)`; its rows are checked per chunk.
    private func checkDeltaShape(_ t: TensorSpec, field: String) throws {
        guard let delta = cache.delta else {
            throw ManifestError.inconsistent("\(field) is a linear-attention layers' tensor, but cache.delta names none")
        }
        let want = [t.shape[0], delta.channels, 1, delta.valueDim]
        guard t.shape == want else {
            throw ManifestError.inconsistent("\(field) has shape \(t.shape), but cache.delta (heads \(delta.heads), key_dim "
                + "\(delta.keyDim), value_dim \(delta.valueDim)) gives \(want)")
        }
    }

    /// Tokens a rewind may forget and still keep the rest: none where the export has conv or
    /// linear-attention layers (their states hold only the last tokens' values, or all of them
    /// folded in, so any rewind starts again from position 0), `ringRewindLimit` where it has a
    /// ring buffer, and any number (nil) otherwise.
    public var rewindLimit: Int? { cache.conv != nil || cache.delta != nil ? 0 : ringRewindLimit }

    /// Tokens a rewind may forget and still serve the ones kept, where the export has a ring buffer
    /// (nil: any): the slots of forgotten positions, and of a window's padding after them, must lie
    /// outside every later query's window. Rewinding further must start again from position 0.
    public var ringRewindLimit: Int? {
        guard let sliding = cache.sliding, let window = config.slidingWindow else { return nil }
        return sliding.length - window - prefillLength + 2
    }

    /// `cache.sliding`: its layers are the config's sliding layers, it holds a window and a prefill
    /// window's padding (fewer slots would let a padded window overwrite keys a later query sees),
    /// and some chunk function reads it.
    private func checkRing() throws {
        guard let sliding = cache.sliding else { return }
        guard sliding.length > 0, !sliding.layers.isEmpty else {
            throw ManifestError.inconsistent("cache.sliding must name a positive length and at least one layer, not "
                + "length \(sliding.length) and layers \(sliding.layers)")
        }
        let keeping = config.slidingLayers.filter { !config.sharesKV($0) }
        guard Set(sliding.layers) == Set(keeping), Set(sliding.layers).count == sliding.layers.count else {
            throw ManifestError.inconsistent("cache.sliding.layers \(sliding.layers) are not config.sliding_layers "
                + "\(config.slidingLayers) less the KV-shared ones, the layers that attend within the window and keep K/V")
        }
        guard sliding.channels ?? 1 > 0 else {
            throw ManifestError.inconsistent("cache.sliding.channels must be positive, not \(sliding.channels ?? 0)")
        }
        guard let window = config.slidingWindow, window > 0 else {
            throw ManifestError.inconsistent("cache.sliding names a ring buffer, but config.sliding_window is missing")
        }
        guard sliding.length >= window + prefillLength - 1 else {
            throw ManifestError.inconsistent("cache.sliding.length \(sliding.length) is shorter than sliding_window \(window) "
                + "plus prefill_length \(prefillLength) less one: a padded window would overwrite keys a later query sees")
        }
        guard someChunkReads(TensorNames.kRing) else {
            throw ManifestError.inconsistent("cache.sliding names a ring buffer of \(sliding.length) positions, but no chunk "
                + "function reads one (\(TensorNames.kRing))")
        }
    }

    /// `cache.conv`: its layers are the config's conv layers, its kernel the config's, its width
    /// holds kernel - 1 values, and some chunk function reads the state; a config with conv layers
    /// has one.
    private func checkConv() throws {
        guard let conv = cache.conv else {
            guard config.convLayers.isEmpty else {
                throw ManifestError.inconsistent("config.conv_layers \(config.convLayers) keep a conv state, but cache.conv is missing")
            }
            return
        }
        let convolving = Set(config.convLayers + config.deltaLayers)
        guard !conv.layers.isEmpty, Set(conv.layers) == convolving, Set(conv.layers).count == conv.layers.count else {
            throw ManifestError.inconsistent("cache.conv.layers \(conv.layers) are not config.conv_layers \(config.convLayers)"
                + (config.deltaLayers.isEmpty ? "" : " and config.delta_layers \(config.deltaLayers)") + ", the layers that convolve")
        }
        guard conv.kernel >= 2, conv.kernel == config.convKernel ?? conv.kernel, conv.channels > 0, conv.width >= conv.kernel - 1 else {
            throw ManifestError.inconsistent("cache.conv must keep the kernel - 1 values of config.conv_kernel "
                + "\(config.convKernel.map(String.init) ?? "(missing)") in width columns, not kernel \(conv.kernel), width "
                + "\(conv.width) and channels \(conv.channels)")
        }
        guard someChunkReads(TensorNames.convState) else {
            throw ManifestError.inconsistent("cache.conv names the state of conv layers \(conv.layers), but no chunk function "
                + "reads one (\(TensorNames.convState))")
        }
    }

    /// `cache.delta`: its layers are the config's linear-attention layers (each also among the conv
    /// layers), its heads and widths the config's, and some chunk function reads the state; a config
    /// with linear-attention layers has one.
    private func checkDelta() throws {
        guard let delta = cache.delta else {
            guard config.deltaLayers.isEmpty else {
                throw ManifestError.inconsistent("config.delta_layers \(config.deltaLayers) keep a recurrent state, but "
                    + "cache.delta is missing")
            }
            return
        }
        guard !delta.layers.isEmpty, Set(delta.layers) == Set(config.deltaLayers), Set(delta.layers).count == delta.layers.count else {
            throw ManifestError.inconsistent("cache.delta.layers \(delta.layers) are not config.delta_layers "
                + "\(config.deltaLayers), the linear-attention layers")
        }
        guard delta.heads > 0, delta.keyDim > 0, delta.valueDim > 0, delta.heads == config.deltaValueHeads ?? delta.heads,
              delta.keyDim == config.deltaKeyDim ?? delta.keyDim, delta.valueDim == config.deltaValueDim ?? delta.valueDim else {
            throw ManifestError.inconsistent("cache.delta must hold config.delta_value_heads "
                + "\(config.deltaValueHeads.map(String.init) ?? "(missing)") states of config.delta_key_dim "
                + "\(config.deltaKeyDim.map(String.init) ?? "(missing)") x config.delta_value_dim "
                + "\(config.deltaValueDim.map(String.init) ?? "(missing)"), not heads \(delta.heads), key_dim \(delta.keyDim) "
                + "and value_dim \(delta.valueDim)")
        }
        guard Set(delta.layers).isSubset(of: cache.conv?.layers ?? []) else {
            throw ManifestError.inconsistent("cache.delta.layers \(delta.layers) must each keep a conv state too, but "
                + "cache.conv.layers are \(cache.conv?.layers ?? [])")
        }
        guard someChunkReads(TensorNames.deltaState) else {
            throw ManifestError.inconsistent("cache.delta names the state of linear-attention layers \(delta.layers), but no "
                + "chunk function reads one (\(TensorNames.deltaState))")
        }
    }

    /// `config.kv_shared_layers`: fewer than the layers, each KV-shared layer with an earlier layer
    /// of its type to read K/V from, and the caches inputs (a chunk reads its producers' rows from
    /// the host, which cannot hand over a Core ML state's).
    private func checkKVSharing() throws {
        let shared = config.kvSharedLayers
        guard shared > 0 else {
            guard shared == 0 else { throw ManifestError.inconsistent("config.kv_shared_layers must be >= 0, not \(shared)") }
            return
        }
        let orphan = (0..<config.numHiddenLayers).first { config.sharesKV($0) && config.kvProducer($0) == nil }
        guard shared < config.numHiddenLayers, orphan == nil else {
            throw ManifestError.inconsistent("config.kv_shared_layers \(shared): KV-shared layer \(orphan ?? 0) of "
                + "\(config.numHiddenLayers) has no earlier layer of its type to take K/V from")
        }
        guard !cache.inStates else {
            throw ManifestError.inconsistent("config.kv_shared_layers \(shared) with cache.kind \"state\": KV-shared layers read "
                + "their producers' caches as inputs; re-export with --kv-cache inputs")
        }
    }

    /// Whether a function of some chunk reads `tensor`, as an input or a state.
    private func someChunkReads(_ tensor: String) -> Bool {
        chunks.contains { chunk in
            models[chunk.model]?.functions.values.contains { f in (f.inputs + f.states).contains { $0.name == tensor } } ?? false
        }
    }

    /// Per chunk, its layers in the full cache, in the ring (`cache.sliding.layers`), with a conv
    /// state (`cache.conv.layers`) and with a recurrent state (`cache.delta.layers`, among the conv
    /// ones), as counts; KV-shared layers keep none of them.
    func cacheRows(of chunk: Chunk) -> (full: Int, ring: Int, conv: Int, delta: Int) {
        let ring = chunk.layers.filter { cache.sliding?.layers.contains($0) ?? false }.count
        let conv = chunk.layers.filter { cache.conv?.layers.contains($0) ?? false }.count
        let delta = chunk.layers.filter { cache.delta?.layers.contains($0) ?? false }.count
        let shared = chunk.layers.filter { config.sharesKV($0) }.count
        return (chunk.layers.count - ring - conv - shared, ring, conv, delta)
    }

    /// Whether `chunk` keeps K/V (in the full cache or the ring): a chunk of conv layers or KV-shared
    /// layers only keeps none, and has no cache update.
    func keepsKV(_ chunk: Chunk) -> Bool {
        let rows = cacheRows(of: chunk)
        return rows.full + rows.ring > 0
    }

    /// Each chunk's functions and cache updates hold as many layers in `k_cache`/`v_cache` as the
    /// chunk has attention layers outside the ring, in `k_ring`/`v_ring` as it has in it, and in
    /// its conv tensors as it has conv layers; its decode function reads each pair, and the conv
    /// state, exactly where it has such layers.
    private func checkChunkCacheRows() throws {
        let (full, ring) = (Self.fullCacheTensors, Self.ringTensors)
        for chunk in chunks {
            let rows = cacheRows(of: chunk)
            var functions = (models[chunk.model]?.functions ?? [:]).map { ("\(chunk.model) (\($0.key))", $0.value) }
            functions += try chunk.cacheUpdate.map { ("cache_update \($0.value) of \(chunk.model)", try function("cache_update", $0.value)) }
            for (label, f) in functions.sorted(by: { $0.0 < $1.0 }) {
                for t in f.inputs + f.outputs + f.states where t.shape.count == 4 && Self.convTensors.contains(t.name) {
                    guard t.shape[0] == rows.conv else {
                        throw ManifestError.inconsistent("\(label) has \(t.name) of \(t.shape[0]) layers, but \(rows.conv) of the "
                            + "chunk's layers \(chunk.layers) convolve (cache.conv.layers \(cache.conv?.layers ?? []))")
                    }
                }
                // the cascade's recurrent states are layer-major copies, one per layer and branch
                let perBranch = f.inputs.contains { $0.name == TensorNames.deltaBranches } ? branchWidth ?? 0 : 1
                for t in f.inputs + f.outputs + f.states where t.shape.count == 4 && Self.deltaTensors.contains(t.name) {
                    guard t.shape[0] == rows.delta * perBranch else {
                        throw ManifestError.inconsistent("\(label) has \(t.name) of \(t.shape[0]) rows, but \(rows.delta) of the "
                            + "chunk's layers \(chunk.layers) are linear-attention layers (cache.delta.layers "
                            + "\(cache.delta?.layers ?? []))" + (perBranch == 1 ? "" : ", times branch_width \(perBranch)"))
                    }
                }
                for t in f.inputs + f.outputs + f.states where t.shape.count == 4 && full.union(ring).contains(t.name) {
                    let want = ring.contains(t.name) ? rows.ring : rows.full
                    guard t.shape[0] == want else {
                        throw ManifestError.inconsistent("\(label) has \(t.name) of \(t.shape[0]) layers, but \(want) of the "
                            + "chunk's layers \(chunk.layers) keep their K/V there (cache.sliding.layers "
                            + "\(cache.sliding?.layers ?? []), cache.conv.layers \(cache.conv?.layers ?? []))")
                    }
                }
            }
            let decode = try function(chunk.model, decodePhase.rawValue)
            let held = Set((decode.inputs + decode.states).map(\.name))
            for (pair, count) in [([TensorNames.kCache, TensorNames.vCache], rows.full), ([TensorNames.kRing, TensorNames.vRing], rows.ring),
                                  ([TensorNames.convState], rows.conv), ([TensorNames.deltaState], rows.delta)] {
                for name in pair where held.contains(name) != (count > 0) {
                    throw ManifestError.inconsistent("\(chunk.model) (\(decodePhase.rawValue)) " + (count > 0 ? "does not read" : "reads")
                        + " \(name), but \(count) of its layers \(chunk.layers) keep their K/V there (cache.sliding.layers "
                        + "\(cache.sliding?.layers ?? []))")
                }
            }
        }
    }

    /// A section's model list names at least one model, each once.
    private static func checkModelList(_ section: String, _ models: [String]) throws {
        guard !models.isEmpty else { throw ManifestError.inconsistent("\(section) models is empty") }
        var seen = Set<String>()
        for name in models where !seen.insert(name).inserted {
            throw ManifestError.inconsistent("\(section) models \(models) name \"\(name)\" twice")
        }
    }

    /// The embeddings' vocab_ranges: one `[start, end)` per model, non-empty, each starting where the
    /// previous ends, from 0 to vocab_size.
    private func checkVocabRanges() throws {
        let ranges = embeddings.vocabRanges
        guard ranges.count == embeddings.models.count else {
            throw ManifestError.inconsistent("embeddings has \(embeddings.models.count) models \(embeddings.models) "
                + "but \(ranges.count) vocab_ranges \(ranges)")
        }
        var next = 0
        for (model, range) in zip(embeddings.models, ranges) {
            guard range.count == 2, range[0] < range[1] else {
                throw ManifestError.inconsistent("embeddings vocab_ranges entry \(range) of \(model) is not a non-empty [start, end) pair")
            }
            guard range[0] == next else {
                throw ManifestError.inconsistent("embeddings vocab_ranges \(ranges) are not consecutive from 0: "
                    + "\(model) starts at \(range[0]), not at \(next)")
            }
            next = range[1]
        }
        guard next == config.vocabSize else {
            throw ManifestError.inconsistent("embeddings vocab_ranges \(ranges) end at \(next), not at vocab_size \(config.vocabSize)")
        }
    }

    /// The logits outputs of function `phase` of all lm_head models (or of the chunk the head is
    /// folded into) are logits_0..logits_{n-1}, each once, with n = vocab_splits.count and
    /// `vocab_splits[j]` rows in `logits_j`.
    private func checkLogits(_ phase: String) throws {
        let prefix = TensorNames.logitsPrefix
        let n = lmHead.vocabSplits.count
        let role = lmHead.foldedInto == nil ? "lm_head model" : "chunk"
        var producer: [Int: String] = [:]
        for model in lmHead.logitsModels {
            for spec in try function(model, phase).outputs where spec.name.hasPrefix(prefix) {
                let suffix = spec.name.dropFirst(prefix.count)
                guard let j = Int(suffix), String(j) == suffix, (0..<n).contains(j) else {
                    throw ManifestError.inconsistent("\(role) \(model) (\(phase)) outputs \(spec.name), which is not one of "
                        + "\(prefix)0..\(prefix)\(n - 1) (vocab_splits has \(n) entries)")
                }
                if let other = producer[j] {
                    throw ManifestError.inconsistent(other == model ? "\(role) \(model) (\(phase)) outputs \(spec.name) twice"
                        : "lm_head models \(other) and \(model) (\(phase)) both output \(spec.name)")
                }
                guard spec.shape.count > 1, spec.shape[1] == lmHead.vocabSplits[j] else {
                    throw ManifestError.inconsistent("\(role) \(model) (\(phase)) outputs \(spec.name) of shape \(spec.shape), "
                        + "but vocab_splits[\(j)] is \(lmHead.vocabSplits[j])")
                }
                producer[j] = model
            }
        }
        let missing = (0..<n).filter { producer[$0] == nil }.map { "\(prefix)\($0)" }
        if let folded = lmHead.foldedInto, !missing.isEmpty {
            throw ManifestError.inconsistent("\(folded), which carries the LM head (lm_head folded_into), does not output "
                + "\(missing.joined(separator: ", ")) in \(phase), but vocab_splits has \(n) entries")
        }
        guard missing.isEmpty else {
            throw ManifestError.inconsistent("no lm_head model (\(lmHead.models.joined(separator: ", "))) outputs "
                + "\(missing.joined(separator: ", ")) in \(phase), but vocab_splits has \(n) entries")
        }
    }

    private static func describe(_ error: Error) -> String {
        switch error {
        case let DecodingError.keyNotFound(key, context):
            return "missing field \(path(context.codingPath + [key]))"
        case let DecodingError.typeMismatch(_, context), let DecodingError.valueNotFound(_, context):
            return "field \(path(context.codingPath)) has the wrong type (\(context.debugDescription))"
        case let DecodingError.dataCorrupted(context):
            return context.debugDescription
        default:
            return "\(error)"
        }
    }

    /// `models.chunk_0.functions.decode.inputs[4].shape`, as the Python reader names fields.
    private static func path(_ keys: [CodingKey]) -> String {
        keys.reduce(into: "") { out, key in
            if let i = key.intValue, key.stringValue != String(i) {  // a list index ("Index 4"), not a numeric key
                out += "[\(i)]"
            } else {
                out += out.isEmpty ? key.stringValue : ".\(key.stringValue)"
            }
        }
    }

    private static func describeKind(_ value: Any) -> String {
        switch value {
        case is NSNull: return "null"
        case is [Any]: return "a list"
        case is String: return "a string"
        default: return "a number"
        }
    }
}
