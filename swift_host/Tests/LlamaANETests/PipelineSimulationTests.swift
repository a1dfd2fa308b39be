import Foundation
import XCTest
@testable import LlamaANE

/// `ChunkedPipeline` over a backend that simulates the exported functions on token ids: each chunk
/// keeps its own cache, written only by its (slow, background) cache update, and a chunk reads its
/// cache as the real one would: the first T positions of it for a function of context bucket T, its
/// cache update writing back only those. Any ordering, position or bucket mistake changes the
/// history a step sees, hence the logits, hence the tokens.
final class PipelineSimulationTests: XCTestCase {
    static let vocab = 48
    static let eos = 5

    final class SimulatedBackend: BranchBackend, @unchecked Sendable {
        struct Activations {
            var position = 0
            var tokens: [Int] = []
            var histories: [[Int]] = []  // per column (window) or per slot (branches)
            var active: [Bool] = []
            var suffixPositions: [Int] = []
        }

        let chunkCount = 3
        let contextLength: Int
        let branchWidth: Int
        let suffixLength: Int
        let buckets: ContextBuckets
        private let lock = NSLock()
        private var prefix: [[Int?]]
        private var suffix: [[[Int?]]]
        private var newTokens: [[Int]]
        private var newPosition: [Int]
        var problems: [String] = []
        /// Chunk 0's calls: the function run and the cache positions it was given; its cache updates
        /// ("update <function>") and the positions they wrote back.
        var calls: [(function: String, width: Int)] = []

        init(contextLength: Int, branchWidth: Int, suffixLength: Int, buckets: [Int]? = nil) {
            self.buckets = ContextBuckets(buckets ?? [contextLength], contextLength: contextLength)
            self.contextLength = contextLength
            self.branchWidth = branchWidth
            self.suffixLength = suffixLength
            prefix = Array(repeating: Array(repeating: nil, count: contextLength), count: 3)
            suffix = Array(repeating: Array(repeating: Array(repeating: nil, count: suffixLength), count: branchWidth), count: 3)
            newTokens = Array(repeating: [], count: 3)
            newPosition = Array(repeating: 0, count: 3)
        }

        private func locked<T>(_ body: () -> T) -> T { lock.lock(); defer { lock.unlock() }; return body() }

        /// A chunk's view of the first `width` cache positions: every position below `count` must hold a token.
        private func cached(_ chunk: Int, _ count: Int, width: Int) -> [Int] {
            locked {
                if count > width { problems.append("chunk \(chunk) reads \(count) cached tokens from a cache of \(width)") }
                let slice = prefix[chunk][0..<min(count, width)]
                if slice.contains(where: { $0 == nil }) { problems.append("chunk \(chunk) read an unwritten cache position") }
                return slice.map { $0 ?? -1 }
            }
        }

        private func check(_ chunk: Int, _ x: inout Activations, _ histories: [[Int]]) {
            if chunk == 0 { x.histories = histories } else if x.histories != histories {
                locked { problems.append("chunk \(chunk) saw another history than chunk 0") }
            }
        }

        func embed(_ window: TokenWindow, bucket: Int) async throws -> Activations {
            Activations(position: window.position, tokens: window.tokens.map(Int.init), histories: [],
                        active: (0..<window.tokens.count).map { $0 < window.count })
        }

        func runChunk(_ index: Int, _ input: Activations, phase: Phase, bucket: Int) async throws -> Activations {
            var x = input
            let function = buckets.functionName(phase, bucket: bucket)  // traps on a bucket the export lacks
            let base = cached(index, x.position, width: bucket)
            let real = x.active.filter { $0 }.count
            if x.position + real > bucket { locked { problems.append("\(function) holds no window ending at \(x.position + real)") } }
            let histories = (0..<x.tokens.count).map { base + x.tokens[...$0] }
            check(index, &x, histories)
            locked {
                newTokens[index] = x.tokens; newPosition[index] = x.position
                if index == 0 { calls.append((function, bucket)) }
            }
            return x
        }

        func updateCache(_ index: Int, phase: Phase, bucket: Int, position: Int) async throws {
            try await Task.sleep(nanoseconds: 2_000_000)
            locked {
                if newPosition[index] != position { problems.append("update at \(position) for a window at \(newPosition[index])") }
                // The update's outputs are the bucket's first positions; the host writes back those only.
                for (k, t) in newTokens[index].enumerated() where position + k < bucket { prefix[index][position + k] = t }
                if index == 0 { calls.append(("update " + buckets.functionName(phase, bucket: bucket), bucket)) }
            }
        }

        func logits(_ input: Activations, phase: Phase, column: Int) async throws -> [Float] {
            FakeModel.logits(input.histories[column], vocab: PipelineSimulationTests.vocab, eos: PipelineSimulationTests.eos)
        }

        func resetCaches() async throws {
            locked {
                prefix = prefix.map { $0.map { _ in nil } }
                suffix = suffix.map { $0.map { $0.map { _ in nil } } }
            }
        }

        func embedBranches(_ step: BranchStep) async throws -> Activations {
            Activations(position: step.prefixLength, tokens: step.tokens.map(Int.init), histories: [],
                        active: step.active, suffixPositions: step.suffixPositions)
        }

        func runBranchChunk(_ index: Int, _ input: Activations) async throws -> Activations {
            var x = input
            let base = cached(index, x.position, width: contextLength)  // cascades run at the whole context
            let histories: [[Int]] = (0..<branchWidth).map { b in
                guard x.active[b] else { return [] }
                let own = locked { suffix[index][b][0..<x.suffixPositions[b]] }
                if own.contains(where: { $0 == nil }) { locked { problems.append("chunk \(index) slot \(b) read an unwritten suffix position") } }
                return base + own.map { $0 ?? -1 } + [x.tokens[b]]
            }
            check(index, &x, histories)
            locked { newTokens[index] = x.tokens }
            return x
        }

        func updateSuffix(_ index: Int, suffixPositions: [Int32]) async throws {
            try await Task.sleep(nanoseconds: 2_000_000)
            locked {
                for (b, p) in suffixPositions.enumerated() where Int(p) < suffixLength { suffix[index][b][Int(p)] = newTokens[index][b] }
            }
        }

        func branchLogits(_ input: Activations) async throws -> [[Float]] {
            (0..<branchWidth).map { b in
                input.active[b] ? FakeModel.logits(input.histories[b], vocab: PipelineSimulationTests.vocab, eos: PipelineSimulationTests.eos)
                    : [Float](repeating: 0, count: PipelineSimulationTests.vocab)
            }
        }

        func resetSuffixes() async throws {
            locked { suffix = suffix.map { $0.map { $0.map { _ in nil } } } }
        }
    }

    func testGeneratorOverThePipelineMatchesFullRecompute() async throws {
        let backend = SimulatedBackend(contextLength: 48, branchWidth: 2, suffixLength: 8)
        let pipeline = ChunkedPipeline(backend: backend, contextLength: 48, prefillLength: 8)
        let generator = Generator(predictor: pipeline, eosTokenIds: [Self.eos])
        for (prompt, sampling) in [(Array(10..<29), SamplingParameters.greedy), (Array(30..<33), SamplingParameters(temperature: 0.9, topK: 12, seed: 4))] {
            let (tokens, _) = try await generator.generateAll(prompt: prompt, maxNewTokens: 16, sampling: sampling)
            XCTAssertEqual(tokens, FakeModel.reference(prompt: prompt, maxNewTokens: 16, sampling: sampling, vocab: Self.vocab, eos: Self.eos))
        }
        XCTAssertEqual(backend.problems, [])
    }

    func testTurnsOverThePipelineReuseTheCacheAndMatchFullRecompute() async throws {
        let backend = SimulatedBackend(contextLength: 64, branchWidth: 2, suffixLength: 8)
        let pipeline = ChunkedPipeline(backend: backend, contextLength: 64, prefillLength: 8)
        let generator = Generator(predictor: pipeline, eosTokenIds: [Self.eos])
        let first = Array(10..<29)
        let (reply, _) = try await generator.generateAll(prompt: first, maxNewTokens: 6)
        // A second turn extends the first; a third diverges inside the first prompt, so its windows
        // land on positions whose stale K/V (from the later tokens) the chunks must not read.
        let second = first + reply + [40, 41, 42]
        let third = Array(first[..<5]) + [43, 44]
        for (prompt, reused) in [(second, first.count + reply.count - 1), (third, 5)] {
            let (tokens, stats) = try await generator.generateAll(prompt: prompt, maxNewTokens: 6)
            XCTAssertEqual(stats.reusedTokens, reused)
            XCTAssertEqual(tokens, FakeModel.reference(prompt: prompt, maxNewTokens: 6, sampling: .greedy, vocab: Self.vocab, eos: Self.eos))
        }
        XCTAssertEqual(backend.problems, [])
    }

    func testCascadeOverThePipelineEqualsEachBranchAlone() async throws {
        let backend = SimulatedBackend(contextLength: 48, branchWidth: 3, suffixLength: 10)
        let pipeline = ChunkedPipeline(backend: backend, contextLength: 48, prefillLength: 8)
        let prefix = Array(10..<21)
        let requests = (0..<7).map { i in
            BranchRequest(forcedTokens: i % 2 == 0 ? [] : [40 + i, 41], sampling: SamplingParameters(temperature: 1, seed: UInt64(i)),
                          maxNewTokens: [3, 12, 20, 1, 9, 20, 6][i])
        }
        let results = try await pipeline.decodeBranches(prefix: prefix, branches: requests, eosTokenIds: [Self.eos])
        let expected = requests.map { FakeModel.decodeAlone(prefix: prefix, $0, suffixCapacity: 10, vocab: Self.vocab, eos: Self.eos) }
        XCTAssertEqual(results, expected)
        XCTAssertEqual(backend.problems, [])
    }
}
