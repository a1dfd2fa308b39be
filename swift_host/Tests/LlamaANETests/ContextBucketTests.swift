import Foundation
import XCTest
@testable import LlamaANE

/// Context buckets: the function names against a real bucketed export (context 1024, buckets
/// [512, 1024], prefill 64), the manifest checks, and which functions a pipeline runs, with which
/// cache widths, below and past a boundary, with the same tokens as a one-bucket run.
final class ContextBucketTests: XCTestCase {
    typealias Simulated = PipelineSimulationTests.SimulatedBackend

    func testTheNamingRuleNamesEveryFunctionOfTheBucketedExport() throws {
        let manifest = try Manifest.load(from: Fixtures.url("export_buckets"), verifyHashes: true)
        let buckets = manifest.buckets
        XCTAssertEqual(buckets.sizes, [512, 1024])
        XCTAssertEqual(buckets.contextLength, manifest.contextLength)
        let named = Set([Phase.prefill, .decode].flatMap { phase in buckets.sizes.map { buckets.functionName(phase, bucket: $0) } })
        XCTAssertEqual(named, ["prefill", "decode", "prefill_512", "decode_512"])
        for model in [manifest.embeddings.models[0]] + manifest.chunks.map(\.model) {
            XCTAssertEqual(Set(try XCTUnwrap(manifest.models[model]).functions.keys), named, model)
        }
        for model in manifest.lmHead.models {  // the LM head runs its plain functions in every bucket
            XCTAssertEqual(Set(try XCTUnwrap(manifest.models[model]).functions.keys), ["prefill", "decode"])
        }
        let s = manifest.prefillLength
        for bucket in buckets.sizes {
            for phase in [Phase.prefill, .decode] {
                let name = buckets.functionName(phase, bucket: bucket)
                XCTAssertEqual(ContextBuckets.baseFunction(name), phase.rawValue)
                XCTAssertEqual(ContextBuckets.bucket(ofFunction: name, contextLength: 1024), bucket)
                let window = phase == .prefill ? s : 1
                XCTAssertEqual(try manifest.function("embeddings", name).output("mask")?.shape, [1, 1, window, bucket + window])
                for chunk in manifest.chunks {
                    XCTAssertEqual(try manifest.function(chunk.model, name).input(TensorNames.kCache)?.shape.last, bucket)
                    let update = try XCTUnwrap(chunk.cacheUpdate[name])
                    XCTAssertEqual(ContextBuckets.bucket(ofFunction: update, contextLength: 1024), bucket, update)
                    XCTAssertEqual(try manifest.function("cache_update", update).output(TensorNames.kCacheOut)?.shape.last, bucket)
                }
            }
        }
        XCTAssertEqual(ContextBuckets.bucket(ofFunction: "decode_branches_l1", contextLength: 1024), 1024)
        XCTAssertEqual(ContextBuckets.bucket(ofFunction: "verify_l3", contextLength: 1024), 1024)
        XCTAssertEqual(ContextBuckets.baseFunction("decode_branches"), "decode_branches")
        // One wiring per phase serves every bucket.
        let wiring = try PipelineWiring(manifest: manifest)
        XCTAssertEqual(wiring.chunkInputs[.decode]?[0][TensorNames.kCache], .cache(TensorNames.kCache))
    }

    func testAnExportWithoutBucketsHasTheWholeContextAlone() throws {
        let manifest = try Manifest.load(from: Fixtures.url("export"))
        XCTAssertEqual(manifest.buckets.sizes, [manifest.contextLength])
        XCTAssertEqual(manifest.buckets.bucket(holding: 1), manifest.contextLength)
    }

    func testSmallestBucketHoldingThePositions() {
        let buckets = ContextBuckets([512, 1024, 2048], contextLength: 2048)
        XCTAssertEqual([1, 511, 512, 513, 1024, 1025, 2048].map(buckets.bucket(holding:)), [512, 512, 512, 1024, 1024, 2048, 2048])
    }

    // MARK: the manifest check

    private func bucketedManifest(_ edit: (inout [String: Any]) -> Void) throws -> Data {
        let url = try Fixtures.url("export_buckets").appendingPathComponent(Manifest.fileName)
        var m = try XCTUnwrap(JSONSerialization.jsonObject(with: Data(contentsOf: url)) as? [String: Any])
        edit(&m)
        return try JSONSerialization.data(withJSONObject: m)
    }

    private func assertInconsistent(_ data: Data, _ reason: String, file: StaticString = #filePath, line: UInt = #line) {
        XCTAssertThrowsError(try Manifest.decode(data), file: file, line: line) { error in
            XCTAssertEqual(error as? ManifestError, .inconsistent(reason), file: file, line: line)
        }
    }

    func testBucketsThatDoNotAscendToTheContextAreRefused() throws {
        for bad in [[1024, 512], [512], [512, 512, 1024], [0, 1024]] {
            assertInconsistent(try bucketedManifest { $0["context_buckets"] = bad },
                               "context_buckets \(bad) must ascend to context_length 1024")
        }
    }

    func testABucketWithoutItsFunctionsIsRefused() throws {
        assertInconsistent(try bucketedManifest { m in
            var chunks = m["chunks"] as? [[String: Any]] ?? []
            var updates = chunks[1]["cache_update"] as? [String: Any] ?? [:]
            updates["decode_512"] = nil
            chunks[1]["cache_update"] = updates
            m["chunks"] = chunks
        }, "chunk chunk_1 names no decode_512 cache update")
        // A bucket the export has no functions for (as an export without buckets would be).
        XCTAssertThrowsError(try Manifest.decode(try bucketedManifest { $0["context_buckets"] = [256, 1024] })) { error in
            XCTAssertTrue("\(error)".contains("has no function \"prefill_256\""), "\(error)")
        }
    }

    func testABucketWiredOtherwiseThanItsPhaseIsRefused() throws {
        var manifest = try Manifest.load(from: Fixtures.url("export_buckets"))
        let chunk = manifest.chunks[0].model
        let update = try XCTUnwrap(manifest.chunks[0].cacheUpdate["decode_512"])
        // The bucket's cache update takes no position: it would write the window nowhere.
        manifest.models["cache_update"]?.functions[update]?.inputs.removeAll { $0.name == TensorNames.position }
        XCTAssertThrowsError(try PipelineWiring(manifest: manifest)) { error in
            XCTAssertEqual(error as? ManifestError, .inconsistent(
                "\(chunk) (decode_512) and its cache update take other inputs than decode: "
                    + "a context bucket's functions must differ only in their cache length"))
        }
    }

    // MARK: the pipeline

    /// Prefills `prompt`, then decodes the greedy token `steps` times; returns every logits vector.
    private func run(_ pipeline: ChunkedPipeline<Simulated>, prompt: [Int], steps: Int) async throws -> [[Float]] {
        var cache = pipeline.emptyCache()
        var out: [[Float]] = []
        for window in try cache.prefillWindows(prompt) {
            out.append(try await pipeline.predict(window))
            cache.commit(window)
        }
        for _ in 0..<steps {
            let token = out[out.count - 1].indices.max { out[out.count - 1][$0] < out[out.count - 1][$1] } ?? 0
            let window = try cache.decodeWindow(token)
            out.append(try await pipeline.predict(window))
            cache.commit(window)
        }
        try await pipeline.finishUpdates()
        return out
    }

    func testWindowsRunInTheSmallestBucketThatHoldsThem() async throws {
        let backend = Simulated(contextLength: 32, branchWidth: 2, suffixLength: 8, buckets: [8, 16, 32])
        let pipeline = ChunkedPipeline(backend: backend, contextLength: 32, prefillLength: 4,
                                       buckets: backend.buckets)
        _ = try await run(pipeline, prompt: Array(10..<20), steps: 10)
        // Prefill windows end at 4, 8 and 10; decode windows at 11 ... 20: a window ending at 8 or
        // 16 stays in that bucket, one past it goes to the next.
        let expected: [(String, Int)] = [("prefill_8", 8), ("prefill_8", 8), ("prefill_16", 16)]
            + Array(repeating: ("decode_16", 16), count: 6) + Array(repeating: ("decode", 32), count: 4)
        let runs = backend.calls.filter { !$0.function.hasPrefix("update") }
        XCTAssertEqual(runs.map(\.function), expected.map(\.0))
        XCTAssertEqual(runs.map(\.width), expected.map(\.1), "each function gets its bucket's first positions")
        let updates = backend.calls.filter { $0.function.hasPrefix("update") }
        XCTAssertEqual(updates.map(\.function), expected.map { "update " + $0.0 }, "each window's update is its bucket's")
        XCTAssertEqual(updates.map(\.width), expected.map(\.1))
        XCTAssertEqual(backend.problems, [])
    }

    func testBucketedGenerationEqualsAOneBucketRun() async throws {
        var results: [[[Float]]] = []
        for buckets in [nil, [8, 16, 32], [4, 12, 32]] as [[Int]?] {
            let backend = Simulated(contextLength: 32, branchWidth: 2, suffixLength: 8, buckets: buckets)
            let pipeline = ChunkedPipeline(backend: backend, contextLength: 32, prefillLength: 4, buckets: backend.buckets)
            var logits = try await run(pipeline, prompt: Array(10..<25), steps: 14)
            // A new prompt from position 0 (a rewound cache): its windows fall back below the
            // boundaries, over caches whose later positions hold the first run's stale tokens.
            logits += try await run(pipeline, prompt: [10, 11, 12, 40, 41], steps: 20)
            XCTAssertEqual(backend.problems, [], "\(buckets ?? [])")
            results.append(logits)
        }
        XCTAssertEqual(results[1], results[0])
        XCTAssertEqual(results[2], results[0])
        let generator = Generator(predictor: ChunkedPipeline(
            backend: Simulated(contextLength: 32, branchWidth: 2, suffixLength: 8, buckets: [8, 16, 32]),
            contextLength: 32, prefillLength: 4, buckets: ContextBuckets([8, 16, 32], contextLength: 32)),
            eosTokenIds: [PipelineSimulationTests.eos])
        let prompt = Array(10..<23)
        let (tokens, _) = try await generator.generateAll(prompt: prompt, maxNewTokens: 15)
        XCTAssertEqual(tokens, FakeModel.reference(prompt: prompt, maxNewTokens: 15, sampling: .greedy,
                                                   vocab: PipelineSimulationTests.vocab, eos: PipelineSimulationTests.eos))
    }
}
