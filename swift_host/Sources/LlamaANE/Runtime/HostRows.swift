/// A 4-D tensor's storage: its first element, shape and strides (in elements). Element (a, b, c, d)
/// lies at `a * strides[0] + b * strides[1] + c * strides[2] + d * strides[3]`: an IOSurface-backed
/// array pads its rows, so the strides are the storage's own, not the shape's.
public struct StridedTensor<T> {
    public let base: UnsafeMutablePointer<T>
    public let shape: [Int]
    public let strides: [Int]

    public init(base: UnsafeMutablePointer<T>, shape: [Int], strides: [Int]) {
        self.base = base
        self.shape = shape
        self.strides = strides
    }

    func at(_ a: Int, _ b: Int, _ c: Int, _ d: Int) -> UnsafeMutablePointer<T> {
        base + a * strides[0] + b * strides[1] + c * strides[2] + d * strides[3]
    }
}

/// Rows of a tensor the host holds that it copies into a chunk's input (Gemma 4, docs/manifest.md):
/// rows `rows` of `tensor`, along the axis the input gathers (`TensorSource.gathered`).
public struct HostRows: Equatable, Sendable {
    /// Where the tensor lives.
    public enum Place: Equatable, Sendable {
        /// The embeddings' per-layer inputs of this step (the last embeddings file's).
        case perLayerInputs
        /// Chunk c's prefix cache (k_cache, v_cache, k_ring, v_ring), as it stands before this step's update.
        case cache(chunk: Int)
        /// Chunk c's cascade suffix cache (k_suffix, v_suffix, k_ring_suffix, v_ring_suffix).
        case suffix(chunk: Int)
        /// An output of chunk c in this step (k_new, v_new, k_ring_new, v_ring_new).
        case output(chunk: Int)
    }

    public let place: Place
    public let tensor: String
    public let rows: Range<Int>

    public init(_ place: Place, _ tensor: String, _ rows: Range<Int>) {
        self.place = place
        self.tensor = tensor
        self.rows = rows
    }
}

extension Manifest {
    /// The chunk-local indices of `chunk`'s layers kept in the full cache and in the ring (the
    /// sliding layers, where the export has a ring); conv layers and KV-shared layers keep no K/V.
    func localRows(of chunk: Chunk) -> (full: [Int], ring: [Int]) {
        let ringLayers = Set(cache.sliding?.layers ?? [])
        let convLayers = Set(config.convLayers)
        let ring = chunk.layers.indices.filter { ringLayers.contains(chunk.layers[$0]) }
        let full = chunk.layers.indices.filter { i in
            let n = chunk.layers[i]
            return !ringLayers.contains(n) && !convLayers.contains(n) && !config.sharesKV(n)
        }
        return (full, ring)
    }

    /// The cascade's suffix pairs of `chunk`: (key, chunk-local rows, kv heads per layer). Key "k"
    /// names k_suffix/v_suffix and the step's k_new/v_new, "k_ring" k_ring_suffix/v_ring_suffix and
    /// k_ring_new/v_ring_new: one pair of every layer with K/V, but where the global layers are wider
    /// (`ModelConfig.wideGlobal`) the global layers' pair, then the ring's.
    func suffixGroups(of chunk: Chunk) -> [(key: String, rows: [Int], kvHeads: Int)] {
        let (full, ring) = localRows(of: chunk)
        guard config.wideGlobal else {
            let rows = (full + ring).sorted()
            return rows.isEmpty ? [] : [("k", rows, config.numKeyValueHeads)]
        }
        return [("k", full, config.globalKVHeads), ("k_ring", ring, config.numKeyValueHeads)].filter { !$0.rows.isEmpty }
    }

    /// What chunk `index` reads from the host in `phase` beyond the embeddings' outputs and its own
    /// caches, by input name: its layers' rows of the per-layer inputs (`per_layer_input`), and its
    /// KV-shared layers' producers' K/V where they live in other chunks (`shared_k_cache`,
    /// `shared_k_ring`, `shared_k_new`, `shared_k_ring_new`, in the cascade `shared_k_suffix`,
    /// `shared_k_ring_suffix`, and the same of V): each producer's rows of its chunk's cache, of that
    /// chunk's K/V of this step and of its suffix caches, producers in layer order, as the Python
    /// runtime's `Pipeline.shared_inputs` gathers them.
    func hostRows(chunk index: Int, phase: Phase) -> [String: [HostRows]] {
        var out: [String: [HostRows]] = [:]
        let layers = chunks[index].layers
        let p = config.perLayerInputSize
        if p > 0 {
            var ranges: [Range<Int>] = []
            for n in layers {
                let next = n * p..<(n + 1) * p
                if let last = ranges.last, last.upperBound == next.lowerBound {
                    ranges[ranges.count - 1] = last.lowerBound..<next.upperBound
                } else {
                    ranges.append(next)
                }
            }
            out[TensorNames.perLayerInput] = ranges.map { HostRows(.perLayerInputs, TensorNames.perLayerInputs, $0) }
        }
        let home = Dictionary(uniqueKeysWithValues: chunks.enumerated().flatMap { c, chunk in
            chunk.layers.enumerated().map { j, n in (n, (chunk: c, local: j)) }
        })
        let ring = cache.sliding != nil
        let producers = Set(layers.filter(config.sharesKV).compactMap(config.kvProducer)).subtracting(layers).sorted()
        for inRing in [false, true] {
            for producer in producers where (ring && config.slides(producer)) == inRing {
                guard let (c, j) = home[producer] else { continue }
                let (full, ringRows) = localRows(of: chunks[c])
                let key = full.contains(j) ? "k" : "k_ring"
                let row = full.firstIndex(of: j) ?? ringRows.firstIndex(of: j) ?? 0
                var newKey = key, newRow = row, heads = 1
                if phase == .decodeBranches, let group = suffixGroups(of: chunks[c]).first(where: { $0.rows.contains(j) }) {
                    newKey = group.key
                    newRow = group.rows.firstIndex(of: j) ?? 0
                    heads = group.kvHeads
                }
                let kind = inRing ? "ring" : "cache", ringPart = inRing ? "_ring" : ""
                for kv in ["k", "v"] {
                    let cacheName = kv + key.dropFirst() + (key == "k" ? "_cache" : "")
                    out["shared_\(kv)_\(kind)", default: []].append(HostRows(.cache(chunk: c), cacheName, row..<row + 1))
                    out["shared_\(kv)\(ringPart)_new", default: []].append(
                        HostRows(.output(chunk: c), kv + newKey.dropFirst() + "_new", newRow..<newRow + 1))
                    if phase == .decodeBranches {
                        out["shared_\(kv)\(ringPart)_suffix", default: []].append(
                            HostRows(.suffix(chunk: c), kv + newKey.dropFirst() + "_suffix", newRow * heads..<(newRow + 1) * heads))
                    }
                }
            }
        }
        return out
    }
}

/// Copies rows of host tensors into a chunk's input (`HostRows`): the per-layer inputs' rows of the
/// chunk's layers, the KV-shared layers' producers' K/V rows.
public enum RowGather {
    /// `target`'s slices along `axis` become, in order, slices `rows` of each source. Along the other
    /// axes the target's extent is copied: a source holds the same, or along the last axis more (a
    /// context bucket's function reads the first positions of a whole cache).
    public static func copy<T>(into target: StridedTensor<T>, axis: Int, from sources: [(tensor: StridedTensor<T>, rows: Range<Int>)]) throws {
        let total = sources.reduce(0) { $0 + $1.rows.count }
        guard target.shape.count == 4, target.strides.count == 4, (0..<3).contains(axis), total == target.shape[axis] else {
            throw ManifestError.inconsistent("\(total) gathered rows do not fill a tensor of shape \(target.shape) along axis \(axis)")
        }
        let shape = target.shape
        var next = 0
        for (source, rows) in sources {
            let fits = source.shape.count == 4 && source.strides.count == 4 && rows.lowerBound >= 0
                && rows.upperBound <= source.shape[axis] && source.shape[3] >= shape[3]
                && (0..<3).allSatisfy { $0 == axis || source.shape[$0] == shape[$0] }
            guard fits else {
                throw ManifestError.inconsistent("rows \(rows) of a tensor of shape \(source.shape) cannot fill a tensor of "
                    + "shape \(shape) along axis \(axis)")
            }
            for r in rows {
                var index = [0, 0, 0, 0], from = [0, 0, 0, 0]
                index[axis] = next
                from[axis] = r
                let outer = (0..<3).filter { $0 != axis }
                for a in 0..<shape[outer[0]] {
                    for b in 0..<shape[outer[1]] {
                        index[outer[0]] = a; index[outer[1]] = b
                        from[outer[0]] = a; from[outer[1]] = b
                        let t = target.at(index[0], index[1], index[2], 0), s = source.at(from[0], from[1], from[2], 0)
                        if target.strides[3] == 1 && source.strides[3] == 1 {
                            t.update(from: s, count: shape[3])
                        } else {
                            for d in 0..<shape[3] { t[d * target.strides[3]] = s[d * source.strides[3]] }
                        }
                    }
                }
                next += 1
            }
        }
    }
}
