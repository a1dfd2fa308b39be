import Foundation
import XCTest
@testable import LlamaANE

/// Manifest decoding on a real export of the tiny model and on a split variant of its manifest, and
/// refusal of tampered copies.
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
    private func copyOfExport(_ name: String = "export") throws -> URL {
        let copy = scratch.appendingPathComponent(name)
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
        XCTAssertEqual(manifest.formatVersion, 2)
        XCTAssertGreaterThan(manifest.contextLength, 0)
        XCTAssertEqual(manifest.chunks.flatMap(\.layers).sorted(), Array(0..<manifest.config.numHiddenLayers))
        XCTAssertEqual(manifest.lmHead.vocabSplits.reduce(0, +), manifest.config.vocabSize)
        // The tiny table and head fit one file each.
        XCTAssertEqual(manifest.embeddings.models, ["embeddings"])
        XCTAssertEqual(manifest.embeddings.vocabRanges, [[0, manifest.config.vocabSize]])
        XCTAssertEqual(manifest.lmHead.models, ["lm_head"])

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

    func testTheVerifyFunctionAndItsCacheUpdateAreReadByName() throws {
        let manifest = try Manifest.load(from: Fixtures.url("export"))
        let w = try XCTUnwrap(manifest.verifyWindow)
        XCTAssertGreaterThan(w, 1)
        for name in manifest.embeddings.models + manifest.lmHead.models + manifest.chunks.map(\.model) {
            XCTAssertNoThrow(try manifest.function(name, Phase.verify.rawValue), name)
        }
        for chunk in manifest.chunks {
            let update = try manifest.function("cache_update", try XCTUnwrap(chunk.cacheUpdate[Phase.verify.rawValue]))
            XCTAssertEqual(update.input(TensorNames.slots), Manifest.TensorSpec(name: "slots", shape: [w], dtype: "int32"))
            XCTAssertEqual(update.output(TensorNames.kCacheOut)?.shape, [chunk.layers.count, manifest.cache.channels, 1, manifest.contextLength])
            XCTAssertEqual(try manifest.function(chunk.model, "verify").output("k_new")?.shape, [chunk.layers.count, manifest.cache.channels, 1, w])
        }
        XCTAssertEqual(try manifest.function("lm_head", "verify").output("logits_0")?.shape, [1, manifest.config.vocabSize, 1, w])
        // A state export has none.
        let state = try Manifest.load(from: Fixtures.url("export_state"))
        XCTAssertEqual(state.verifyWindow ?? 0, 0)
        XCTAssertFalse(PipelineWiring.phases(of: state).contains(.verify))
    }

    func testAnIncompleteVerifyFunctionIsRefused() throws {
        let noUpdate = try copyOfExport("no-update")
        try editManifest(noUpdate) { m in
            var chunks = m["chunks"] as? [[String: Any]] ?? []
            var updates = chunks[0]["cache_update"] as? [String: Any] ?? [:]
            updates["verify"] = nil
            chunks[0]["cache_update"] = updates
            m["chunks"] = chunks
        }
        assertRefused(noUpdate, as: .inconsistent("chunk chunk_0 names no verify cache update"))
        let wrongWindow = try copyOfExport("wrong-window")
        let w = try XCTUnwrap(try Manifest.load(from: Fixtures.url("export")).verifyWindow)
        try editManifest(wrongWindow) { $0["verify_window"] = w / 2 }
        assertRefused(wrongWindow, as: .inconsistent("embeddings (verify) must take depths of shape [\(w / 2)] for verify_window \(w / 2), not [\(w)]"))
        // Without a verify window the functions are not needed (nor read).
        let none = try copyOfExport("no-window")
        try editManifest(none) { $0["verify_window"] = 0 }
        XCTAssertFalse(PipelineWiring.phases(of: try Manifest.load(from: none)).contains(.verify))
    }

    func testWrongFormatVersionIsRefused() throws {
        let folder = try copyOfExport()
        try editManifest(folder) { $0["format_version"] = 1 }
        assertRefused(folder, as: .unsupportedFormatVersion(found: 1, supported: [2, 4]))
        XCTAssertTrue(ManifestError.unsupportedFormatVersion(found: 1, supported: [2, 4]).description.contains("Re-export"))
        XCTAssertTrue(ManifestError.unsupportedFormatVersion(found: 1, supported: [2, 4]).description.contains("reads 2 and 4"))
        try editManifest(folder) { $0["format_version"] = 5 }
        assertRefused(folder, as: .unsupportedFormatVersion(found: 5, supported: [2, 4]))
        // 3 (the prefill window decoding with masks the embeddings made) is retired: see PrefillWindowTests
    }

    func testFormatVersion1IsRefusedBeforeItsMissingSectionsAreRead() throws {
        // A version 1 manifest has no "embeddings" section and no lm_head "models": the version is
        // what gets reported, not a missing field.
        let data = try SplitManifest.data { m in
            m["format_version"] = 1
            m["embeddings"] = nil
            m["lm_head"] = ["vocab_splits": (m["lm_head"] as? [String: Any])?["vocab_splits"] ?? []]
        }
        XCTAssertThrowsError(try Manifest.decode(data)) { error in
            XCTAssertEqual(error as? ManifestError, .unsupportedFormatVersion(found: 1, supported: [2, 4]))
        }
    }

    // MARK: Split embeddings and LM head

    private func assertDecodeRefused(_ data: Data, as reason: String, file: StaticString = #filePath, line: UInt = #line) {
        XCTAssertThrowsError(try Manifest.decode(data), file: file, line: line) { error in
            XCTAssertEqual(error as? ManifestError, .inconsistent(reason), file: file, line: line)
        }
    }

    func testSplitEmbeddingsAndLMHeadDecode() throws {
        let (size, half) = try SplitManifest.vocab()
        let manifest = try Manifest.decode(SplitManifest.data())
        XCTAssertEqual(manifest.formatVersion, 2)
        XCTAssertEqual(manifest.embeddings.models, ["embeddings", "embeddings_1"])
        XCTAssertEqual(manifest.embeddings.vocabRanges, [[0, half], [half, size]])
        XCTAssertEqual(manifest.lmHead.models, ["lm_head", "lm_head_1"])
        XCTAssertEqual(manifest.lmHead.vocabSplits, [half, size - half])
        for phase in Phase.allCases.map(\.rawValue) {
            let first = try manifest.function("embeddings", phase)
            let part = try manifest.function("embeddings_1", phase)
            XCTAssertEqual(part.file, "embeddings_1.mlpackage")
            XCTAssertEqual(part.inputs.map(\.name), ["input_ids", "hidden_states"])
            XCTAssertEqual(part.input("input_ids"), first.input("input_ids"))
            XCTAssertEqual(part.output("hidden_states_out")?.shape, first.output("hidden_states")?.shape)
            XCTAssertEqual(try manifest.function("lm_head", phase).outputs.map(\.name), ["logits_0"])
            XCTAssertEqual(try manifest.function("lm_head_1", phase).outputs.map(\.name), ["logits_1"])
        }
        XCTAssertTrue(manifest.namedFiles.contains("embeddings_1.mlpackage"))
        XCTAssertTrue(manifest.namedFiles.contains("lm_head_1.mlpackage"))
    }

    func testGapInVocabRangesIsRefused() throws {
        let (size, half) = try SplitManifest.vocab()
        let data = try SplitManifest.data { m in
            m["embeddings"] = ["models": ["embeddings", "embeddings_1"], "vocab_ranges": [[0, half - 10], [half, size]]]
        }
        assertDecodeRefused(data, as: "embeddings vocab_ranges [[0, \(half - 10)], [\(half), \(size)]] are not consecutive from 0: "
            + "embeddings_1 starts at \(half), not at \(half - 10)")
    }

    func testVocabRangesMustCoverTheVocabularyOncePerModel() throws {
        let (size, half) = try SplitManifest.vocab()
        let short = try SplitManifest.data { m in
            m["embeddings"] = ["models": ["embeddings", "embeddings_1"], "vocab_ranges": [[0, half], [half, size - 1]]]
        }
        assertDecodeRefused(short, as: "embeddings vocab_ranges [[0, \(half)], [\(half), \(size - 1)]] end at \(size - 1), not at vocab_size \(size)")
        let notStartingAtZero = try SplitManifest.data { m in
            m["embeddings"] = ["models": ["embeddings", "embeddings_1"], "vocab_ranges": [[1, half], [half, size]]]
        }
        assertDecodeRefused(notStartingAtZero, as: "embeddings vocab_ranges [[1, \(half)], [\(half), \(size)]] are not consecutive from 0: "
            + "embeddings starts at 1, not at 0")
        let oneRange = try SplitManifest.data { m in
            m["embeddings"] = ["models": ["embeddings", "embeddings_1"], "vocab_ranges": [[0, size]]]
        }
        assertDecodeRefused(oneRange, as: "embeddings has 2 models [\"embeddings\", \"embeddings_1\"] but 1 vocab_ranges [[0, \(size)]]")
    }

    func testMissingLogitsIsRefused() throws {
        let data = try SplitManifest.data { m in
            SplitManifest.editFunction(&m, "lm_head_1", "decode") { $0?["outputs"] = [] }
        }
        assertDecodeRefused(data, as: "no lm_head model (lm_head, lm_head_1) outputs logits_1 in decode, but vocab_splits has 2 entries")
    }

    func testDuplicateOrUnknownLogitsAreRefused() throws {
        let (_, half) = try SplitManifest.vocab()
        let twice = try SplitManifest.data { m in
            SplitManifest.editFunction(&m, "lm_head_1", "decode") { f in
                f?["outputs"] = [["name": "logits_0", "shape": [1, half, 1, 1], "dtype": "float16"]]
            }
        }
        assertDecodeRefused(twice, as: "lm_head models lm_head and lm_head_1 (decode) both output logits_0")
        let beyond = try SplitManifest.data { m in
            SplitManifest.editFunction(&m, "lm_head_1", "prefill") { f in
                var outputs = f?["outputs"] as? [[String: Any]] ?? []
                outputs[0]["name"] = "logits_2"
                f?["outputs"] = outputs
            }
        }
        assertDecodeRefused(beyond, as: "lm_head model lm_head_1 (prefill) outputs logits_2, which is not one of logits_0..logits_1 "
            + "(vocab_splits has 2 entries)")
    }

    func testEmbeddingsPartWithoutDecodeIsRefused() throws {
        let data = try SplitManifest.data { m in SplitManifest.editFunction(&m, "embeddings_1", "decode") { $0 = nil } }
        assertDecodeRefused(data, as: "model \"embeddings_1\" has no function \"decode\" (functions: decode_branches, prefill, verify)")
    }

    func testLMHeadPartWithoutDecodeBranchesIsRefusedWhenTheExportHasBranches() throws {
        let data = try SplitManifest.data { m in SplitManifest.editFunction(&m, "lm_head_1", "decode_branches") { $0 = nil } }
        assertDecodeRefused(data, as: "model \"lm_head_1\" has no function \"decode_branches\" (functions: decode, prefill, verify)")
        // Without a branch width the cascade functions are not needed.
        let noBranches = try SplitManifest.data { m in
            m["branch_width"] = 0
            SplitManifest.editFunction(&m, "lm_head_1", "decode_branches") { $0 = nil }
        }
        XCTAssertNoThrow(try Manifest.decode(noBranches))
    }

    func testUnlistedModelsAreRefused() throws {
        let missing = try SplitManifest.data { m in
            m["lm_head"] = ["models": ["lm_head", "lm_head_2"], "vocab_splits": (m["lm_head"] as? [String: Any])?["vocab_splits"] ?? []]
        }
        XCTAssertThrowsError(try Manifest.decode(missing)) { error in
            guard case let .inconsistent(reason)? = error as? ManifestError else { return XCTFail("\(error)") }
            XCTAssertTrue(reason.hasPrefix("no model \"lm_head_2\""), reason)
        }
        let twice = try SplitManifest.data { m in
            m["lm_head"] = ["models": ["lm_head", "lm_head"], "vocab_splits": (m["lm_head"] as? [String: Any])?["vocab_splits"] ?? []]
        }
        assertDecodeRefused(twice, as: "lm_head models [\"lm_head\", \"lm_head\"] name \"lm_head\" twice")
        let none = try SplitManifest.data { m in
            m["embeddings"] = ["models": [String](), "vocab_ranges": [[Int]]()]
        }
        assertDecodeRefused(none, as: "embeddings models is empty")
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
        try Data("{\"format_version\": 2, \"name\": 3}".utf8).write(to: scratch.appendingPathComponent("manifest.json"))
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
