import Foundation
import XCTest
@testable import LlamaANE

/// The verify function through `ChunkedPipeline`, over a backend that simulates the exported
/// functions on token ids: each chunk keeps its own cache, written only by its background cache
/// updates (a window's at its position, an accepted tree's at its slots), and reads it as the real
/// one would. A tree node's logits are those of its own history, so a wrong mask, depth, position
/// or slot changes them, or shows in the caches.
final class VerifyPipelineTests: XCTestCase {
    static let vocab = 10

    final class SimulatedVerifyBackend: VerifyBackend, @unchecked Sendable {
        struct Activations {
            var histories: [[Int]] = []
            var window: TokenWindow?
            var tree: TreeWindow?
        }

        let chunkCount = 3
        let contextLength: Int
        let verifyWindow: Int
        private let lock = NSLock()
        private var caches: [[Int?]]
        private var lastRun: [Activations]
        private(set) var events: [String] = []
        var problems: [String] = []

        init(contextLength: Int, verifyWindow: Int) {
            self.contextLength = contextLength
            self.verifyWindow = verifyWindow
            caches = Array(repeating: Array(repeating: nil, count: contextLength), count: 3)
            lastRun = Array(repeating: Activations(), count: 3)
        }

        private func locked<T>(_ body: () -> T) -> T { lock.lock(); defer { lock.unlock() }; return body() }

        /// Chunk `index`'s cache positions below `count`, every one of which must hold a token.
        func cached(_ index: Int, _ count: Int) -> [Int] {
            locked {
                let slice = caches[index][0..<count]
                if slice.contains(where: { $0 == nil }) { problems.append("chunk \(index) read an unwritten cache position") }
                return slice.map { $0 ?? -1 }
            }
        }

        /// What chunk `index`'s cache holds, written or not.
        func cache(_ index: Int) -> [Int?] { locked { caches[index] } }

        func embed(_ window: TokenWindow, bucket: Int) async throws -> Activations { Activations(window: window) }

        func embedTree(_ window: TreeWindow) async throws -> Activations { Activations(tree: window) }

        func runChunk(_ index: Int, _ input: Activations, phase: Phase, bucket: Int) async throws -> Activations {
            var x = input
            var histories: [[Int]]
            if let w = x.window {
                let base = cached(index, w.position)
                histories = (0..<w.tokens.count).map { base + w.tokens[...$0].map(Int.init) }
            } else if let t = x.tree, phase == .verify {
                let base = cached(index, t.position)
                var seen: [String] = []
                histories = (0..<t.width).map { FakeTreeModel.visibleHistory(t, column: $0, cached: base, problems: &seen) }
                locked { problems += seen }
            } else {
                throw PipelineError.unwiredInput(model: "chunk_\(index)", input: phase.rawValue)
            }
            if index > 0, histories != x.histories { locked { problems.append("chunk \(index) saw another history than chunk 0") } }
            x.histories = histories
            locked {
                lastRun[index] = x
                events.append("chunk \(index) \(phase.rawValue)")
            }
            return x
        }

        func updateCache(_ index: Int, phase: Phase, bucket: Int, position: Int) async throws {
            try await Task.sleep(nanoseconds: 2_000_000)
            locked {
                guard let w = lastRun[index].window, w.position == position else { return problems.append("update without its window") }
                for (k, t) in w.tokens.enumerated() where position + k < contextLength { caches[index][position + k] = Int(t) }
                events.append("update \(index)")
            }
        }

        func acceptTree(_ index: Int, slots: [Int32]) async throws {
            try await Task.sleep(nanoseconds: 2_000_000)
            locked {
                guard let t = lastRun[index].tree else { return problems.append("accept without a verified tree") }
                for (column, slot) in slots.enumerated() where slot >= 0 { caches[index][Int(slot)] = Int(t.tokens[column]) }
                events.append("accept \(index)")
            }
        }

        func logits(_ input: Activations, phase: Phase, column: Int) async throws -> [Float] {
            FakeTreeModel.logits(input.histories[column], vocab: VerifyPipelineTests.vocab)
        }

        func treeLogits(_ input: Activations, count: Int) async throws -> [[Float]] {
            (0..<count).map { FakeTreeModel.logits(input.histories[$0], vocab: VerifyPipelineTests.vocab) }
        }

        func resetCaches() async throws {
            locked { caches = caches.map { $0.map { _ in nil } } }
        }
    }

    func testTreeLogitsAreEachNodesOwnHistoryAndOnlyTheAcceptedPathIsWritten() async throws {
        let backend = SimulatedVerifyBackend(contextLength: 40, verifyWindow: 8)
        let pipeline = ChunkedPipeline(backend: backend, contextLength: 40, prefillLength: 4)
        var state = pipeline.emptyCache()
        let prompt = [1, 2, 3, 4, 5, 6]
        for window in try state.prefillWindows(prompt) {
            _ = try await pipeline.predict(window)
            state.commit(window)
        }
        try await pipeline.finishUpdates()
        let before = (0..<3).map { backend.cache($0) }  // the prefill's padding lies past the prompt
        var tree = DraftTree(root: 7)
        let a = tree.add(8, under: 0)
        let b = tree.add(9, under: a)
        tree.add(3, under: a)
        let c = tree.add(4, under: 0)
        tree.add(5, under: c)
        let window = TreeWindow(tree: tree, position: state.position, width: 8)
        let logits = try await pipeline.verify(window)
        XCTAssertEqual(logits.count, tree.count)
        for node in 0..<tree.count {
            let own = prompt + tree.path(to: node).map { tree.tokens[$0] }
            XCTAssertEqual(logits[node], FakeTreeModel.logits(own, vocab: Self.vocab), "node \(node)")
        }
        try await pipeline.finishUpdates()
        XCTAssertEqual((0..<3).map { backend.cache($0) }, before, "a verify run wrote the cache")

        try await pipeline.accept(window, path: [0, a, b])
        try await pipeline.finishUpdates()
        for i in 0..<3 {
            let cache = backend.cache(i)
            XCTAssertEqual(cache.prefix(prompt.count + 3).compactMap { $0 }, prompt + [7, 8, 9], "chunk \(i)")
            XCTAssertEqual(cache[(prompt.count + 3)...], before[i][(prompt.count + 3)...], "chunk \(i): a rejected token reached the cache")
        }
        // The next window reads the accepted path (and waits for its chunk's accept first).
        let after = try await pipeline.predict(TokenWindow(phase: .decode, tokens: [2], count: 1, position: prompt.count + 3))
        XCTAssertEqual(after, FakeTreeModel.logits(prompt + [7, 8, 9, 2], vocab: Self.vocab))
        XCTAssertEqual(backend.problems, [])
        let events = backend.events
        for i in 0..<3 {
            let accept = try XCTUnwrap(events.firstIndex(of: "accept \(i)"))
            let next = try XCTUnwrap(events.lastIndex(of: "chunk \(i) decode"))
            XCTAssertLessThan(accept, next, "chunk \(i) ran before its accepted tree was written")
        }
    }

    func testGreedySpeculativeGenerationOverThePipelineEqualsPlainDecoding() async throws {
        for (prompt, draftTokens) in [([1, 2, 3, 1, 2, 3, 1, 2], nil), ([4, 5, 4, 6, 4, 5, 4], 3)] as [([Int], Int?)] {
            let backend = SimulatedVerifyBackend(contextLength: 64, verifyWindow: 8)
            let pipeline = ChunkedPipeline(backend: backend, contextLength: 64, prefillLength: 4)
            let generator = Generator(predictor: pipeline, eosTokenIds: [])
            let (tokens, stats) = try await generator.generateAll(prompt: prompt, maxNewTokens: 30,
                                                                  speculative: .promptLookup(draftTokens: draftTokens, adaptive: false))
            XCTAssertEqual(tokens, FakeTreeModel.reference(prompt: prompt, maxNewTokens: 30, vocab: Self.vocab))
            XCTAssertGreaterThan(stats.speculative?.acceptedTokens ?? 0, 0)
            try await pipeline.finishUpdates()
            let cached = generator.cachedTokens
            for i in 0..<3 { XCTAssertEqual(backend.cache(i).prefix(cached.count).compactMap { $0 }, cached, "chunk \(i)") }
            XCTAssertEqual(backend.problems, [])
        }
    }

    func testAStateCachePipelineHasNoVerifyWindow() async throws {
        let backend = SimulatedVerifyBackend(contextLength: 16, verifyWindow: 8)
        let pipeline = ChunkedPipeline(backend: backend, contextLength: 16, prefillLength: 4, cacheInStates: true)
        XCTAssertEqual(pipeline.verifyWindow, 0)
        do {
            _ = try await pipeline.verify(TreeWindow(tree: DraftTree(root: 1), position: 0, width: 8))
            XCTFail("expected noVerifyWindow")
        } catch {
            XCTAssertEqual(error as? GenerationError, .noVerifyWindow)
        }
    }
}
