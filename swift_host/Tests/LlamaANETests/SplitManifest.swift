import Foundation
import XCTest

/// A format_version 2 manifest whose embedding table and LM head are each cut in two files, as the
/// exporter writes them when a file would pass the 1 GB iOS limit. It is derived from the fixture
/// export's manifest.json (one embeddings and one LM head model): `embeddings_1` takes `input_ids`
/// and `hidden_states` and outputs `hidden_states_out` for the upper half of the vocabulary rows;
/// `lm_head` outputs `logits_0` and `lm_head_1` outputs `logits_1`, half the vocabulary each.
/// Only decoding uses it: the two new packages do not exist.
enum SplitManifest {
    typealias Object = [String: Any]

    /// The vocabulary size of the fixture export and where the split falls.
    static func vocab() throws -> (size: Int, half: Int) {
        let config = try XCTUnwrap(try fixture()["config"] as? Object)
        let size = try XCTUnwrap(config["vocab_size"] as? Int)
        return (size, size / 2)
    }

    /// The split manifest as JSON, after `edit`.
    static func data(_ edit: (inout Object) throws -> Void = { _ in }) throws -> Data {
        var m = try object()
        try edit(&m)
        return try JSONSerialization.data(withJSONObject: m)
    }

    /// The split manifest as a JSON object.
    static func object() throws -> Object {
        var m = try fixture()
        let (size, half) = try vocab()
        var models = try XCTUnwrap(m["models"] as? Object)
        var part: Object = [:], head0: Object = [:], head1: Object = [:]
        for (phase, value) in try functions(models, "embeddings") {
            let f = try XCTUnwrap(value as? Object)
            let ids = try spec(f, "inputs", "input_ids")
            let hidden = try spec(f, "outputs", "hidden_states")
            var hiddenOut = hidden
            hiddenOut["name"] = "hidden_states_out"
            part[phase] = ["file": "embeddings_1.mlpackage", "function_name": f["function_name"] ?? phase,
                           "inputs": [ids, hidden], "outputs": [hiddenOut]]
        }
        for (phase, value) in try functions(models, "lm_head") {
            var f = try XCTUnwrap(value as? Object)
            var logits = try spec(f, "outputs", "logits_0")
            var shape = try XCTUnwrap(logits["shape"] as? [Int])
            XCTAssertEqual(shape[1], size, "the fixture's LM head is expected in one split")
            shape[1] = half
            logits["shape"] = shape
            f["outputs"] = [logits]
            head0[phase] = f
            logits["name"] = "logits_1"
            f["outputs"] = [logits]
            f["file"] = "lm_head_1.mlpackage"
            head1[phase] = f
        }
        models["embeddings_1"] = ["functions": part]
        models["lm_head"] = ["functions": head0]
        models["lm_head_1"] = ["functions": head1]
        m["models"] = models
        m["embeddings"] = ["models": ["embeddings", "embeddings_1"], "vocab_ranges": [[0, half], [half, size]]]
        m["lm_head"] = ["models": ["lm_head", "lm_head_1"], "vocab_splits": [half, size - half]]
        var files = try XCTUnwrap(m["files"] as? Object)
        files["embeddings_1.mlpackage"] = String(repeating: "0", count: 64)
        files["lm_head_1.mlpackage"] = String(repeating: "0", count: 64)
        m["files"] = files
        return m
    }

    /// Rewrites function `phase` of `model` in `m` through `edit` (nil removes it).
    static func editFunction(_ m: inout Object, _ model: String, _ phase: String, _ edit: (inout Object?) -> Void) {
        var models = m["models"] as? Object ?? [:]
        var entry = models[model] as? Object ?? [:]
        var functions = entry["functions"] as? Object ?? [:]
        var f = functions[phase] as? Object
        edit(&f)
        functions[phase] = f
        entry["functions"] = functions
        models[model] = entry
        m["models"] = models
    }

    private static func fixture() throws -> Object {
        let url = try Fixtures.url("export").appendingPathComponent("manifest.json")
        return try XCTUnwrap(try JSONSerialization.jsonObject(with: Data(contentsOf: url)) as? Object)
    }

    private static func functions(_ models: Object, _ model: String) throws -> Object {
        try XCTUnwrap((models[model] as? Object)?["functions"] as? Object, "no model \(model) in the fixture")
    }

    private static func spec(_ function: Object, _ side: String, _ name: String) throws -> Object {
        let specs = try XCTUnwrap(function[side] as? [Object])
        return try XCTUnwrap(specs.first { $0["name"] as? String == name }, "no \(side) \(name) in the fixture")
    }
}
