import Foundation
import XCTest
@testable import LlamaANE

/// One `Generator` keeps its KV cache across generations: a prompt reuses the longest common prefix
/// with the cached tokens and prefills only the rest, and the tokens stay those of a full recompute.
final class GeneratorCacheReuseTests: XCTestCase {
    private let vocab = 50

    /// Generates `prompt` on a new generator and cache: what any reuse must reproduce.
    private func fromEmptyCache(_ prompt: [Int], maxNewTokens: Int, sampling: SamplingParameters) async throws -> [Int] {
        let model = FakeModel.CachePredictor(contextLength: 128, prefillLength: 8, vocab: vocab)
        let (tokens, stats) = try await Generator(predictor: model, eosTokenIds: [])
            .generateAll(prompt: prompt, maxNewTokens: maxNewTokens, sampling: sampling)
        XCTAssertEqual(stats.reusedTokens, 0)
        XCTAssertEqual(model.windows.filter { $0.phase == .prefill }.first?.position, 0)
        return tokens
    }

    func testAPromptExtendingTheCachePrefillsOnlyItsNewTokens() async throws {
        for sampling in [SamplingParameters.greedy, SamplingParameters(temperature: 0.9, topK: 12, seed: 3)] {
            let model = FakeModel.CachePredictor(contextLength: 128, prefillLength: 8, vocab: vocab)
            let generator = Generator(predictor: model, eosTokenIds: [])
            let first = (0..<13).map { 4 + ($0 * 7) % 40 }
            let (reply, stats1) = try await generator.generateAll(prompt: first, maxNewTokens: 6, sampling: sampling)
            XCTAssertEqual([stats1.reusedTokens, stats1.prefilledTokens], [0, 13])
            // The last sampled token was never fed.
            XCTAssertEqual(generator.cachedTokens, first + reply.dropLast())

            model.windows = []
            let second = first + reply + [7, 8, 9, 10, 11]
            let (tokens, stats) = try await generator.generateAll(prompt: second, maxNewTokens: 6, sampling: sampling)
            let cached = first.count + reply.count - 1
            XCTAssertEqual(stats.promptTokens, second.count)
            XCTAssertEqual(stats.reusedTokens, cached)
            XCTAssertEqual(stats.prefilledTokens, 6, "the reply's last token and the 5 new ones")
            XCTAssertEqual(model.tokensRun(.prefill), 6)
            XCTAssertEqual(model.windows.filter { $0.phase == .prefill }.map(\.position), [cached])
            XCTAssertEqual(model.tokensRun(.decode), 5)
            XCTAssertEqual(tokens, FakeModel.reference(prompt: second, maxNewTokens: 6, sampling: sampling, vocab: vocab, eos: nil))
            let fresh = try await fromEmptyCache(second, maxNewTokens: 6, sampling: sampling)
            XCTAssertEqual(tokens, fresh)
            XCTAssertEqual(generator.cachedTokens, second + tokens.dropLast())
            XCTAssertEqual(model.failures, [])
        }
    }

    func testAPromptDivergingFromTheCacheKeepsOnlyTheCommonPrefix() async throws {
        let model = FakeModel.CachePredictor(contextLength: 64, prefillLength: 8, vocab: vocab)
        let generator = Generator(predictor: model, eosTokenIds: [])
        let first = Array(10..<30)
        _ = try await generator.generateAll(prompt: first, maxNewTokens: 4)

        // Shares 11 tokens with the cache, then diverges.
        model.windows = []
        let second = Array(first[..<11]) + [44, 45, 46]
        let (tokens, stats) = try await generator.generateAll(prompt: second, maxNewTokens: 5)
        XCTAssertEqual([stats.reusedTokens, stats.prefilledTokens], [11, 3])
        XCTAssertEqual(model.windows.filter { $0.phase == .prefill }.map(\.position), [11])
        XCTAssertEqual(model.tokensRun(.prefill), 3)
        XCTAssertEqual(tokens, FakeModel.reference(prompt: second, maxNewTokens: 5, sampling: .greedy, vocab: vocab, eos: nil))
        let fresh = try await fromEmptyCache(second, maxNewTokens: 5, sampling: .greedy)
        XCTAssertEqual(tokens, fresh)
        XCTAssertEqual(generator.cachedTokens, second + tokens.dropLast())

        // The same prompt again: everything is cached but its last token, which must run for logits.
        model.windows = []
        let (again, repeated) = try await generator.generateAll(prompt: second, maxNewTokens: 5)
        XCTAssertEqual(again, tokens)
        XCTAssertEqual([repeated.reusedTokens, repeated.prefilledTokens], [second.count - 1, 1])
        XCTAssertEqual(model.windows.filter { $0.phase == .prefill }.map(\.position), [second.count - 1])

        // Nothing in common: starts over at position 0.
        model.windows = []
        let third = [30, 31, 32]
        let (other, unrelated) = try await generator.generateAll(prompt: third, maxNewTokens: 5)
        XCTAssertEqual([unrelated.reusedTokens, unrelated.prefilledTokens], [0, 3])
        XCTAssertEqual(model.windows.filter { $0.phase == .prefill }.map(\.position), [0])
        XCTAssertEqual(other, FakeModel.reference(prompt: third, maxNewTokens: 5, sampling: .greedy, vocab: vocab, eos: nil))
        XCTAssertEqual(model.failures, [])
    }

    func testAnEndOfSequenceTokenIsNotFedBack() async throws {
        let eos = 3
        let model = FakeModel.CachePredictor(contextLength: 256, prefillLength: 4, vocab: vocab, eos: eos)
        let generator = Generator(predictor: model, eosTokenIds: [eos])
        let prompt = [5, 6, 7]
        let (tokens, stats) = try await generator.generateAll(prompt: prompt, maxNewTokens: 200)
        XCTAssertEqual(stats.stopReason, .eos)
        XCTAssertEqual(generator.cachedTokens, prompt + tokens.dropLast())
        XCTAssertFalse(generator.cachedTokens.contains(eos))
    }

    func testAFailedModelCallForgetsTheCachedTokens() async throws {
        struct Broken: Error {}
        let inner = FakeModel.CachePredictor(contextLength: 64, prefillLength: 4, vocab: vocab)
        var failNext = false
        let model = ClosurePredictor(contextLength: 64, prefillLength: 4) { window in
            if failNext { failNext = false; throw Broken() }
            return try await inner.predict(window)
        }
        let generator = Generator(predictor: model, eosTokenIds: [])
        let prompt = Array(10..<19)
        let (reply, _) = try await generator.generateAll(prompt: prompt, maxNewTokens: 3)
        failNext = true
        do {
            _ = try await generator.generateAll(prompt: prompt + reply + [1], maxNewTokens: 3)
            XCTFail("the model call was to fail")
        } catch is Broken {}
        XCTAssertEqual(generator.cachedTokens, [], "a failed call may have lost K/V: nothing is trusted")

        inner.windows = []
        let (tokens, stats) = try await generator.generateAll(prompt: prompt + reply + [1], maxNewTokens: 3)
        XCTAssertEqual(stats.reusedTokens, 0)
        XCTAssertEqual(inner.windows.first?.position, 0)
        XCTAssertEqual(tokens, FakeModel.reference(prompt: prompt + reply + [1], maxNewTokens: 3, sampling: .greedy, vocab: vocab, eos: nil))
        XCTAssertEqual(inner.failures, [])
    }

    func testAGenerationWaitsForACancelledOneToLeaveTheModel() async throws {
        final class Calls: @unchecked Sendable {
            private let lock = NSLock()
            private var running = 0
            private(set) var overlapped = false
            func enter() { lock.lock(); running += 1; overlapped = overlapped || running > 1; lock.unlock() }
            func leave() { lock.lock(); running -= 1; lock.unlock() }
        }
        let calls = Calls()
        let inner = FakeModel.CachePredictor(contextLength: 256, prefillLength: 8, vocab: vocab)
        // A model call that takes a while and, like a Core ML prediction, runs to its end when cancelled.
        let model = ClosurePredictor(contextLength: 256, prefillLength: 8) { window in
            calls.enter()
            defer { calls.leave() }
            _ = await Task.detached { try? await Task.sleep(nanoseconds: 5_000_000) }.value
            return try await inner.predict(window)
        }
        let generator = Generator(predictor: model, eosTokenIds: [])
        let first = Array(10..<21)
        var received = 0
        for try await event in generator.generate(prompt: first, maxNewTokens: 100) {
            if case .token = event { received += 1 }
            if received == 3 { break }
        }
        // Started at once, while the first generation may still be in a model call. Tokens past the
        // vocabulary are never sampled, so exactly the first prompt is in common.
        let second = first + [60, 61]
        let (tokens, stats) = try await generator.generateAll(prompt: second, maxNewTokens: 6)
        XCTAssertEqual(stats.reusedTokens, first.count)
        XCTAssertEqual(tokens, FakeModel.reference(prompt: second, maxNewTokens: 6, sampling: .greedy, vocab: vocab, eos: nil))
        XCTAssertEqual(generator.cachedTokens, second + tokens.dropLast())
        XCTAssertEqual(inner.failures, [])
        XCTAssertFalse(calls.overlapped, "two generations were in the model at once")
    }

    func testResetCacheStartsOver() async throws {
        let model = FakeModel.CachePredictor(contextLength: 64, prefillLength: 8, vocab: vocab)
        let generator = Generator(predictor: model, eosTokenIds: [])
        let prompt = Array(10..<20)
        _ = try await generator.generateAll(prompt: prompt, maxNewTokens: 3)
        try await generator.resetCache()
        XCTAssertEqual(generator.cachedTokens, [])
        XCTAssertEqual(model.cache, [])
        let (_, stats) = try await generator.generateAll(prompt: prompt, maxNewTokens: 3)
        XCTAssertEqual(stats.reusedTokens, 0)
    }

    func testCacheStateRewindsAndFindsTheReusablePrefix() throws {
        var cache = KVCacheState(capacity: 16, prefillLength: 4)
        try cache.prefillWindows([1, 2, 3, 4, 5, 6]).forEach { cache.commit($0) }
        XCTAssertEqual(cache.tokens, [1, 2, 3, 4, 5, 6])
        XCTAssertEqual(cache.reusablePrefix(of: [1, 2, 3, 9]), 3)
        XCTAssertEqual(cache.reusablePrefix(of: [1, 2, 3, 4, 5, 6, 7]), 6)
        XCTAssertEqual(cache.reusablePrefix(of: [1, 2, 3]), 2, "the last prompt token always runs")
        XCTAssertEqual(cache.reusablePrefix(of: [7, 2]), 0)
        XCTAssertEqual(cache.reusablePrefix(of: []), 0)
        cache.rewind(to: 3)
        XCTAssertEqual(cache.tokens, [1, 2, 3])
        XCTAssertEqual([cache.position, cache.remaining], [3, 13])
        XCTAssertEqual(try cache.prefillWindows([8, 9]), [TokenWindow(phase: .prefill, tokens: [8, 9, 0, 0], count: 2, position: 3)])
    }
}

/// `ContextOverflow.shift`: a generation that outgrows the context keeps its first tokens and the
/// most recent ones and goes on, on a cache that prefills only what it does not hold.
final class ContextShiftTests: XCTestCase {
    private let vocab = 50

    func testDecodingPastTheContextShiftsAndKeepsTheFirstAndTheMostRecentTokens() async throws {
        let model = FakeModel.CachePredictor(contextLength: 32, prefillLength: 8, vocab: vocab)
        let generator = Generator(predictor: model, eosTokenIds: [])
        let prompt = (0..<20).map { 3 + ($0 * 5) % 40 }
        let (tokens, stats) = try await generator.generateAll(prompt: prompt, maxNewTokens: 40, overflow: .shift(keep: 4))
        XCTAssertEqual(tokens.count, 40, "generation went on past the 32-token context")
        XCTAssertGreaterThanOrEqual(stats.shifts, 2)
        XCTAssertEqual(model.failures, [])
        // what the cache holds: the first 4 prompt tokens, then the most recent ones, in order
        let history = prompt + tokens.dropLast()
        let cached = generator.cachedTokens
        XCTAssertEqual(Array(cached.prefix(4)), Array(prompt.prefix(4)))
        XCTAssertEqual(Array(cached.dropFirst(4)), Array(history.suffix(cached.count - 4)))
        XCTAssertLessThanOrEqual(cached.count, 32)
        // each shift kept the first 4 positions: no window ran below position 4 after the prompt
        let afterPrompt = model.windows.dropFirst(3)
        XCTAssertTrue(afterPrompt.allSatisfy { $0.position >= 4 }, "\(afterPrompt.map(\.position))")
        // the same with .stop ends at the context
        let stopping = Generator(predictor: FakeModel.CachePredictor(contextLength: 32, prefillLength: 8, vocab: vocab),
                                 eosTokenIds: [])
        let (stopped, stoppedStats) = try await stopping.generateAll(prompt: prompt, maxNewTokens: 40)
        XCTAssertEqual(stoppedStats.stopReason, .context)
        XCTAssertEqual(stoppedStats.shifts, 0)
        XCTAssertEqual(stopped.count, 32 - 20 + 1, "the cache filled, and the last token was not fed back")
    }

    func testAPromptLongerThanTheContextIsShiftedBeforeItRuns() async throws {
        let model = FakeModel.CachePredictor(contextLength: 32, prefillLength: 8, vocab: vocab)
        let generator = Generator(predictor: model, eosTokenIds: [])
        let prompt = (0..<50).map { 3 + ($0 * 7) % 40 }
        let (tokens, stats) = try await generator.generateAll(prompt: prompt, maxNewTokens: 3, overflow: .shift(keep: 6))
        let kept = Array(prompt.prefix(6)) + Array(prompt.suffix(13))  // limit 6 + (32 - 6) / 2 = 19
        XCTAssertEqual(stats.shifts, 1)
        XCTAssertEqual(stats.promptTokens, kept.count)
        XCTAssertEqual(Array(generator.cachedTokens.prefix(kept.count)), kept)
        XCTAssertEqual(tokens, FakeModel.reference(prompt: kept, maxNewTokens: 3, sampling: .greedy, vocab: vocab, eos: nil))
        XCTAssertThrowsError(try KVCacheState(capacity: 32, prefillLength: 8).shifted(prompt, keep: 31))
    }
}
