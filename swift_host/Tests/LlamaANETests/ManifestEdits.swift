import Foundation
import XCTest
@testable import LlamaANE

/// A fixture export's manifest as a JSON object, for tests that edit it and decode it again.
enum ManifestEdits {
    /// The manifest of fixture export `name`.
    static func object(_ name: String) throws -> [String: Any] {
        let url = try Fixtures.url(name).appendingPathComponent(Manifest.fileName)
        return try XCTUnwrap(JSONSerialization.jsonObject(with: Data(contentsOf: url)) as? [String: Any])
    }

    static func decode(_ object: [String: Any]) throws -> Manifest {
        try Manifest.decode(JSONSerialization.data(withJSONObject: object))
    }

    /// With `output` removed from chunk_1's decode function, the wiring must refuse the export: the
    /// host carries that chunk's `state` from it.
    static func assertCarryNeedsOutput(_ object: [String: Any], _ output: String, carrying state: String,
                                       file: StaticString = #filePath, line: UInt = #line) throws {
        var unreturned = object
        try removeOutput(&unreturned, "chunk_1", "decode", output)
        XCTAssertThrowsError(try PipelineWiring(manifest: decode(unreturned)), file: file, line: line) { error in
            XCTAssertEqual(error as? ManifestError, .inconsistent("chunk_1 (decode) does not return \(output), but its "
                + "\(state) is carried by the host from it"), file: file, line: line)
        }
    }

    /// `object` changed by `edit` must be refused by `Manifest.decode` with a `ManifestError` that
    /// holds each of `words`.
    static func assertRefused(_ object: [String: Any], _ edit: (inout [String: Any]) throws -> Void, mentioning words: [String],
                              file: StaticString = #filePath, line: UInt = #line) throws {
        var edited = object
        try edit(&edited)
        XCTAssertThrowsError(try decode(edited), file: file, line: line) { error in
            guard let error = error as? ManifestError else { return XCTFail("not a ManifestError: \(error)", file: file, line: line) }
            for word in words {
                XCTAssertTrue(error.description.contains(word), "\"\(word)\" not in: \(error)", file: file, line: line)
            }
        }
    }

    /// Sets `cache.<section>.<key>` (a missing section is an error).
    static func setCache(_ m: inout [String: Any], _ section: String, _ key: String, _ value: Any) throws {
        var cache = try XCTUnwrap(m["cache"] as? [String: Any])
        var entry = try XCTUnwrap(cache[section] as? [String: Any])
        entry[key] = value
        cache[section] = entry
        m["cache"] = cache
    }

    /// The edit that sets `cache.<section>.<key>` to `value`.
    static func cacheEdit(_ section: String, _ key: String, _ value: Any) -> (inout [String: Any]) throws -> Void {
        { try setCache(&$0, section, key, value) }
    }

    /// Gives the chunks, in order, the layers `layers`.
    static func setChunkLayers(_ m: inout [String: Any], _ layers: [[Int]]) throws {
        var chunks = try XCTUnwrap(m["chunks"] as? [[String: Any]])
        for (i, l) in layers.enumerated() { chunks[i]["layers"] = l }
        m["chunks"] = chunks
    }

    /// Edits function `function` of model `model` with `body`.
    static func editFunction(_ m: inout [String: Any], _ model: String, _ function: String,
                             _ body: (inout [String: Any]) throws -> Void) throws {
        var models = try XCTUnwrap(m["models"] as? [String: Any])
        var entry = try XCTUnwrap(models[model] as? [String: Any])
        var functions = try XCTUnwrap(entry["functions"] as? [String: Any])
        var f = try XCTUnwrap(functions[function] as? [String: Any])
        try body(&f)
        functions[function] = f
        entry["functions"] = functions
        models[model] = entry
        m["models"] = models
    }

    /// Removes the output `name` of function `function` of model `model`.
    static func removeOutput(_ m: inout [String: Any], _ model: String, _ function: String, _ name: String) throws {
        try editFunction(&m, model, function) { f in
            let outputs = try XCTUnwrap(f["outputs"] as? [[String: Any]])
            f["outputs"] = outputs.filter { $0["name"] as? String != name }
        }
    }

    /// Removes `cache.<section>`.
    static func removeCache(_ m: inout [String: Any], _ section: String) throws {
        var cache = try XCTUnwrap(m["cache"] as? [String: Any])
        cache[section] = nil
        m["cache"] = cache
    }
}


/// A generator over a scripted predictor shaped as a fixture export (its context, prefill window
/// and `rewindLimit`) that always predicts token 3, recording the windows it is asked to run: for
/// tests of where a next prompt starts again.
final class RecordingGenerator: @unchecked Sendable {
    var windows: [TokenWindow] = []  // one generation runs at a time, one window after the other
    private(set) var generator: Generator!

    init(_ manifest: Manifest, rewindLimit: Int?) {
        let predictor = ClosurePredictor(contextLength: manifest.contextLength, prefillLength: manifest.prefillLength,
                                         rewindLimit: rewindLimit) { [unowned self] window in
            self.windows.append(window)
            var logits = [Float](repeating: 0, count: 8)
            logits[3] = 1
            return logits
        }
        generator = Generator(predictor: predictor, eosTokenIds: [])
    }
}
