import Foundation
import XCTest
@testable import LlamaANE

/// A `--kv-cache state` export on the host: its manifest, its wiring (checked against the real tiny
/// export with state caches), the windows of a cache that must take whole padded windows, and a
/// pipeline that runs no cache update for the phases whose chunks write their own states.
final class StateCacheTests: XCTestCase {
    func testTheStateExportManifestDeclaresItsStates() throws {
        let manifest = try Manifest.load(from: Fixtures.url("export_state"))
        XCTAssertTrue(manifest.cache.inStates)
        XCTAssertFalse(try Manifest.load(from: Fixtures.url("export")).cache.inStates)
        let decode = try manifest.function(manifest.chunks[0].model, "decode")
        XCTAssertEqual(decode.states.map(\.name), [TensorNames.kCache, TensorNames.vCache])
        XCTAssertEqual(decode.states[0].shape, [1, manifest.cache.channels, 1, manifest.contextLength])
        XCTAssertEqual(decode.outputs.map(\.name), [TensorNames.hiddenStatesOut])
        XCTAssertNil(manifest.chunks[0].cacheUpdate["decode"])
    }

    func testTheWiringFeedsThePositionAndHoldsTheCachesAsStates() throws {
        let manifest = try Manifest.load(from: Fixtures.url("export_state"))
        let wiring = try PipelineWiring(manifest: manifest)
        for phase in PipelineWiring.phases(of: manifest) {
            for (i, chunk) in manifest.chunks.enumerated() {
                let inputs = try XCTUnwrap(wiring.chunkInputs[phase]?[i])
                let function = try manifest.function(chunk.model, phase.rawValue)
                XCTAssertEqual(Set(inputs.keys), Set(function.inputs.map(\.name)), "\(chunk.model) \(phase)")
                XCTAssertNil(inputs[TensorNames.kCache], "the prefix cache is a state, not an input")
                XCTAssertEqual(wiring.chunkStates[phase]?[i].map(\.name), [TensorNames.kCache, TensorNames.vCache])
                if phase == .decodeBranches {
                    XCTAssertEqual(inputs["k_suffix"], .suffixCache("k_suffix"))
                    XCTAssertEqual(Set(try XCTUnwrap(wiring.updatedState[phase]?[i]).map(\.name)), ["k_suffix", "v_suffix"])
                } else {
                    XCTAssertEqual(inputs[TensorNames.position], .value(TensorNames.position))
                    XCTAssertEqual(wiring.updateInputs[phase]?[i], [:], "no cache update: the chunk writes its state")
                    XCTAssertEqual(wiring.updatedState[phase]?[i], [])
                }
            }
        }
        // The default export holds no states.
        let plain = try PipelineWiring(manifest: Manifest.load(from: Fixtures.url("export")))
        XCTAssertTrue(plain.chunkStates.values.allSatisfy { $0.allSatisfy(\.isEmpty) })
    }

    func testAnUnknownStateIsRefused() throws {
        var manifest = try Manifest.load(from: Fixtures.url("export_state"))
        let model = manifest.chunks[0].model
        manifest.models[model]?.functions["decode"]?.states.append(
            Manifest.TensorSpec(name: "rotary_state", shape: [1], dtype: "float16"))
        XCTAssertThrowsError(try PipelineWiring(manifest: manifest)) { error in
            XCTAssertEqual(error as? PipelineError, .unwiredInput(model: "\(model) (decode)", input: "rotary_state"))
        }
    }

    func testPaddedWindowsThatWouldPassTheEndRunOneTokenAtATime() throws {
        var cache = KVCacheState(capacity: 16, prefillLength: 4, paddedWindowsMustFit: true)
        let first = try cache.prefillWindows(Array(1...10))
        XCTAssertEqual(first.map(\.phase), [.prefill, .prefill, .prefill])
        first.forEach { cache.commit($0) }
        // at 10 of 16 a padded window of 4 still fits (10..<14); at 14 it would pass the end: token 15 alone
        let near = try cache.prefillWindows([11, 12, 13, 14, 15])
        XCTAssertEqual(near.map(\.phase), [.prefill, .decode])
        XCTAssertEqual(near.map(\.position), [10, 14])
        XCTAssertEqual(near.map(\.count), [4, 1])
        XCTAssertEqual(near[1].tokens, [15])
        near.forEach { cache.commit($0) }
        XCTAssertEqual(cache.tokens, Array(1...15))
        // without the rule the same tokens make two padded windows
        var plain = KVCacheState(capacity: 16, prefillLength: 4)
        try plain.prefillWindows(Array(1...10)).forEach { plain.commit($0) }
        XCTAssertEqual(try plain.prefillWindows([11, 12, 13, 14, 15]).map(\.phase), [.prefill, .prefill])
    }

    func testAPipelineOverStatesRunsNoCacheUpdates() async throws {
        let backend = ChunkedPipelineTests.RecordingBackend(updateDelayNanoseconds: 0)
        let pipeline = ChunkedPipeline(backend: backend, contextLength: 32, prefillLength: 4, cacheInStates: true)
        XCTAssertTrue(pipeline.paddedWindowsMustFit)
        XCTAssertTrue(pipeline.emptyCache().paddedWindowsMustFit)
        _ = try await pipeline.predict(TokenWindow(phase: .prefill, tokens: [5, 6, 0, 0], count: 2, position: 0))
        _ = try await pipeline.predict(TokenWindow(phase: .decode, tokens: [7], count: 1, position: 2))
        try await pipeline.finishUpdates()
        let events = await backend.log.events
        XCTAssertEqual(events.filter { $0.hasPrefix("chunk") }.count, 6)
        XCTAssertFalse(events.contains { $0.hasPrefix("update") }, "\(events)")
    }
}
