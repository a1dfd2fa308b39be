import Foundation
import XCTest
@testable import LlamaANE

/// An export whose LM head is folded into the last chunk (`lm_head.folded_into`): the real tiny
/// export is read, checked and wired with no head model, and a step over it calls no head.
final class FoldedHeadTests: XCTestCase {
    static let vocab = 40
    /// No end token: every run goes on past the first context bucket.
    static let eos: Int? = nil

    func testTheFoldedExportIsReadAndEveryFunctionOfItsLastChunkOutputsTheLogits() throws {
        let manifest = try Manifest.load(from: Fixtures.url("export_folded"), verifyHashes: true)
        let last = try XCTUnwrap(manifest.chunks.last).model
        XCTAssertEqual(manifest.lmHead.foldedInto, last)
        XCTAssertEqual(manifest.lmHead.models, [])
        XCTAssertEqual(manifest.lmHead.logitsModels, [last])
        XCTAssertFalse(manifest.models.keys.contains { $0.hasPrefix("lm_head") }, "\(manifest.models.keys.sorted())")
        let buckets = manifest.buckets
        XCTAssertEqual(buckets.sizes, [32, 64])
        let bucketed = [Phase.prefill, .decode].flatMap { phase in buckets.sizes.map { buckets.functionName(phase, bucket: $0) } }
        let named = Set(bucketed + [Phase.decodeBranches.rawValue, Phase.verify.rawValue])
        XCTAssertEqual(Set(try XCTUnwrap(manifest.models[last]).functions.keys), named)
        let splits = manifest.lmHead.vocabSplits
        for function in named {
            let f = try manifest.function(last, function)
            XCTAssertNil(f.output(TensorNames.hiddenStatesOut), function)
            let logits = f.outputs.filter { $0.name.hasPrefix(TensorNames.logitsPrefix) }
            XCTAssertEqual(logits.map(\.name), splits.indices.map { "\(TensorNames.logitsPrefix)\($0)" }, function)
            let columns = try XCTUnwrap(f.input(TensorNames.hiddenStates)).shape.last
            XCTAssertEqual(logits.map(\.shape), splits.map { [1, $0, 1, columns ?? 0] }, function)
            // the chunks before it still hand on their hidden states
            for chunk in manifest.chunks.dropLast() {
                XCTAssertNotNil(try manifest.function(chunk.model, function).output(TensorNames.hiddenStatesOut), chunk.model)
            }
        }
        let wiring = try PipelineWiring(manifest: manifest)
        XCTAssertTrue(wiring.headFolded)
        XCTAssertEqual(wiring.headModels, [])
        XCTAssertEqual(PipelineWiring.phases(of: manifest), [.prefill, .decode, .decodeBranches, .verify])
        for phase in PipelineWiring.phases(of: manifest) {
            XCTAssertEqual(wiring.logitsOutputs[phase], ["logits_0"], "\(phase)")
        }
        // The chunks are wired as in the export with a separate head: only where the logits come from differs.
        let separate = try Manifest.load(from: Fixtures.url("export"))
        let separateWiring = try PipelineWiring(manifest: separate)
        XCTAssertFalse(separateWiring.headFolded)
        XCTAssertEqual(separateWiring.headModels, ["lm_head"])
        XCTAssertEqual(wiring.chunkInputs, separateWiring.chunkInputs)
        XCTAssertEqual(wiring.updateInputs, separateWiring.updateInputs)
    }

    /// The folded export's manifest as a JSON object, to be edited into a bad one.
    private func foldedJSON() throws -> [String: Any] {
        let data = try Data(contentsOf: Fixtures.url("export_folded").appendingPathComponent(Manifest.fileName))
        return try XCTUnwrap(try JSONSerialization.jsonObject(with: data) as? [String: Any])
    }

    private func assertRefused(_ json: [String: Any], mentioning words: [String], file: StaticString = #filePath, line: UInt = #line) throws {
        let data = try JSONSerialization.data(withJSONObject: json)
        XCTAssertThrowsError(try Manifest.decode(data), file: file, line: line) { error in
            let text = "\(error)"
            XCTAssertTrue(error is ManifestError, text, file: file, line: line)
            for word in words { XCTAssertTrue(text.contains(word), "\(text) does not mention \(word)", file: file, line: line) }
        }
    }

    func testAFoldedHeadMustBeTheLastChunksAloneWithEveryLogitsOutput() throws {
        var json = try foldedJSON()
        var head = try XCTUnwrap(json["lm_head"] as? [String: Any])
        head["folded_into"] = "chunk_1"
        json["lm_head"] = head
        try assertRefused(json, mentioning: ["folded_into", "chunk_1", "chunk_2"])

        json = try foldedJSON()
        head = try XCTUnwrap(json["lm_head"] as? [String: Any])
        head["models"] = ["chunk_2"]
        json["lm_head"] = head
        try assertRefused(json, mentioning: ["both models", "folded_into"])

        // A bucket copy of the chunk that outputs no logits: the host would have none to read there.
        json = try foldedJSON()
        var models = try XCTUnwrap(json["models"] as? [String: Any])
        var chunk = try XCTUnwrap(models["chunk_2"] as? [String: Any])
        var functions = try XCTUnwrap(chunk["functions"] as? [String: Any])
        var decode32 = try XCTUnwrap(functions["decode_32"] as? [String: Any])
        let outputs = try XCTUnwrap(decode32["outputs"] as? [[String: Any]])
        decode32["outputs"] = outputs.filter { ($0["name"] as? String) != "logits_0" }
        functions["decode_32"] = decode32
        chunk["functions"] = functions
        models["chunk_2"] = chunk
        json["models"] = models
        try assertRefused(json, mentioning: ["chunk_2", "logits_0", "decode_32"])

        // logits of the wrong size
        json = try foldedJSON()
        models = try XCTUnwrap(json["models"] as? [String: Any])
        chunk = try XCTUnwrap(models["chunk_2"] as? [String: Any])
        functions = try XCTUnwrap(chunk["functions"] as? [String: Any])
        var verify = try XCTUnwrap(functions["verify"] as? [String: Any])
        verify["outputs"] = try XCTUnwrap(verify["outputs"] as? [[String: Any]]).map { spec -> [String: Any] in
            guard (spec["name"] as? String) == "logits_0" else { return spec }
            return spec.merging(["shape": [1, 7, 1, 16]]) { $1 }
        }
        functions["verify"] = verify
        chunk["functions"] = functions
        models["chunk_2"] = chunk
        json["models"] = models
        try assertRefused(json, mentioning: ["chunk_2", "logits_0", "verify", "vocab_splits[0]"])
    }

    /// A backend that simulates the exported functions on token ids, shaped by an export's wiring:
    /// with a folded head its last chunk computes the logits and no head model runs; with a separate
    /// head every head model of `wiring.headModels` runs after the chunks. It logs every call.
    final class WiredBackend: PipelineBackend, @unchecked Sendable {
        struct Activations {
            var position: Int
            var tokens: [Int]
            var histories: [[Int]] = []
            var logits: [[Float]]?
        }

        let chunkCount: Int
        let wiring: PipelineWiring
        let buckets: ContextBuckets
        private let lock = NSLock()
        private var caches: [[Int: Int]]
        private var written: [[Int]]
        var calls: [String] = []
        var problems: [String] = []

        init(manifest: Manifest) throws {
            wiring = try PipelineWiring(manifest: manifest)
            buckets = manifest.buckets
            chunkCount = manifest.chunks.count
            caches = Array(repeating: [:], count: chunkCount)
            written = Array(repeating: [], count: chunkCount)
        }

        private func locked<T>(_ body: () -> T) -> T { lock.lock(); defer { lock.unlock() }; return body() }

        func embed(_ window: TokenWindow, bucket: Int) async throws -> Activations {
            locked { calls.append("embeddings") }
            return Activations(position: window.position, tokens: window.tokens.prefix(window.count).map(Int.init))
        }

        func runChunk(_ index: Int, _ input: Activations, phase: Phase, bucket: Int) async throws -> Activations {
            var x = input
            let histories: [[Int]] = locked {
                calls.append("chunk_\(index) \(buckets.functionName(phase, bucket: bucket))")
                written[index] = x.tokens
                let cached = (0..<x.position).map { caches[index][$0] ?? -1 }
                return x.tokens.indices.map { cached + x.tokens[...$0] }
            }
            if index == 0 {
                x.histories = histories
            } else if histories != x.histories {
                locked { problems.append("chunk \(index) saw another history than chunk 0") }
            }
            if wiring.headFolded, index == chunkCount - 1 {
                x.logits = histories.map { FakeModel.logits($0, vocab: FoldedHeadTests.vocab, eos: FoldedHeadTests.eos) }
            }
            return x
        }

        func updateCache(_ index: Int, phase: Phase, bucket: Int, position: Int) async throws {
            try await Task.sleep(nanoseconds: 1_000_000)
            locked { for (k, t) in written[index].enumerated() { caches[index][position + k] = t } }
        }

        func logits(_ input: Activations, phase: Phase, column: Int) async throws -> [Float] {
            locked { calls += wiring.headModels.map { "\($0) \(phase.rawValue)" } }
            if wiring.headFolded {
                guard let logits = input.logits else {
                    locked { problems.append("no logits after the last chunk of a folded export") }
                    return []
                }
                return logits[column]
            }
            return FakeModel.logits(input.histories[column], vocab: FoldedHeadTests.vocab, eos: FoldedHeadTests.eos)
        }

        func resetCaches() async throws {
            locked { caches = Array(repeating: [:], count: chunkCount) }
        }
    }

    private func generate(_ manifest: Manifest, prompt: [Int]) async throws -> (tokens: [Int], backend: WiredBackend) {
        let backend = try WiredBackend(manifest: manifest)
        let pipeline = ChunkedPipeline(backend: backend, contextLength: manifest.contextLength, prefillLength: manifest.prefillLength,
                                       buckets: manifest.buckets)
        let generator = Generator(predictor: pipeline, eosTokenIds: [])
        let (tokens, _) = try await generator.generateAll(prompt: prompt, maxNewTokens: 24)
        try await pipeline.finishUpdates()
        return (tokens, backend)
    }

    func testAFoldedExportCallsNoHeadAndGivesTheTokensOfASeparateHead() async throws {
        let folded = try Manifest.load(from: Fixtures.url("export_folded"))
        let separate = try Manifest.load(from: Fixtures.url("export"))
        XCTAssertEqual(folded.contextLength, separate.contextLength)
        let prompt = Array(10..<21)
        let (foldedTokens, foldedRun) = try await generate(folded, prompt: prompt)
        let (separateTokens, separateRun) = try await generate(separate, prompt: prompt)
        XCTAssertEqual(foldedTokens, FakeModel.reference(prompt: prompt, maxNewTokens: 24, sampling: .greedy, vocab: Self.vocab, eos: Self.eos))
        XCTAssertEqual(foldedTokens, separateTokens)
        XCTAssertEqual(foldedRun.problems, [])
        XCTAssertEqual(separateRun.problems, [])
        // Each step: the embeddings, every chunk, and the head only when it is a model of its own.
        XCTAssertFalse(foldedRun.calls.contains { $0.hasPrefix("lm_head") }, "\(foldedRun.calls)")
        let steps = separateRun.calls.filter { $0 == "embeddings" }.count
        XCTAssertEqual(separateRun.calls.filter { $0.hasPrefix("lm_head") }.count, steps)
        XCTAssertEqual(separateRun.calls.filter { !$0.hasPrefix("lm_head") && !$0.hasPrefix("chunk") },
                       foldedRun.calls.filter { !$0.hasPrefix("chunk") })
        let order = foldedRun.calls.map { $0.split(separator: " ")[0] }
        let step = ["embeddings"] + (0..<folded.chunks.count).map { "chunk_\($0)" }
        XCTAssertEqual(order, Array(repeating: step, count: steps).flatMap { $0 }.map { Substring($0) })
        // The folded export's windows ran in both of its buckets: the logits came from each bucket's last chunk.
        XCTAssertTrue(foldedRun.calls.contains("chunk_2 decode_32"), "\(foldedRun.calls)")
        XCTAssertTrue(foldedRun.calls.contains("chunk_2 decode"), "\(foldedRun.calls)")
    }
}
