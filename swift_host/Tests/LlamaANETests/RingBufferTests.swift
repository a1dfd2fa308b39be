import Foundation
import XCTest
@testable import LlamaANE
#if canImport(CoreML)
import CoreML
#endif

/// The sliding layers' ring buffer (`cache.sliding`) of the windowed family exports (a Gemma 3 with
/// inputs caches and every phase; a Mistral whose every layer slides, caches in states): the ring
/// tensors wired by name in every phase, the manifest's ring checked against the config and the
/// chunks, and rewinds that forget more than the ring can serve starting again from position 0.
final class RingBufferTests: XCTestCase {
    static let exports = ["export_gemma3", "export_mistral_window"]

    func testTheRingIsReadAndItsSizeDoesNotDependOnTheContext() throws {
        for name in Self.exports {
            let manifest = try Manifest.load(from: Fixtures.url(name))
            let sliding = try XCTUnwrap(manifest.cache.sliding, name)
            let window = try XCTUnwrap(manifest.config.slidingWindow)
            XCTAssertEqual(Set(sliding.layers), Set(manifest.config.slidingLayers), name)
            XCTAssertGreaterThanOrEqual(sliding.length, window + manifest.prefillLength - 1, name)
            XCTAssertLessThan(sliding.length, manifest.contextLength, "\(name): the ring is shorter than the context")
            XCTAssertEqual(manifest.ringRewindLimit, sliding.length - window - manifest.prefillLength + 2)
            XCTAssertGreaterThan(try XCTUnwrap(manifest.ringRewindLimit), 0)
        }
    }

    /// Every phase of every chunk with sliding layers reads k_ring/v_ring of (its sliding layers,
    /// channels, 1, R): as inputs the cache update rewrites from k_ring_new/v_ring_new (verify's at
    /// the host's ring_slots; the cascade's update writes the suffix caches only), or as the
    /// chunk's own states; a chunk whose every layer slides has no k_cache at all.
    func testTheRingIsWiredByNameInEveryPhase() throws {
        for name in Self.exports {
            let manifest = try Manifest.load(from: Fixtures.url(name))
            let wiring = try PipelineWiring(manifest: manifest)
            let ring = manifest.cache.ringLength
            var ringChunks = 0
            for phase in PipelineWiring.phases(of: manifest) {
                for (i, chunk) in manifest.chunks.enumerated() {
                    let rows = manifest.cacheRows(of: chunk)
                    let label = "\(name) \(chunk.model) \(phase.rawValue)"
                    let function = try manifest.function(chunk.model, phase.rawValue)
                    let inputs = try XCTUnwrap(wiring.chunkInputs[phase]?[i], label)
                    let update = try XCTUnwrap(wiring.updateInputs[phase]?[i], label)
                    let rewritten = Set(try XCTUnwrap(wiring.updatedState[phase]?[i], label).map(\.name))
                    let states = Set(try XCTUnwrap(wiring.chunkStates[phase]?[i], label).map(\.name))
                    XCTAssertEqual(rows.full + rows.ring, chunk.layers.count)
                    if rows.full == 0 {
                        XCTAssertNil(inputs[TensorNames.kCache], label)
                        XCTAssertFalse(states.contains(TensorNames.kCache), label)
                    }
                    guard rows.ring > 0 else {
                        XCTAssertNil(inputs[TensorNames.kRing], label)
                        continue
                    }
                    ringChunks += 1
                    for tensor in [TensorNames.kRing, TensorNames.vRing] {
                        let spec = try XCTUnwrap((function.inputs + function.states).first { $0.name == tensor }, label)
                        XCTAssertEqual(spec.shape, [rows.ring, manifest.cache.channels, 1, ring], label)
                        if manifest.cache.inStates {
                            XCTAssertTrue(states.contains(tensor), label)
                            XCTAssertNil(inputs[tensor], label)
                            XCTAssertTrue(rewritten.isEmpty, "\(label): the chunk writes its states itself")
                            continue
                        }
                        XCTAssertEqual(inputs[tensor], .cache(tensor), label)
                        if phase == .decodeBranches {
                            XCTAssertFalse(rewritten.contains(tensor), "\(label): branches never write the prefix's ring")
                            XCTAssertEqual(rewritten, ["k_suffix", "v_suffix"], label)
                        } else {
                            XCTAssertTrue(rewritten.contains(tensor), label)
                            XCTAssertEqual(update[tensor], .cache(tensor), label)
                            XCTAssertEqual(update[tensor + "_new"], .chunkOutput(tensor + "_new"), label)
                            XCTAssertEqual(function.output(tensor + "_new")?.shape[0], rows.ring, label)
                        }
                    }
                    if phase == .verify {
                        XCTAssertEqual(update[TensorNames.slots], .value(TensorNames.slots), label)
                        XCTAssertEqual(update[TensorNames.ringSlots], .value(TensorNames.ringSlots), label)
                    } else if phase != .decodeBranches && !manifest.cache.inStates {
                        XCTAssertEqual(update[TensorNames.position], .value(TensorNames.position), label)
                    }
                }
            }
            XCTAssertGreaterThan(ringChunks, 0, name)
        }
    }

    func testACacheUpdateInputTheHostDoesNotWriteIsRefused() throws {
        var manifest = try Manifest.load(from: Fixtures.url("export_gemma3"))
        let update = try XCTUnwrap(manifest.chunks[0].cacheUpdate["decode"])
        manifest.models["cache_update"]?.functions[update]?.inputs.append(
            Manifest.TensorSpec(name: TensorNames.ringSlots, shape: [1], dtype: "int32"))
        XCTAssertThrowsError(try PipelineWiring(manifest: manifest)) { error in
            XCTAssertEqual(error as? PipelineError, .unwiredInput(model: "cache_update (\(update))", input: TensorNames.ringSlots))
        }
    }

    /// A manifest whose ring disagrees with its config or its chunks is refused, naming the field.
    func testARingThatDisagreesWithTheExportIsRefusedByName() throws {
        let object = try ManifestEdits.object("export_gemma3")
        XCTAssertNoThrow(try ManifestEdits.decode(object))
        func refused(_ edit: (inout [String: Any]) throws -> Void, mentioning words: [String], line: UInt = #line) throws {
            try ManifestEdits.assertRefused(object, edit, mentioning: words, line: line)
        }
        // other layers than the config's sliding ones
        try refused({ try ManifestEdits.setCache(&$0, "sliding", "layers", [0, 1]) },
                    mentioning: ["cache.sliding.layers [0, 1]", "config.sliding_layers"])
        // too few slots for a window and a prefill window's padding (and than the tensors hold)
        try refused({ try ManifestEdits.setCache(&$0, "sliding", "length", 16) }, mentioning: ["cache.sliding.length 16"])
        try refused({ try ManifestEdits.setCache(&$0, "sliding", "length", 48) }, mentioning: ["cache.sliding.length 48", "k_ring"])
        // a ring the chunks hold, but no cache.sliding
        try refused({ try ManifestEdits.removeCache(&$0, "sliding") }, mentioning: ["k_ring", "cache.sliding names none"])
        // chunk_1 holds layer 2 (sliding) alone: a chunk plan that puts layer 1 beside it disagrees with its ring
        try refused({ try ManifestEdits.setChunkLayers(&$0, [[0], [1, 2]]) },
                    mentioning: ["chunk_0", "layers [0]", "cache.sliding.layers [0, 2]"])
    }

    func testACacheSlidingNoFunctionReadsIsRefused() throws {
        let url = try Fixtures.url("export").appendingPathComponent(Manifest.fileName)
        var object = try XCTUnwrap(JSONSerialization.jsonObject(with: Data(contentsOf: url)) as? [String: Any])
        var config = try XCTUnwrap(object["config"] as? [String: Any])
        config["sliding_window"] = 16
        config["sliding_layers"] = [0]
        object["config"] = config
        var cache = try XCTUnwrap(object["cache"] as? [String: Any])
        cache["sliding"] = ["length": 32, "layers": [0]]
        object["cache"] = cache
        XCTAssertThrowsError(try ManifestEdits.decode(object)) { error in
            XCTAssertEqual(error as? ManifestError, .inconsistent(
                "cache.sliding names a ring buffer of 32 positions, but no chunk function reads one (k_ring)"))
        }
    }

    func testRingSlotsArePositionsModuloTheRingAndDroppedTokensStayDropped() {
        XCTAssertEqual(RingSlots.of([30, 31, 32, 33, -1, 65], ring: 32), [30, 31, 0, 1, -1, 1])
        XCTAssertEqual(RingSlots.of([3, -1], ring: 0), [-1, -1])
    }

    /// Forgetting at most `rewindLimit` tokens keeps the rest; forgetting more keeps none.
    func testARewindPastTheRingsReachKeepsNothing() throws {
        var cache = KVCacheState(capacity: 64, prefillLength: 8, rewindLimit: 10)
        let tokens = Array(100..<140)
        for window in try cache.prefillWindows(tokens) { cache.commit(window) }
        XCTAssertEqual(cache.reusablePrefix(of: Array(tokens[..<30]) + [7]), 30, "10 forgotten: within reach")
        XCTAssertEqual(cache.reusablePrefix(of: Array(tokens[..<29]) + [7]), 0, "11 forgotten: past it")
        var kept = cache
        XCTAssertEqual(kept.rewind(to: 30), 30)
        XCTAssertEqual(kept.tokens, Array(tokens[..<30]))
        XCTAssertEqual(cache.rewind(to: 29), 0)
        XCTAssertEqual(cache.position, 0)
        var plain = KVCacheState(capacity: 64, prefillLength: 8)
        for window in try plain.prefillWindows(tokens) { plain.commit(window) }
        XCTAssertEqual(plain.reusablePrefix(of: Array(tokens[..<3]) + [7]), 3, "without a ring any prefix is kept")
    }

    /// A generator over a ring export's limit: a next prompt that shares a prefix the ring can still
    /// serve prefills only the rest; one that would forget more prefills everything from position 0.
    func testTheGeneratorStartsAgainWhereTheRingCannotServeTheCommonPrefix() async throws {
        let manifest = try Manifest.load(from: Fixtures.url("export_gemma3"))
        let limit = try XCTUnwrap(manifest.ringRewindLimit)
        let recorder = RecordingGenerator(manifest, rewindLimit: limit)
        let generator = recorder.generator!
        let first = Array(10..<50)
        _ = try await generator.generateAll(prompt: first, maxNewTokens: 1)
        XCTAssertEqual(generator.cachedTokens, first)

        recorder.windows = []
        let near = Array(first[..<(first.count - limit)]) + [60, 61]
        let (_, reused) = try await generator.generateAll(prompt: near, maxNewTokens: 1)
        XCTAssertEqual(reused.reusedTokens, first.count - limit)
        XCTAssertEqual(recorder.windows.first?.position, first.count - limit)

        recorder.windows = []
        let far = Array(near[..<(near.count - limit - 3)]) + [70]
        let (_, fresh) = try await generator.generateAll(prompt: far, maxNewTokens: 1)
        XCTAssertEqual(fresh.reusedTokens, 0, "the ring no longer holds what the common prefix needs")
        XCTAssertEqual(fresh.prefilledTokens, far.count)
        XCTAssertEqual(recorder.windows.first?.position, 0)
        XCTAssertEqual(generator.cachedTokens, far)
    }

    #if canImport(CoreML)
    /// The Gemma 3 export on Core ML (CPU): decoding speculatively (the verify update writes the
    /// accepted tokens into the ring at their ring_slots) gives Python's greedy tokens; a next
    /// prompt within the ring's reach reuses the cache, one past it prefills from position 0, and
    /// both go on as Python's generation did.
    func testCoreMLRunsTheRingThroughVerifyAndRewinds() async throws {
        let model = try ExportedModel(folder: Fixtures.url("export_gemma3"))
        let root = try JSONValue.parse(Data(contentsOf: Fixtures.url("families.json")))
        func ints(_ v: JSONValue?) -> [Int] { v?.arrayValue?.compactMap(\.intValue) ?? [] }
        let prompt = ints(root["export_gemma3"]?["prompt_ids"]), tokens = ints(root["export_gemma3"]?["tokens"])
        XCTAssertGreaterThanOrEqual(tokens.count, 16)
        let predictor = try await model.makeCoreMLPredictor(computeUnits: .cpuOnly)
        let generator = model.generator(predictor: predictor)
        let drafted = try await generator.generateAll(prompt: prompt, maxNewTokens: tokens.count,
                                                      speculative: .promptLookup(adaptive: false))
        XCTAssertEqual(drafted.tokens, tokens)

        let near = try await generator.generateAll(prompt: prompt + tokens.prefix(15), maxNewTokens: tokens.count - 15)
        XCTAssertGreaterThan(near.stats.reusedTokens, 0)
        XCTAssertEqual(near.tokens, Array(tokens[15...]))
        let far = try await generator.generateAll(prompt: prompt + tokens.prefix(2), maxNewTokens: 4)
        XCTAssertEqual(far.stats.reusedTokens, 0, "the ring no longer holds the common prefix's window")
        XCTAssertEqual(far.tokens, Array(tokens[2..<6]))
    }
    #endif
}
