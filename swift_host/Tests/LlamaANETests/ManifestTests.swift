import Foundation
import XCTest
@testable import LlamaANE

/// Manifest decoding on a real export of the tiny model, and refusal of tampered copies.
final class ManifestTests: XCTestCase {
    private var scratch: URL!

    override func setUpWithError() throws {
        scratch = FileManager.default.temporaryDirectory.appendingPathComponent("llama-ane-manifest-\(UUID().uuidString)")
        try FileManager.default.createDirectory(at: scratch, withIntermediateDirectories: true)
    }

    override func tearDownWithError() throws {
        try? FileManager.default.removeItem(at: scratch)
    }

    /// A private copy of the exported folder that a test may damage.
    private func copyOfExport() throws -> URL {
        let copy = scratch.appendingPathComponent("export")
        try FileManager.default.copyItem(at: try Fixtures.url("export"), to: copy)
        return copy
    }

    /// Rewrites the copy's manifest.json through `edit`.
    private func editManifest(_ folder: URL, _ edit: (inout [String: Any]) -> Void) throws {
        let url = folder.appendingPathComponent("manifest.json")
        var object = try XCTUnwrap(try JSONSerialization.jsonObject(with: Data(contentsOf: url)) as? [String: Any])
        edit(&object)
        try JSONSerialization.data(withJSONObject: object).write(to: url)
    }

    private func assertRefused(_ folder: URL, verifyHashes: Bool = false, as expected: ManifestError,
                               file: StaticString = #filePath, line: UInt = #line) {
        XCTAssertThrowsError(try Manifest.load(from: folder, verifyHashes: verifyHashes), file: file, line: line) { error in
            XCTAssertEqual(error as? ManifestError, expected, file: file, line: line)
        }
    }

    func testRealExportDecodesAndMatchesItsHashes() throws {
        let folder = try Fixtures.url("export")
        let manifest = try Manifest.load(from: folder, verifyHashes: true)
        XCTAssertEqual(manifest.formatVersion, 1)
        XCTAssertGreaterThan(manifest.contextLength, 0)
        XCTAssertEqual(manifest.chunks.flatMap(\.layers).sorted(), Array(0..<manifest.config.numHiddenLayers))
        XCTAssertEqual(manifest.lmHead.vocabSplits.reduce(0, +), manifest.config.vocabSize)

        // Shapes the pipeline relies on, read from the manifest rather than assumed.
        let prefill = try manifest.function("embeddings", "prefill")
        XCTAssertEqual(prefill.input("input_ids")?.shape, [1, manifest.prefillLength])
        let mask = try XCTUnwrap(prefill.output("mask"))
        XCTAssertEqual(mask.shape, [1, 1, manifest.prefillLength, manifest.contextLength + manifest.prefillLength])
        for chunk in manifest.chunks {
            let decode = try manifest.function(chunk.model, "decode")
            XCTAssertEqual(decode.input("k_cache")?.shape,
                           [chunk.layers.count, manifest.cache.channels, 1, manifest.contextLength])
            let update = try manifest.function("cache_update", try XCTUnwrap(chunk.cacheUpdate["decode"]))
            XCTAssertNotNil(update.output("k_cache_out"))
        }

        // The exporter's special tokens are the tokenizer's.
        let tokenizer = try Tokenizer(directory: folder)
        XCTAssertFalse(manifest.tokenizer.specialTokens.isEmpty)
        for (token, id) in manifest.tokenizer.specialTokens {
            XCTAssertEqual(tokenizer.tokenId(token), id, token)
        }
    }

    func testWrongFormatVersionIsRefused() throws {
        let folder = try copyOfExport()
        try editManifest(folder) { $0["format_version"] = 2 }
        assertRefused(folder, as: .unsupportedFormatVersion(found: 2, supported: [1]))
        XCTAssertTrue(ManifestError.unsupportedFormatVersion(found: 2, supported: [1]).description.contains("Re-export"))
    }

    func testDotDotPathIsRefused() throws {
        let folder = try copyOfExport()
        try editManifest(folder) { m in
            var files = m["files"] as? [String: Any] ?? [:]
            files["../outside.bin"] = String(repeating: "0", count: 64)
            m["files"] = files
        }
        assertRefused(folder, as: .unsafePath("../outside.bin"))
    }

    func testAbsolutePathInAFunctionIsRefused() throws {
        let folder = try copyOfExport()
        try editManifest(folder) { m in
            var models = m["models"] as! [String: Any]
            var lmHead = models["lm_head"] as! [String: Any]
            var functions = lmHead["functions"] as! [String: Any]
            var decode = functions["decode"] as! [String: Any]
            decode["file"] = "/etc/lm_head.mlpackage"
            functions["decode"] = decode
            lmHead["functions"] = functions
            models["lm_head"] = lmHead
            m["models"] = models
        }
        assertRefused(folder, as: .unsafePath("/etc/lm_head.mlpackage"))
    }

    func testMissingFileIsRefused() throws {
        let folder = try copyOfExport()
        let manifest = try Manifest.load(from: folder)
        let victim = try XCTUnwrap(manifest.chunks.last?.model)
        let file = try manifest.function(victim, "decode").file
        try FileManager.default.removeItem(at: folder.appendingPathComponent(file))
        assertRefused(folder, as: .missingFile(file))
    }

    func testModifiedFileFailsHashCheck() throws {
        let folder = try copyOfExport()
        let tokenizerURL = folder.appendingPathComponent("tokenizer.json")
        var data = try Data(contentsOf: tokenizerURL)
        data.append(contentsOf: Array(" ".utf8))
        try data.write(to: tokenizerURL)
        XCTAssertNoThrow(try Manifest.load(from: folder, verifyHashes: false))
        assertRefused(folder, verifyHashes: true, as: .hashMismatch("tokenizer.json"))
    }

    func testMissingManifestAndBadJSON() throws {
        assertRefused(scratch, as: .missingManifest(folder: scratch.path))
        try Data("{\"format_version\": 1, \"name\": 3}".utf8).write(to: scratch.appendingPathComponent("manifest.json"))
        XCTAssertThrowsError(try Manifest.load(from: scratch)) { error in
            guard case .invalidJSON? = error as? ManifestError else { return XCTFail("\(error)") }
        }
    }

    func testResolveRefusesUnsafeNames() throws {
        let folder = URL(fileURLWithPath: "/models/tiny")
        XCTAssertEqual(try Manifest.resolve("chunk_0.mlpackage", in: folder).path, "/models/tiny/chunk_0.mlpackage")
        for bad in ["", "/abs", "../up", "a/../../b", "a\\b", "a//b", "./a"] {
            XCTAssertThrowsError(try Manifest.resolve(bad, in: folder), bad) { error in
                XCTAssertEqual(error as? ManifestError, .unsafePath(bad))
            }
        }
    }

    func testSHA256KnownAnswers() {
        XCTAssertEqual(SHA256.hex(Data()), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855")
        XCTAssertEqual(SHA256.hex(Data("abc".utf8)), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad")
        let million = Data(repeating: UInt8(ascii: "a"), count: 1_000_000)
        XCTAssertEqual(SHA256.hex(million), "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0")
    }
}
