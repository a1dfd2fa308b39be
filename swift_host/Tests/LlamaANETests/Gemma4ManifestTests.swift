import Foundation
import XCTest
@testable import LlamaANE

/// A Gemma 4 export with input caches (`export_gemma4`, written by tests/swift_fixtures.py): per-layer
/// inputs from an embedding table cut into three files, global layers wider than the sliding ones
/// (their own cache, ring and cascade suffix pair), and KV-shared layers: chunk_1 keeps no K/V and
/// reads its producers' rows from chunk_0. The host must hand every chunk the rows Python's pipeline
/// hands it (`families.json` "host_rows", recorded with every output row tagged), in every phase;
/// FamilyExportTests replays its greedy generation. What the host cannot run is refused by name.
final class Gemma4ManifestTests: XCTestCase {
    static let name = "export_gemma4"

    func testItLoadsWithGemma4sConfigAndWiresEveryPhase() throws {
        let manifest = try Manifest.load(from: Fixtures.url(Self.name))
        let config = manifest.config
        XCTAssertEqual(config.modelType, "gemma4_text")
        XCTAssertEqual(config.perLayerInputSize, 8)
        XCTAssertEqual(config.kvSharedLayers, 2)
        XCTAssertTrue(config.wideGlobal)
        XCTAssertEqual((0..<4).map(config.sharesKV), [false, false, true, true])
        XCTAssertEqual([2, 3].map(config.kvProducer), [0, 1], "the last earlier layer of each one's type")
        XCTAssertEqual(manifest.cache.sliding?.layers, [0], "the KV-shared sliding layer keeps no ring")
        XCTAssertEqual(manifest.embeddings.models.count, 3, "the per-layer table cut into three files")
        XCTAssertFalse(manifest.keepsKV(manifest.chunks[1]), "chunk_1's layers are all KV-shared")
        XCTAssertEqual(manifest.chunks[1].cacheUpdate, [:])

        let wiring = try PipelineWiring(manifest: manifest)
        XCTAssertEqual(PipelineWiring.phases(of: manifest), [.prefill, .decode, .decodeBranches, .verify])
        for phase in PipelineWiring.phases(of: manifest) {
            for part in try XCTUnwrap(wiring.embeddingInputs[phase]) {
                XCTAssertEqual(part["per_layer_inputs"], .perLayerInputs, "\(phase): handed on as the hidden states are")
            }
            XCTAssertEqual(wiring.updatedState[phase]?[1], [], "\(phase): chunk_1 has no cache to update")
            let own = try XCTUnwrap(wiring.chunkInputs[phase]?[0])
            XCTAssertFalse(own.keys.contains { $0.hasPrefix("shared_") }, "chunk_0 holds its own producers")
        }
        let suffixes = try XCTUnwrap(wiring.updatedState[.decodeBranches]?[0]).map(\.name)
        XCTAssertEqual(Set(suffixes), ["k_suffix", "v_suffix", "k_ring_suffix", "v_ring_suffix"], "a suffix pair per kind")
    }

    /// Python's rows: phase -> chunk model -> input -> [[model, tensor, row]].
    static func pythonRows() throws -> [String: [String: [String: [[String]]]]] {
        let root = try JSONValue.parse(Data(contentsOf: Fixtures.url("families.json")))
        let rows = try XCTUnwrap(root[name]?["host_rows"]?.objectValue, "families.json has no \(name).host_rows")
        func object<T>(_ v: JSONValue, _ f: (JSONValue) -> T) -> [String: T] {
            Dictionary(uniqueKeysWithValues: (v.objectValue ?? []).map { ($0.0, f($0.1)) })
        }
        func names(_ list: JSONValue) -> [[String]] {
            (list.arrayValue ?? []).map { row in
                (row.arrayValue ?? []).map { (part: JSONValue) -> String in part.stringValue ?? String(part.intValue ?? -1) }
            }
        }
        func inputs(_ chunk: JSONValue) -> [String: [[String]]] { object(chunk, names) }
        func phase(_ v: JSONValue) -> [String: [String: [[String]]]] { object(v, inputs) }
        return Dictionary(uniqueKeysWithValues: rows.map { ($0.0, phase($0.1)) })
    }

    /// `rows` as Python names them: the tensor's model and name, one row a line.
    static func named(_ rows: [HostRows], _ manifest: Manifest) -> [[String]] {
        rows.flatMap { block -> [[String]] in
            let (model, tensor): (String, String)
            switch block.place {
            case .perLayerInputs:
                let last = manifest.embeddings.models.last ?? ""
                (model, tensor) = (last, manifest.embeddings.models.count > 1 ? "per_layer_inputs_out" : block.tensor)
            case let .cache(c), let .suffix(c), let .output(c):
                (model, tensor) = (manifest.chunks[c].model, block.tensor)
            }
            return block.rows.map { [model, tensor, String($0)] }
        }
    }

    func testEveryChunkGetsTheRowsPythonsPipelineGathers() throws {
        let manifest = try Manifest.load(from: Fixtures.url(Self.name))
        let wiring = try PipelineWiring(manifest: manifest)
        let python = try Self.pythonRows()
        XCTAssertEqual(Set(python.keys), Set(PipelineWiring.phases(of: manifest).map(\.rawValue)))
        for phase in PipelineWiring.phases(of: manifest) {
            for (i, chunk) in manifest.chunks.enumerated() {
                var swift: [String: [[String]]] = [:]
                for (name, source) in try XCTUnwrap(wiring.chunkInputs[phase]?[i]) {
                    if case let .gathered(axis, rows) = source {
                        XCTAssertEqual(axis, name == "per_layer_input" ? 1 : 0, name)
                        swift[name] = Self.named(rows, manifest)
                    }
                }
                XCTAssertEqual(swift, python[phase.rawValue]?[chunk.model] ?? [:], "\(chunk.model) (\(phase.rawValue))")
            }
        }
        let shared = try XCTUnwrap(wiring.chunkInputs[.decodeBranches]?[1])
        XCTAssertEqual(shared.keys.filter { $0.hasPrefix("shared_") }.count, 12, "cache, ring, new and suffix rows of K and V")
    }

    /// The rows copied through padded strides: every source tensor of the export's shapes (as the
    /// wiring names them) tagged row by row, each chunk's gathered inputs filled by `RowGather`, and
    /// the tags read back must be the rows Python gathers.
    func testTheCopiedRowsAreTheOnesPythonGathers() throws {
        let manifest = try Manifest.load(from: Fixtures.url(Self.name))
        let wiring = try PipelineWiring(manifest: manifest)
        let python = try Self.pythonRows()
        for phase in PipelineWiring.phases(of: manifest) {
            let p = phase.rawValue
            var tags: [[String]] = []
            var storage: [String: TaggedTensor] = [:]
            func source(_ block: HostRows) throws -> TaggedTensor {
                let name = Self.named([HostRows(block.place, block.tensor, 0..<1)], manifest)[0].dropLast().joined(separator: ".")
                if let made = storage[name] { return made }
                let spec: Manifest.TensorSpec?
                switch block.place {
                case .perLayerInputs:
                    spec = try manifest.function(manifest.embeddings.models[0], p).output("per_layer_inputs")
                case let .cache(c), let .suffix(c):
                    spec = try manifest.function(manifest.chunks[c].model, p).input(block.tensor)
                case let .output(c):
                    spec = try manifest.function(manifest.chunks[c].model, p).output(block.tensor)
                }
                let shape = try XCTUnwrap(spec?.shape)
                let made = TaggedTensor(shape, padding: 3)
                let axis = block.place == .perLayerInputs ? 1 : 0
                let names = Self.named([HostRows(block.place, block.tensor, 0..<shape[axis])], manifest)
                made.tag(axis: axis, first: Float(tags.count + 1))
                tags += names
                storage[name] = made
                return made
            }
            for (i, chunk) in manifest.chunks.enumerated() {
                let f = try manifest.function(chunk.model, p)
                for (name, wired) in try XCTUnwrap(wiring.chunkInputs[phase]?[i]) {
                    guard case let .gathered(axis, rows) = wired else { continue }
                    let target = TaggedTensor(try XCTUnwrap(f.input(name)).shape, padding: 5)
                    let sources = try rows.map { (tensor: try source($0).tensor, rows: $0.rows) }
                    try RowGather.copy(into: target.tensor, axis: axis, from: sources)
                    let read = try target.rows(axis: axis).map { tag -> [String] in
                        let index = try XCTUnwrap(tag, "\(chunk.model) \(name): a row not copied whole")
                        return tags[index - 1]
                    }
                    XCTAssertEqual(read, python[p]?[chunk.model]?[name], "\(chunk.model) (\(p)) \(name)")
                }
            }
        }
    }

    func testRowGatherCopiesABucketsFirstPositionsAndRefusesRowsThatDoNotFit() throws {
        let cache = TaggedTensor([3, 2, 1, 6], padding: 2)
        cache.tag(axis: 0, first: 10)
        for (i, p) in cache.positions().enumerated() { cache[p] += Float(i % 6) / 8 }  // position j adds j/8
        let target = TaggedTensor([2, 2, 1, 4], padding: 1)
        try RowGather.copy(into: target.tensor, axis: 0, from: [(cache.tensor, 2..<3), (cache.tensor, 0..<1)])
        let values = target.positions().map { target[$0] }
        XCTAssertEqual(values, [12, 12.125, 12.25, 12.375, 12, 12.125, 12.25, 12.375,
                                10, 10.125, 10.25, 10.375, 10, 10.125, 10.25, 10.375])
        XCTAssertThrowsError(try RowGather.copy(into: target.tensor, axis: 0, from: [(cache.tensor, 2..<4)]))
        XCTAssertThrowsError(try RowGather.copy(into: target.tensor, axis: 0, from: [(cache.tensor, 0..<1)]))
        let short = TaggedTensor([1, 2, 1, 3], padding: 0)
        XCTAssertThrowsError(try RowGather.copy(into: target.tensor, axis: 0, from: [(short.tensor, 0..<1), (short.tensor, 0..<1)]))
    }

    // MARK: refusals

    func testKVSharedLayersWithStateCachesAreRefusedByName() throws {
        let object = try ManifestEdits.object(Self.name)
        try ManifestEdits.assertRefused(object, { m in
            var cache = try XCTUnwrap(m["cache"] as? [String: Any])
            cache["kind"] = "state"
            m["cache"] = cache
        }, mentioning: ["kv_shared_layers", "--kv-cache inputs"])
    }

    func testKVSharedLayersWithoutAProducerAreRefused() throws {
        try ManifestEdits.assertRefused(try ManifestEdits.object(Self.name), { m in
            var config = try XCTUnwrap(m["config"] as? [String: Any])
            config["kv_shared_layers"] = 3  // layer 1, the only earlier global layer, would be KV-shared too
            m["config"] = config
        }, mentioning: ["kv_shared_layers 3", "layer"])
    }

    func testARingNamingAKVSharedLayerIsRefused() throws {
        try ManifestEdits.assertRefused(try ManifestEdits.object(Self.name), { m in
            try ManifestEdits.setCache(&m, "sliding", "layers", [0, 2])
        }, mentioning: ["cache.sliding.layers", "KV-shared"])
    }

    func testAWrongRingWidthIsRefused() throws {
        try ManifestEdits.assertRefused(try ManifestEdits.object(Self.name), { m in
            try ManifestEdits.setCache(&m, "sliding", "channels", 32)
        }, mentioning: ["k_ring", "channels 32"])
    }

    func testAPerLayerInputTheEmbeddingsDoNotGiveIsRefused() throws {
        var manifest = try Manifest.load(from: Fixtures.url(Self.name))
        manifest.models["embeddings"]?.functions["decode"]?.outputs.removeAll { $0.name == "per_layer_inputs" }
        XCTAssertThrowsError(try PipelineWiring(manifest: manifest)) { error in
            XCTAssertTrue("\(error)".contains("per_layer_inputs"), "\(error)")
        }
    }

    func testAnEmbeddingsFileThatDropsThePerLayerInputsIsRefused() throws {
        var manifest = try Manifest.load(from: Fixtures.url(Self.name))
        manifest.models["embeddings_1"]?.functions["prefill"]?.outputs.removeAll { $0.name == "per_layer_inputs_out" }
        XCTAssertThrowsError(try PipelineWiring(manifest: manifest)) { error in
            XCTAssertTrue("\(error)".contains("embeddings_1 (prefill)") && "\(error)".contains("per_layer_inputs_out"), "\(error)")
        }
    }

    func testASharedInputOfTheWrongSizeOrUnknownNameIsRefused() throws {
        var manifest = try Manifest.load(from: Fixtures.url(Self.name))
        let f = try manifest.function("chunk_1", "decode")
        var inputs = f.inputs
        let k = try XCTUnwrap(inputs.firstIndex { $0.name == "shared_k_cache" })
        inputs[k].shape[0] = 2
        manifest.models["chunk_1"]?.functions["decode"]?.inputs = inputs
        XCTAssertThrowsError(try PipelineWiring(manifest: manifest)) { error in
            XCTAssertTrue("\(error)".contains("shared_k_cache") && "\(error)".contains("1 rows"), "\(error)")
        }
        inputs[k].shape[0] = 1
        inputs[k].name = "shared_k_sinks"
        manifest.models["chunk_1"]?.functions["decode"]?.inputs = inputs
        XCTAssertThrowsError(try PipelineWiring(manifest: manifest)) { error in
            XCTAssertEqual(error as? PipelineError, .unwiredInput(model: "chunk_1 (decode)", input: "shared_k_sinks"))
        }
    }
}

/// A 4-D Float tensor with padded rows (as an IOSurface-backed array pads them), for RowGather tests:
/// each slice along an axis tagged with one number, read back as that number where it is whole.
final class TaggedTensor {
    let shape: [Int]
    let strides: [Int]
    let tensor: StridedTensor<Float>
    private let count: Int

    init(_ shape: [Int], padding: Int) {
        self.shape = shape
        let row = shape[3] + padding
        strides = [shape[1] * shape[2] * row, shape[2] * row, row, 1]
        count = shape[0] * strides[0]
        let base = UnsafeMutablePointer<Float>.allocate(capacity: count)
        base.initialize(repeating: -1, count: count)  // the padding too
        tensor = StridedTensor(base: base, shape: shape, strides: strides)
    }

    deinit { tensor.base.deallocate() }

    subscript(offset: Int) -> Float {
        get { tensor.base[offset] }
        set { tensor.base[offset] = newValue }
    }

    /// The storage offsets of the elements (padding left out), in row-major order.
    func positions() -> [Int] {
        var out: [Int] = []
        for a in 0..<shape[0] { for b in 0..<shape[1] { for c in 0..<shape[2] { for d in 0..<shape[3] {
            out.append(a * strides[0] + b * strides[1] + c * strides[2] + d * strides[3])
        } } } }
        return out
    }

    /// Slice r along `axis` holds `first + r`.
    func tag(axis: Int, first: Float) {
        for p in positions() { self[p] = first + Float(index(of: p)[axis]) }
    }

    /// Per slice along `axis`, the one value it holds as an Int, nil where it holds several.
    func rows(axis: Int) -> [Int?] {
        var seen = [Set<Float>](repeating: [], count: shape[axis])
        for p in positions() { seen[index(of: p)[axis]].insert(self[p]) }
        return seen.map { $0.count == 1 ? $0.first.map { Int($0) } : nil }
    }

    private func index(of p: Int) -> [Int] {
        var rest = p
        return strides.map { s in defer { rest %= s }; return rest / s }
    }
}
