import Foundation
import XCTest
@testable import LlamaANE

/// Qwen3.5's linear-attention layers' recurrent state (`cache.delta`) in the exports of
/// `FamilyExportTests.delta`: a manifest whose recurrent state disagrees with the export is refused
/// by name. Its wiring in every phase and its moves against Python's are checked in
/// `ConvStateTests`, the greedy generation in `FamilyExportTests`.
final class DeltaStateTests: XCTestCase {
    /// A manifest whose recurrent state disagrees with its config, its chunks or its tensors is
    /// refused, naming the field.
    func testARecurrentStateThatDisagreesWithTheExportIsRefusedByName() throws {
        let object = try ManifestEdits.object("export_qwen35")
        XCTAssertNoThrow(try ManifestEdits.decode(object))
        func refused(_ edit: (inout [String: Any]) throws -> Void, mentioning words: [String], line: UInt = #line) throws {
            try ManifestEdits.assertRefused(object, edit, mentioning: words, line: line)
        }
        func setShape(_ m: inout [String: Any], _ function: String, _ input: String, _ shape: [Int]) throws {
            try ManifestEdits.editFunction(&m, "chunk_1", function) { f in
                var inputs = try XCTUnwrap(f["inputs"] as? [[String: Any]])
                let k = try XCTUnwrap(inputs.firstIndex { $0["name"] as? String == input })
                inputs[k]["shape"] = shape
                f["inputs"] = inputs
            }
        }
        try refused(ManifestEdits.cacheEdit("delta", "layers", [0, 2]), mentioning: ["cache.delta.layers [0, 2]", "config.delta_layers [0, 2, 3]"])
        try refused(ManifestEdits.cacheEdit("delta", "heads", 2), mentioning: ["delta_state", "heads 2", "[1, 32, 1, 32]"])
        try refused(ManifestEdits.cacheEdit("delta", "key_dim", 8), mentioning: ["delta_state", "key_dim 8"])
        try refused(ManifestEdits.cacheEdit("delta", "value_dim", 16), mentioning: ["delta_state", "value_dim 16"])
        try refused(ManifestEdits.cacheEdit("delta", "heads", 0), mentioning: ["delta_state", "heads 0"])
        try refused({ try ManifestEdits.removeCache(&$0, "delta") }, mentioning: ["delta_state", "cache.delta names none"])
        // the conv state of the linear-attention layers: cache.conv must name them all
        try refused({ try ManifestEdits.setCache(&$0, "conv", "layers", [0, 2]) },
                    mentioning: ["cache.conv.layers [0, 2]", "config.delta_layers [0, 2, 3]"])
        // chunk_1 holds layers 2 and 3 (linear attention): its recurrent state must hold both
        try refused({ try setShape(&$0, "decode", TensorNames.deltaState, [1, 64, 1, 32]) },
                    mentioning: ["chunk_1 (decode) has delta_state of 1 rows", "2 of the chunk's layers [2, 3]"])
        // the cascade's per-branch states: Ld * branch_width rows, layer-major
        try refused({ try setShape(&$0, "decode_branches", TensorNames.deltaBranches, [2, 64, 1, 32]) },
                    mentioning: ["delta_branches of 2 rows", "times branch_width 2"])
        // a chunk whose recurrent state the host could not carry: it returns no delta_new
        try ManifestEdits.assertCarryNeedsOutput(object, TensorNames.deltaNew, carrying: TensorNames.deltaState)
        // a speculative verify window cannot drop a rejected draft from a recurrent state
        try refused({ $0["verify_window"] = 8 }, mentioning: ["verify_window is 8", "cache.delta"])
        // a config with linear-attention layers and no recurrent state anywhere
        try refused({ m in
            try ManifestEdits.removeCache(&m, "delta")
            var models = try XCTUnwrap(m["models"] as? [String: Any])
            for (name, value) in models {
                guard var entry = value as? [String: Any], var functions = entry["functions"] as? [String: Any] else { continue }
                for (fn, f) in functions {
                    guard var f = f as? [String: Any] else { continue }
                    for key in ["inputs", "outputs"] {
                        f[key] = (f[key] as? [[String: Any]])?.filter { !(($0["name"] as? String) ?? "").hasPrefix("delta_") }
                    }
                    functions[fn] = f
                }
                entry["functions"] = functions
                models[name] = entry
            }
            m["models"] = models
        }, mentioning: ["config.delta_layers [0, 2, 3]", "cache.delta is missing"])
    }

    /// A chunk of the state export that keeps its recurrent state as a Core ML state must be told the
    /// window's real tokens: without `window_tokens` its state would move on by the padding too.
    func testAStateExportWithoutWindowTokensIsRefused() throws {
        var object = try ManifestEdits.object("export_qwen35_state")
        XCTAssertNoThrow(try PipelineWiring(manifest: ManifestEdits.decode(object)))
        try ManifestEdits.editFunction(&object, "chunk_0", "decode") { f in
            let inputs = try XCTUnwrap(f["inputs"] as? [[String: Any]])
            f["inputs"] = inputs.filter { $0["name"] as? String != TensorNames.windowTokens }
        }
        XCTAssertThrowsError(try PipelineWiring(manifest: ManifestEdits.decode(object))) { error in
            XCTAssertEqual(error as? PipelineError, .unwiredInput(model: "chunk_0 (decode)", input: TensorNames.windowTokens))
        }
    }
}
