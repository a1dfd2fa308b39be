import Foundation
import XCTest
@testable import LlamaANE

/// The host's tensor wiring resolved from the real tiny export: what the Core ML backend feeds
/// each function, checked on Linux against what the exporter actually wrote.
final class PipelineWiringTests: XCTestCase {
    func testEveryInputOfTheRealExportIsProduced() throws {
        let manifest = try Manifest.load(from: Fixtures.url("export"))
        let wiring = try PipelineWiring(manifest: manifest)
        let phases = PipelineWiring.phases(of: manifest)
        XCTAssertEqual(phases, [.prefill, .decode, .decodeBranches, .verify])
        XCTAssertEqual(Set(wiring.chunkInputs.keys), Set(phases))
        for phase in phases {
            for (i, chunk) in manifest.chunks.enumerated() {
                let inputs = try XCTUnwrap(wiring.chunkInputs[phase]?[i])
                let function = try manifest.function(chunk.model, phase.rawValue)
                XCTAssertEqual(Set(inputs.keys), Set(function.inputs.map(\.name)), "\(chunk.model) \(phase)")
                XCTAssertEqual(inputs[TensorNames.hiddenStates], .hiddenStates)
                XCTAssertEqual(inputs[TensorNames.kCache], .cache(TensorNames.kCache), "the prefix cache feeds every phase")
                XCTAssertEqual(inputs["cos"], .embeddingsOutput("cos"))
                let update = try XCTUnwrap(wiring.updateInputs[phase]?[i])
                XCTAssertEqual(update["k_new"], .chunkOutput("k_new"))
                let state = try XCTUnwrap(wiring.updatedState[phase]?[i]).map(\.name)
                if phase == .decodeBranches {
                    XCTAssertEqual(inputs["k_suffix"], .suffixCache("k_suffix"))
                    XCTAssertEqual(update[TensorNames.suffixPositions], .value(TensorNames.suffixPositions))
                    XCTAssertEqual(Set(state), ["k_suffix", "v_suffix"])
                } else if phase == .verify {
                    // Only the accepted tokens are written, each at its slot, into the prefix cache.
                    XCTAssertEqual(update[TensorNames.slots], .value(TensorNames.slots))
                    XCTAssertNil(update[TensorNames.position])
                    XCTAssertEqual(Set(state), [TensorNames.kCache, TensorNames.vCache])
                } else {
                    XCTAssertEqual(update[TensorNames.position], .value(TensorNames.position))
                    XCTAssertEqual(Set(state), [TensorNames.kCache, TensorNames.vCache])
                }
            }
            // The embeddings take only what the host writes: ints, and the verify function's tree mask.
            let embeddings = try manifest.function("embeddings", phase.rawValue)
            let known: Set<String> = [TensorNames.inputIds, TensorNames.position, TensorNames.positions, TensorNames.prefixLength,
                                      TensorNames.depths, TensorNames.treeMask]
            XCTAssertTrue(Set(embeddings.inputs.map(\.name)).isSubset(of: known), "\(embeddings.inputs.map(\.name))")
            XCTAssertTrue(embeddings.inputs.allSatisfy { $0.dtype == "int32" || $0.name == TensorNames.treeMask })
            if phase == .verify {
                let w = try XCTUnwrap(manifest.verifyWindow)
                XCTAssertEqual(embeddings.input(TensorNames.treeMask)?.shape, [1, 1, w, w])
                XCTAssertEqual(embeddings.input(TensorNames.depths)?.shape, [w])
            }
            XCTAssertEqual(wiring.embeddingInputs[phase]?.count, 0, "one embeddings file: no later parts")
        }
    }

    func testLaterEmbeddingsPartsReadTheIdsAndThePreviousHiddenStates() throws {
        let manifest = try Manifest.decode(SplitManifest.data())
        let wiring = try PipelineWiring(manifest: manifest)
        for phase in PipelineWiring.phases(of: manifest) {
            XCTAssertEqual(wiring.embeddingInputs[phase],
                           [[TensorNames.inputIds: .value(TensorNames.inputIds), TensorNames.hiddenStates: .hiddenStates]],
                           "\(phase)")
        }
    }

    func testAMisshapedOrUnfedEmbeddingsPartIsRefused() throws {
        let wrongShape = try Manifest.decode(SplitManifest.data { m in
            SplitManifest.editFunction(&m, "embeddings_1", "decode") { f in
                f?["outputs"] = [["name": "hidden_states_out", "shape": [1, 1, 1, 1], "dtype": "float16"]]
            }
        })
        let hidden = try XCTUnwrap(try wrongShape.function("embeddings", "decode").output(TensorNames.hiddenStates))
        XCTAssertThrowsError(try PipelineWiring(manifest: wrongShape)) { error in
            XCTAssertEqual(error as? ManifestError, .inconsistent(
                "embeddings part embeddings_1 (decode) must take hidden_states and output hidden_states_out, "
                    + "both \(hidden.dtype) \(hidden.shape) like the hidden_states of embeddings"))
        }
        let unfed = try Manifest.decode(SplitManifest.data { m in
            SplitManifest.editFunction(&m, "embeddings_1", "prefill") { f in
                var inputs = f?["inputs"] as? [[String: Any]] ?? []
                inputs.append(["name": "token_type_ids", "shape": [1, 1], "dtype": "int32"])
                f?["inputs"] = inputs
            }
        })
        XCTAssertThrowsError(try PipelineWiring(manifest: unfed)) { error in
            XCTAssertEqual(error as? PipelineError, .unwiredInput(model: "embeddings_1 (prefill)", input: "token_type_ids"))
        }
    }

    func testAnInputNothingProducesIsRefused() throws {
        var manifest = try Manifest.load(from: Fixtures.url("export"))
        let model = manifest.chunks[0].model
        manifest.models[model]?.functions["decode"]?.inputs.append(
            Manifest.TensorSpec(name: "rotary_cache", shape: [1], dtype: "float16"))
        XCTAssertThrowsError(try PipelineWiring(manifest: manifest)) { error in
            XCTAssertEqual(error as? PipelineError, .unwiredInput(model: "\(model) (decode)", input: "rotary_cache"))
        }
    }
}
