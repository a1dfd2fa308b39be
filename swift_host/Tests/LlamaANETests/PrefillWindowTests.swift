import Foundation
import XCTest
@testable import LlamaANE
#if canImport(CoreML)
import CoreML
#endif

/// Exports whose prefill window decodes (format_version 4, `decode_function` "prefill"): a Granite
/// with state caches, the head folded and a cascade through the window of width 2; an OLMo 2 with
/// input caches (written by the prefill cache updates) and the same cascade; a Mistral whose sliding
/// layers keep a ring, with state caches and no cascade. Python's runs of them (`families.json`,
/// written by tests/swift_fixtures.py: every step's window, each row's position, the write position,
/// the masks the host made and the logits) are replayed through the Swift pipeline with a backend
/// that answers each step with Python's logits and notes how what the pipeline feeds it differs from
/// what Python fed the exported programs. With Core ML, the exports themselves run.
final class PrefillWindowTests: XCTestCase {
    /// The exports whose prefill window decodes, and those whose cascade steps through it.
    static let exports = ["export_prefill", "export_prefill_inputs", "export_prefill_ring"]
    static let windowCascades = ["export_prefill", "export_prefill_inputs"]

    /// One step Python ran: the window's ids, each row's position, where its K/V went, its real
    /// tokens (nil for a cascade step), the masks (per name, a "1"/"0" string per row) and the logits
    /// by window row (a sequence step's last real token; a cascade step's branch rows).
    struct Step {
        let ids: [Int32]
        let positions: [Int32]
        let position: Int
        let count: Int?
        let masks: [String: [String]]
        let logits: [Int: [Float]]
    }

    struct Cascade {
        let branches: [[Int]]
        let maxNewTokens: Int
        let tokens: [[Int]]
        let steps: [Step]
    }

    struct Expected {
        let promptIds: [Int]
        let tokens: [Int]
        let steps: [Step]
        let cascade: Cascade?
    }

    static func expected(_ name: String) throws -> Expected {
        let root = try JSONValue.parse(Data(contentsOf: Fixtures.url("families.json")))
        let e = try XCTUnwrap(root[name], "families.json has no \(name)")
        func ints(_ v: JSONValue?) -> [Int] { v?.arrayValue?.compactMap(\.intValue) ?? [] }
        func floats(_ v: JSONValue?) -> [Float] { (v?.arrayValue ?? []).map { Float($0.doubleValue ?? .nan) } }
        func masks(_ v: JSONValue?) -> [String: [String]] {
            Dictionary(uniqueKeysWithValues: (v?.objectValue ?? []).map { ($0.0, ($0.1.arrayValue ?? []).compactMap(\.stringValue)) })
        }
        func step(_ s: JSONValue, cascade: Bool) throws -> Step {
            let count = s["count"]?.intValue
            XCTAssertEqual(s["function"]?.stringValue, "prefill", "\(name): every step runs the prefill function")
            let logits: [Int: [Float]]
            if cascade {
                logits = Dictionary(uniqueKeysWithValues: (s["logits"]?.arrayValue ?? []).enumerated().map { ($0.offset, floats($0.element)) })
            } else {
                logits = [try XCTUnwrap(count) - 1: floats(s["logits"])]
            }
            return Step(ids: ints(s["input_ids"]).map { Int32($0) }, positions: ints(s["positions"]).map { Int32($0) },
                        position: s["position"]?.intValue ?? -1, count: cascade ? nil : count, masks: masks(s["masks"]),
                        logits: logits)
        }
        let cascade = try e["cascade"].map { c in
            Cascade(branches: (c["branches"]?.arrayValue ?? []).map(ints), maxNewTokens: c["max_new_tokens"]?.intValue ?? -1,
                    tokens: (c["tokens"]?.arrayValue ?? []).map(ints),
                    steps: try (c["steps"]?.arrayValue ?? []).map { try step($0, cascade: true) })
        }
        return Expected(promptIds: ints(e["prompt_ids"]), tokens: ints(e["tokens"]),
                        steps: try (e["steps"]?.arrayValue ?? []).map { try step($0, cascade: false) }, cascade: cascade)
    }

    /// The mask rows as the fixtures record them.
    static func rows(_ masks: [String: HostMask]) -> [String: [String]] {
        masks.mapValues { m in (0..<m.rows).map { m.row($0) } }
    }

    // MARK: the manifest

    func testTheExportsReadAsFormatVersion4WithTheirDecodeFunctionCascadeAndStateLength() throws {
        for name in Self.exports {
            let manifest = try Manifest.load(from: Fixtures.url(name), verifyHashes: true)
            XCTAssertEqual(manifest.formatVersion, 4, name)
            XCTAssertEqual(manifest.decodeFunction, "prefill", name)
            XCTAssertTrue(manifest.prefillDecodes, name)
            XCTAssertEqual(manifest.decodePhase, .prefill, name)
            XCTAssertEqual(manifest.runs(.decode), .prefill, name)
            XCTAssertEqual(manifest.windowCascade, Self.windowCascades.contains(name), name)
            XCTAssertEqual(manifest.cascade, Self.windowCascades.contains(name) ? "window" : nil, name)
            // states hold the context and a prefill window less one, rounded up to 32; input caches the context
            let length = manifest.cache.inStates ? manifest.contextLength + 32 : manifest.contextLength
            XCTAssertEqual(manifest.cacheLength, length, name)
            for chunk in manifest.chunks {
                let states = try manifest.function(chunk.model, "prefill").states.filter { $0.name.hasSuffix("_cache") }
                XCTAssertTrue(states.allSatisfy { $0.shape.last == length }, "\(name) \(chunk.model): \(states)")
                XCTAssertNil(chunk.cacheUpdate["decode"], name)
            }
            XCTAssertEqual(PipelineWiring.phases(of: manifest), [.prefill], "\(name): one window function, no decode functions")
        }
        let plain = try Manifest.load(from: Fixtures.url("export_state"))
        XCTAssertFalse(plain.prefillDecodes)
        XCTAssertEqual(plain.cacheLength, plain.contextLength, "a decode function's export keeps states of the context")
        XCTAssertEqual(plain.runs(.decode), .decode)
    }

    func testTheChunksReadTheHostsMasksAndWritePosition() throws {
        for name in Self.exports {
            let manifest = try Manifest.load(from: Fixtures.url(name))
            let wiring = try PipelineWiring(manifest: manifest)
            XCTAssertNil(wiring.chunkInputs[.decode], name)
            XCTAssertNil(wiring.chunkInputs[.decodeBranches], name)
            for (i, chunk) in manifest.chunks.enumerated() {
                let inputs = try XCTUnwrap(wiring.chunkInputs[.prefill]?[i])
                XCTAssertEqual(inputs["mask"], .hostMask("mask"), "\(name) \(chunk.model)")
                XCTAssertEqual(inputs["sliding_mask"], manifest.cache.sliding == nil ? nil : .hostMask("sliding_mask"), name)
                XCTAssertEqual(inputs["position"], manifest.cache.inStates ? .value("position") : nil, name)
                XCTAssertEqual(inputs["cos"], .embeddingsOutput("cos"), name)
            }
            let embeddings = try manifest.function("embeddings", "prefill")
            XCTAssertEqual(embeddings.inputs.map(\.name), ["input_ids", "positions"], name)
        }
    }

    func testAFormatVersion3ManifestIsRefusedWithALineToReExport() throws {
        let object = try ManifestEdits.object("export_prefill")
        XCTAssertNoThrow(try ManifestEdits.decode(object))
        var three = object
        three["format_version"] = 3
        XCTAssertThrowsError(try ManifestEdits.decode(three)) { error in
            XCTAssertEqual(error as? ManifestError, .retiredFormatVersion(
                found: 3, was: "an export whose prefill window decoded, with masks the embeddings made", current: 4))
            XCTAssertEqual("\(error)", "manifest.json has format_version 3 (an export whose prefill window decoded, with masks "
                + "the embeddings made), which is no longer read. Re-export the model with `llama-ane export` (format_version 4).")
        }
        // a version 3 manifest is refused before anything else of it is read
        XCTAssertThrowsError(try Manifest.decode(Data("{\"format_version\": 3}".utf8))) { error in
            XCTAssertEqual(error as? ManifestError, .retiredFormatVersion(
                found: 3, was: "an export whose prefill window decoded, with masks the embeddings made", current: 4))
        }
    }

    func testVersion4IsReadOnlyWhereThePrefillWindowDecodes() throws {
        let object = try ManifestEdits.object("export_prefill")
        try ManifestEdits.assertRefused(object, { $0["decode_function"] = nil },
                                        mentioning: ["format_version 4 is written only with decode_function \"prefill\"", "none"])
        try ManifestEdits.assertRefused(object, { $0["decode_function"] = "decode" },
                                        mentioning: ["format_version 4", "but it has \"decode\""])
        try ManifestEdits.assertRefused(object, { $0["decode_function"] = "verify" },
                                        mentioning: ["decode_function \"verify\" is neither"])
        try ManifestEdits.assertRefused(object, { $0["cascade"] = "suffix" }, mentioning: ["cascade \"suffix\""])
        // a version 2 export (decode functions) whose cascade claims the prefill window
        var plain = try ManifestEdits.object("export")
        XCTAssertNoThrow(try ManifestEdits.decode(plain))
        plain["cascade"] = "window"
        XCTAssertThrowsError(try ManifestEdits.decode(plain)) { error in
            XCTAssertTrue("\(error)".contains("cascade \"window\" steps through the prefill window"), "\(error)")
        }
        // the embeddings must take each row's position, and the chunks' masks be the ones the host makes
        try ManifestEdits.assertRefused(object, { m in
            try Self.editInputs(&m, "embeddings", "prefill") { inputs in inputs[1]["name"] = "position"; inputs[1]["shape"] = [1] }
        }, mentioning: ["embeddings (prefill) must take positions of shape [8], int32"])
        try ManifestEdits.assertRefused(object, { m in
            try Self.editInputs(&m, "chunk_1", "prefill") { inputs in
                let i = try XCTUnwrap(inputs.firstIndex { $0["name"] as? String == "mask" })
                inputs[i]["shape"] = [1, 1, 8, 64]
            }
        }, mentioning: ["chunk_1 (prefill) reads mask", "[1, 1, 8, 72]"])
        // the states hold the window's padding past the context
        try ManifestEdits.assertRefused(object, { m in
            var models = try XCTUnwrap(m["models"] as? [String: Any])
            var chunk = try XCTUnwrap(models["chunk_0"] as? [String: Any])
            var functions = try XCTUnwrap(chunk["functions"] as? [String: Any])
            var prefill = try XCTUnwrap(functions["prefill"] as? [String: Any])
            var states = try XCTUnwrap(prefill["states"] as? [[String: Any]])
            states[0]["shape"] = [1, 64, 1, 64]
            prefill["states"] = states
            functions["prefill"] = prefill
            chunk["functions"] = functions
            models["chunk_0"] = chunk
            m["models"] = models
        }, mentioning: ["has shape [1, 64, 1, 64]", "states of 96 columns", "[1, 64, 1, 96]"])
    }

    /// Rewrites the inputs of `model`'s function `function` in a manifest object.
    static func editInputs(_ m: inout [String: Any], _ model: String, _ function: String,
                           _ edit: (inout [[String: Any]]) throws -> Void) throws {
        var models = try XCTUnwrap(m["models"] as? [String: Any])
        var entry = try XCTUnwrap(models[model] as? [String: Any])
        var functions = try XCTUnwrap(entry["functions"] as? [String: Any])
        var f = try XCTUnwrap(functions[function] as? [String: Any])
        var inputs = try XCTUnwrap(f["inputs"] as? [[String: Any]])
        try edit(&inputs)
        f["inputs"] = inputs
        functions[function] = f
        entry["functions"] = functions
        models[model] = entry
        m["models"] = models
    }

    // MARK: the load plan

    func testTheLoadPlanNamesOnePrefillFunctionPerModelAndDecodeRunsIt() async throws {
        for name in Self.exports {
            let manifest = try Manifest.load(from: Fixtures.url(name))
            let plan = try LoadPlan(manifest: manifest)
            XCTAssertEqual(plan.stages.map(\.function), ["prefill"], "\(name): no decode, no decode_branches stage")
            let stage = try XCTUnwrap(plan.stage(.prefill, bucket: manifest.contextLength))
            XCTAssertEqual(plan.stage(.decode, bucket: manifest.contextLength), stage, "\(name): decode runs the prefill stage")
            XCTAssertNil(plan.stage(.decodeBranches, bucket: manifest.contextLength), name)
            var expected = ["embeddings.prefill"] + manifest.chunks.map { "\($0.model).prefill" }
            expected += manifest.cache.inStates ? [] : Array(Set(manifest.chunks.compactMap { $0.cacheUpdate["prefill"] }))
                .sorted().map { "cache_update.\($0)" }
            expected += manifest.lmHead.models.map { "\($0).prefill" }
            XCTAssertEqual(Set(plan.functions.map(\.description)), Set(expected), name)
            XCTAssertEqual(plan.functions.count, expected.count, name)
            // every model holds one function (the cache updates one per chunk size)
            let perModel = Dictionary(grouping: plan.functions.filter { $0.model != "cache_update" }, by: \.model)
            XCTAssertTrue(perModel.values.allSatisfy { $0.map(\.function) == ["prefill"] }, "\(name): \(perModel)")
            XCTAssertEqual(Set(plan.functions.map { [$0.model, $0.function] }),
                           Set(manifest.models.flatMap { m, e in e.functions.keys.map { [m, $0] } }), name)
            XCTAssertEqual(ResidentModel(manifest: manifest, holding: plan.functions).copies, 1, accuracy: 1e-9,
                           "\(name): one copy of every package's weights")

            // decode asks for the prefill stage, which is loaded once
            let store = LoadPlanTests.CountingStore(runtime: plan.runtime)
            let stages = PlannedStages(plan: plan, store: store) { $0 }
            let decode = try await stages.stage(.decode, bucket: manifest.contextLength)
            let prefill = try await stages.stage(.prefill, bucket: manifest.contextLength)
            XCTAssertEqual(decode.plan, prefill.plan)
            let loads = await store.loads
            XCTAssertEqual(Set(loads), Set(plan.functions), name)
            XCTAssertEqual(loads.count, plan.functions.count, "\(name): loaded once")
        }
    }

    // MARK: the host masks

    /// Every sequence window's masks as Python's host made them (with and without a ring), and every
    /// cascade step's, from the row positions and write position Python recorded.
    func testTheHostMasksArePythonsAtEveryRecordedStep() throws {
        var checked = 0
        for name in Self.exports {
            let manifest = try Manifest.load(from: Fixtures.url(name))
            let masks = HostMasks(manifest: manifest)
            XCTAssertEqual(masks.slidingWindow, manifest.cache.sliding == nil ? nil : manifest.config.slidingWindow, name)
            XCTAssertEqual(masks.ring, manifest.cache.ringLength, name)
            let e = try Self.expected(name)
            let s = manifest.prefillLength, t = manifest.contextLength
            for (k, step) in e.steps.enumerated() {
                let made = masks.windowMasks(position: step.position, rows: s, cacheColumns: t)
                XCTAssertEqual(Self.rows(made), step.masks, "\(name) step \(k) at \(step.position)")
                checked += 1
            }
            guard let cascade = e.cascade else { continue }
            // the groups of the cascade: each starts writing at the prefix
            let prefix = e.promptIds.count, width = try XCTUnwrap(manifest.branchWidth)
            var groups = stride(from: 0, to: cascade.branches.count, by: width).map { min(width, cascade.branches.count - $0) }
            var group = 0
            for (k, step) in cascade.steps.enumerated() {
                if step.position == prefix { group = groups.removeFirst() }  // a group's first step writes at the prefix
                let steps = (step.position - prefix) / group
                let seen = step.positions.prefix(group).map { Int($0) - prefix }
                let made = masks.branchMasks(prefix: prefix, width: group, seen: seen, steps: steps, rows: s, cacheColumns: t)
                XCTAssertEqual(Self.rows(made), step.masks, "\(name) cascade step \(k)")
                checked += 1
            }
            XCTAssertTrue(groups.isEmpty, name)
        }
        XCTAssertEqual(checked, 3 * 24 + 2 * 9, "every recorded step")
    }

    func testARingsSlotsHoldTheLatestPositionBelowTheWindow() throws {
        XCTAssertEqual(HostMasks.heldPositions(0, ring: 4), [-4, -3, -2, -1])
        XCTAssertEqual(HostMasks.heldPositions(6, ring: 4), [4, 5, 2, 3])
        // a query sees the ring's keys within the window only, and never a slot not yet written
        let masks = HostMasks(slidingWindow: 3, ring: 4)
        let m = try XCTUnwrap(masks.windowMasks(position: 6, rows: 2, cacheColumns: 10)["sliding_mask"])
        XCTAssertEqual([m.row(0), m.row(1)], ["110010", "010011"])  // slots hold 4, 5, 2, 3; rows at 6, 7
        XCTAssertEqual(m.shape, [1, 1, 2, 6])
        XCTAssertEqual(masks.windowMasks(position: 6, rows: 2, cacheColumns: 10)["mask"]?.row(1), "111111000011")
        XCTAssertEqual(Array(m.additive.prefix(3)), [0, 0, HostMasks.maskValue])
        XCTAssertEqual(HostMasks.maskValue, -1.0e4)
        XCTAssertNil(HostMasks(slidingWindow: nil, ring: 0).windowMasks(position: 3, rows: 2, cacheColumns: 4)["sliding_mask"])
    }

    /// A cascade step's rows: each sees the prefix, its own branch's columns (those of the last steps
    /// it wrote, where it took its slot late) and itself; within the sliding window its tokens count
    /// from the step it began.
    func testABranchRowSeesThePrefixItsOwnColumnsAndItself() throws {
        // prefix 2, two slots, three steps written: slot 0 wrote all three, slot 1 only the last
        let made = HostMasks(slidingWindow: 3, ring: 0).branchMasks(prefix: 2, width: 2, seen: [3, 1], steps: 3, rows: 3,
                                                                  cacheColumns: 8)
        XCTAssertEqual(Self.rows(made), [
            "mask": ["11101010100", "11000001010", "00000000001"],
            // slot 0 at position 5 sees its tokens at 3 and 4; slot 1 at 3 the prefix's 1 and its token at 2
            "sliding_mask": ["00001010100", "01000001010", "00000000001"],
        ])
        let plain = HostMasks(slidingWindow: nil, ring: 0).branchMasks(prefix: 2, width: 1, seen: [0], steps: 0, rows: 2,
                                                                       cacheColumns: 4)
        XCTAssertEqual(Self.rows(plain), ["mask": ["110010", "000001"]])
    }

    // MARK: replayed through the pipeline

    /// A backend that answers each window with Python's logits in order, noting where what the
    /// pipeline feeds it differs from what Python fed the programs, and every cache update.
    final class ReplayBackend: BranchBackend, @unchecked Sendable {
        typealias Activations = Int
        let chunkCount: Int
        let contextLength: Int
        let steps: [Step]
        private let lock = NSLock()
        private(set) var next = 0
        private(set) var problems: [String] = []
        /// Per chunk, the phase, bucket and position of each of its cache updates, in the order they
        /// ran (a chunk's run one after the other; different chunks' in the background, in any order).
        private(set) var updates: [Int: [String]] = [:]
        private(set) var chunkRuns = 0

        init(_ manifest: Manifest, steps: [Step]) {
            chunkCount = manifest.chunks.count
            contextLength = manifest.contextLength
            self.steps = steps
        }

        private func locked<T>(_ body: () -> T) -> T {
            lock.lock(); defer { lock.unlock() }
            return body()
        }

        private func note(_ problem: String) { locked { problems.append(problem) } }

        func embed(_ window: TokenWindow, bucket: Int) async throws -> Int {
            note("the pipeline ran \(window.phase.rawValue) \(window.tokens) at \(window.position) without the host's masks")
            return -1
        }

        func embed(_ window: HostWindow, bucket: Int) async throws -> Int { locked { take(window, bucket: bucket) } }

        /// The next step Python made, checked against `window`; -1 past the last.
        private func take(_ window: HostWindow, bucket: Int) -> Int {
            guard next < steps.count else {
                problems.append("window at \(window.position): Python made only \(steps.count) steps")
                return -1
            }
            let step = steps[next], k = next
            next += 1
            if window.tokens != step.ids { problems.append("step \(k): ids \(window.tokens), Python \(step.ids)") }
            if window.positions != step.positions { problems.append("step \(k): positions \(window.positions), Python \(step.positions)") }
            if window.position != step.position { problems.append("step \(k): written at \(window.position), Python \(step.position)") }
            if let count = step.count, window.count != count { problems.append("step \(k): \(window.count) real, Python \(count)") }
            let masks = PrefillWindowTests.rows(window.masks)
            if masks != step.masks { problems.append("step \(k): masks \(masks), Python \(step.masks)") }
            if bucket != contextLength { problems.append("step \(k): bucket \(bucket)") }
            return k
        }

        func runChunk(_ index: Int, _ input: Int, phase: Phase, bucket: Int) async throws -> Int {
            locked { chunkRuns += 1 }
            if phase != .prefill { note("chunk \(index) ran \(phase.rawValue)") }
            return input
        }

        func updateCache(_ index: Int, phase: Phase, bucket: Int, position: Int) async throws {
            locked { updates[index, default: []].append("\(phase.rawValue)@\(bucket) at \(position)") }
        }

        func logits(_ input: Int, phase: Phase, column: Int) async throws -> [Float] {
            try await logits(input, phase: phase, columns: [column])[0]
        }

        func logits(_ input: Int, phase: Phase, columns: [Int]) async throws -> [[Float]] {
            guard steps.indices.contains(input) else { return columns.map { _ in [] } }
            return columns.map { column in
                guard let row = steps[input].logits[column] else {
                    note("step \(input): logits of row \(column), which Python did not record")
                    return []
                }
                return row
            }
        }

        func resetCaches() async throws {}

        // no decode_branches functions: the cascade steps through the prefill window
        let branchWidth = 0
        let suffixLength = 0
        struct NoBranches: Error {}
        func embedBranches(_ step: BranchStep) async throws -> Int { note("decode_branches embeddings"); throw NoBranches() }
        func runBranchChunk(_ index: Int, _ input: Int) async throws -> Int { note("decode_branches chunk"); throw NoBranches() }
        func updateSuffix(_ index: Int, suffixPositions: [Int32]) async throws { note("suffix update"); throw NoBranches() }
        func branchLogits(_ input: Int) async throws -> [[Float]] { note("decode_branches logits"); throw NoBranches() }
        func resetSuffixes() async throws { note("suffix reset") }
    }

    /// The cache updates a run of `steps` makes: none with state caches (the chunks write their
    /// windows), else each chunk's prefill update at each step's write position.
    static func updates(_ manifest: Manifest, _ steps: [Step]) -> [Int: [String]] {
        guard !manifest.cache.inStates else { return [:] }
        let each = steps.map { "prefill@\(manifest.contextLength) at \($0.position)" }
        return Dictionary(uniqueKeysWithValues: manifest.chunks.indices.map { ($0, each) })
    }

    func testGreedyGenerationThroughThePipelineFeedsPythonsWindowsAndGivesPythonsTokens() async throws {
        for name in Self.exports {
            let model = try ExportedModel(folder: Fixtures.url(name))
            let manifest = model.manifest
            let e = try Self.expected(name)
            XCTAssertNotEqual(e.promptIds.count % manifest.prefillLength, 0, "\(name): a padded prefill window")
            XCTAssertGreaterThan(e.tokens.count, 1, "\(name): tokens are decoded")
            let backend = ReplayBackend(manifest, steps: e.steps)
            let pipeline = ChunkedPipeline(backend: backend, manifest: manifest)
            XCTAssertTrue(pipeline.decodesInPrefillWindow, name)
            XCTAssertFalse(pipeline.paddedWindowsMustFit, "\(name): the states have room for a window's padding")
            let generated = try await model.generator(predictor: pipeline).generateAll(prompt: e.promptIds,
                                                                                       maxNewTokens: e.tokens.count)
            try await pipeline.finishUpdates()
            XCTAssertEqual(backend.problems, [], name)
            XCTAssertEqual(backend.next, e.steps.count, "\(name): every step Python made")
            XCTAssertEqual(backend.chunkRuns, e.steps.count * manifest.chunks.count, name)
            XCTAssertEqual(generated.tokens, e.tokens, name)
            XCTAssertEqual(backend.updates, Self.updates(manifest, e.steps), name)
        }
    }

    func testTheCascadeStepsThroughThePrefillWindowAsPythonsDid() async throws {
        for name in Self.windowCascades {
            let model = try ExportedModel(folder: Fixtures.url(name))
            let manifest = model.manifest
            let e = try Self.expected(name)
            let cascade = try XCTUnwrap(e.cascade, name)
            XCTAssertGreaterThan(cascade.branches.count, try XCTUnwrap(manifest.branchWidth), "\(name): more than one group")
            // the prefix's windows are the generation's first ones (the same prompt from an empty cache)
            let prefix = e.steps.prefix { $0.position < e.promptIds.count }
            let backend = ReplayBackend(manifest, steps: Array(prefix) + cascade.steps)
            let pipeline = ChunkedPipeline(backend: backend, manifest: manifest)
            XCTAssertEqual(pipeline.windowCascadeWidth, manifest.branchWidth, name)
            let requests = cascade.branches.map { BranchRequest(forcedTokens: $0, maxNewTokens: cascade.maxNewTokens) }
            let results = try await pipeline.decodeBranches(prefix: e.promptIds, branches: requests, eosTokenIds: model.eosTokenIds)
            XCTAssertEqual(backend.problems, [], name)
            XCTAssertEqual(backend.next, prefix.count + cascade.steps.count, "\(name): every step Python made")
            XCTAssertEqual(results.map(\.tokens), cascade.tokens, name)
            XCTAssertEqual(results.map(\.stopReason), Array(repeating: .length, count: cascade.branches.count), name)
            XCTAssertEqual(backend.updates, Self.updates(manifest, Array(prefix) + cascade.steps), name)
        }
    }

    func testBranchesThatWouldNotFitSideBySideAreRefusedBeforeAnyCall() async throws {
        let manifest = try Manifest.load(from: Fixtures.url("export_prefill"))
        let backend = ReplayBackend(manifest, steps: [])
        let pipeline = ChunkedPipeline(backend: backend, manifest: manifest)
        let prefix = Array(1...37)
        // two branches of 1 + 20 tokens after 37: 37 + 2 * 21 > 64
        let requests = [[5], [6], [8]].map { BranchRequest(forcedTokens: $0, maxNewTokens: 20) }
        do {
            _ = try await pipeline.decodeBranches(prefix: prefix, branches: requests, eosTokenIds: [])
            XCTFail("the branches do not fit the context side by side")
        } catch let error as GenerationError {
            XCTAssertEqual(error, .contextFull(position: 37, requested: 42, capacity: 64))
        }
        XCTAssertEqual(backend.next, 0, "nothing ran")
        XCTAssertEqual(backend.problems, [])
        // a step through the window needs an export whose cascade steps through it
        let plain = ChunkedPipeline(backend: backend, contextLength: 64, prefillLength: 8)
        do {
            _ = try await plain.decodeBranchesInWindow(prefix: prefix, branches: requests, eosTokenIds: [])
            XCTFail("no cascade through the window")
        } catch let error as GenerationError {
            XCTAssertEqual(error, .noBranchWidth)
        }
    }

    func testADecodedTokenIsAPrefillWindowOfOneRealTokenAndNoWindowFallsBackNearTheEnd() throws {
        let cache = KVCacheState(capacity: 64, prefillLength: 8, rewindLimit: nil, decodesInPrefillWindow: true)
        XCTAssertEqual(try cache.decodeWindow(7), TokenWindow(phase: .prefill, tokens: [7, 0, 0, 0, 0, 0, 0, 0], count: 1,
                                                               position: 0))
        XCTAssertEqual(try KVCacheState(capacity: 64, prefillLength: 8).decodeWindow(7),
                       TokenWindow(phase: .decode, tokens: [7], count: 1, position: 0))
        // 60 tokens after 3 (context 64, windows of 8): the last window, at 59, would pass the end padded
        func windows(_ name: String) throws -> [TokenWindow] {
            let manifest = try Manifest.load(from: Fixtures.url(name))
            XCTAssertEqual([manifest.contextLength, manifest.prefillLength], [64, 8], name)
            var cache = ChunkedPipeline(backend: ReplayBackend(manifest, steps: []), manifest: manifest).emptyCache()
            cache.commit(TokenWindow(phase: .prefill, tokens: [1, 2, 3, 0, 0, 0, 0, 0], count: 3, position: 0))
            return try cache.prefillWindows(Array(4...63))
        }
        // a state export whose prefill window decodes pads it: its states have room for the padding
        let padded = try windows("export_prefill")
        XCTAssertEqual(padded.map(\.phase), Array(repeating: .prefill, count: 8))
        XCTAssertEqual(padded.map(\.position), Array(stride(from: 3, through: 59, by: 8)))
        XCTAssertEqual(padded.map(\.count), Array(repeating: 8, count: 7) + [4])
        XCTAssertEqual(padded.last?.tokens, [60, 61, 62, 63, 0, 0, 0, 0])
        // a state export with decode functions runs the last tokens one at a time
        let tail = try windows("export_state")
        XCTAssertEqual(tail.map(\.phase), Array(repeating: .prefill, count: 7) + Array(repeating: .decode, count: 4))
        XCTAssertEqual(tail.suffix(4).map(\.tokens), [[60], [61], [62], [63]])
    }

    #if canImport(CoreML)
    /// The exports themselves on Core ML (CPU): Python's greedy tokens, and its cascade's.
    func testCoreMLRunsThePrefillWindowExportsAsPythonDoes() async throws {
        for name in Self.exports {
            let model = try ExportedModel(folder: Fixtures.url(name))
            let e = try Self.expected(name)
            let pipeline = try await model.makeCoreMLPredictor(computeUnits: .cpuOnly)
            let generated = try await model.generator(predictor: pipeline).generateAll(prompt: e.promptIds,
                                                                                       maxNewTokens: e.tokens.count)
            XCTAssertEqual(generated.tokens, e.tokens, name)
            if let cascade = e.cascade {
                let requests = cascade.branches.map { BranchRequest(forcedTokens: $0, maxNewTokens: cascade.maxNewTokens) }
                let results = try await pipeline.decodeBranches(prefix: e.promptIds, branches: requests,
                                                                eosTokenIds: model.eosTokenIds)
                XCTAssertEqual(results.map(\.tokens), cascade.tokens, name)
            }
        }
    }
    #endif
}
