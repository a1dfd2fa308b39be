import Foundation
import XCTest
@testable import LlamaANE

/// Call order of the chunked pipeline with a recording backend in place of Core ML.
final class ChunkedPipelineTests: XCTestCase {
    actor Log {
        var events: [String] = []
        func add(_ e: String) { events.append(e) }
    }

    /// A backend whose cache updates are slow; it records every call.
    final class RecordingBackend: PipelineBackend, @unchecked Sendable {
        typealias Activations = [Int]
        let chunkCount = 3
        let log = Log()
        let updateDelay: UInt64

        init(updateDelayNanoseconds: UInt64) { updateDelay = updateDelayNanoseconds }

        func embed(_ window: TokenWindow, bucket: Int) async throws -> [Int] {
            await log.add("embed \(window.phase.rawValue)@\(window.position)")
            return window.tokens.map(Int.init)
        }

        func runChunk(_ index: Int, _ input: [Int], phase: Phase, bucket: Int) async throws -> [Int] {
            await log.add("chunk \(index)")
            return input.map { $0 + 1 }
        }

        func updateCache(_ index: Int, phase: Phase, bucket: Int, position: Int) async throws {
            await log.add("update \(index) start @\(position)")
            try await Task.sleep(nanoseconds: updateDelay)
            await log.add("update \(index) end")
        }

        func logits(_ input: [Int], phase: Phase, column: Int) async throws -> [Float] {
            await log.add("lm_head column \(column)")
            return [Float(input[column])]
        }

        func resetCaches() async throws { await log.add("reset") }
    }

    func testChunksRunInOrderAndWaitForTheirOwnCacheUpdate() async throws {
        let backend = RecordingBackend(updateDelayNanoseconds: 20_000_000)
        let pipeline = ChunkedPipeline(backend: backend, contextLength: 32, prefillLength: 4)
        let first = try await pipeline.predict(TokenWindow(phase: .prefill, tokens: [5, 6, 0, 0], count: 2, position: 0))
        XCTAssertEqual(first, [9], "3 chunks add 3 to token 6, the last real one")
        _ = try await pipeline.predict(TokenWindow(phase: .decode, tokens: [7], count: 1, position: 2))
        try await pipeline.finishUpdates()
        let events = await backend.log.events

        // The stages of a window run in manifest order.
        let compute = events.filter { !$0.hasPrefix("update") }
        XCTAssertEqual(compute, ["embed prefill@0", "chunk 0", "chunk 1", "chunk 2", "lm_head column 1",
                                 "embed decode@2", "chunk 0", "chunk 1", "chunk 2", "lm_head column 0"])
        // Updates run in the background: chunk 1 starts before chunk 0's update has ended.
        let chunk1 = try XCTUnwrap(events.firstIndex(of: "chunk 1"))
        let update0End = try XCTUnwrap(events.firstIndex(of: "update 0 end"))
        XCTAssertLessThan(chunk1, update0End)
        // ...but a chunk never runs again before its previous update has finished.
        for i in 0..<3 {
            let runs = events.indices.filter { events[$0] == "chunk \(i)" }
            let ends = events.indices.filter { events[$0] == "update \(i) end" }
            XCTAssertEqual(runs.count, 2)
            XCTAssertTrue(ends.contains { $0 > runs[0] && $0 < runs[1] }, "chunk \(i) ran before its cache update finished")
        }
        XCTAssertTrue(events.contains("update 2 start @2"), "decode updates write at the window's position")
    }

    func testFailedUpdateSurfacesOnTheNextWait() async throws {
        struct Boom: Error {}
        let queue = CacheUpdateQueue()
        await queue.submit(0) { throw Boom() }
        do {
            try await queue.wait(0)
            XCTFail("expected the update's error")
        } catch is Boom {}
        try await queue.wait(0)  // the failed update is consumed
    }
}
