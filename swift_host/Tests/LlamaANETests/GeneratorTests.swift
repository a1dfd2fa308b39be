import Foundation
import XCTest
@testable import LlamaANE

final class GeneratorTests: XCTestCase {
    private let vocab = 50
    private let eos = 3

    func testMatchesFullRecomputeAcrossPrefillWindowsAndSeeds() async throws {
        for (promptLength, sampling) in [(1, SamplingParameters.greedy), (8, .greedy), (19, SamplingParameters(temperature: 0.8, topK: 10, seed: 5)),
                                         (20, SamplingParameters(temperature: 1.2, topP: 0.9, seed: 11))] {
            let prompt = (0..<promptLength).map { 4 + ($0 * 7) % 40 }
            let model = FakeModel.CachePredictor(contextLength: 64, prefillLength: 8, vocab: vocab)
            let generator = Generator(predictor: model, eosTokenIds: [])
            let (tokens, stats) = try await generator.generateAll(prompt: prompt, maxNewTokens: 12, sampling: sampling)
            XCTAssertEqual(model.failures, [])
            XCTAssertEqual(tokens, FakeModel.reference(prompt: prompt, maxNewTokens: 12, sampling: sampling, vocab: vocab, eos: nil))
            let prefills = model.windows.filter { $0.phase == .prefill }
            XCTAssertEqual(prefills.count, (promptLength + 7) / 8)
            XCTAssertEqual(prefills.last?.count, promptLength - 8 * (prefills.count - 1))
            XCTAssertEqual(model.windows.filter { $0.phase == .decode }.count, 11)
            XCTAssertEqual(stats.promptTokens, promptLength)
            XCTAssertEqual(stats.generatedTokens, 12)
            XCTAssertEqual(stats.stopReason, .length)
        }
    }

    func testStopsAtEndOfSequence() async throws {
        let prompt = [5, 6, 7]
        let model = FakeModel.CachePredictor(contextLength: 256, prefillLength: 4, vocab: vocab, eos: eos)
        let generator = Generator(predictor: model, eosTokenIds: [eos])
        let (tokens, stats) = try await generator.generateAll(prompt: prompt, maxNewTokens: 200)
        XCTAssertEqual(tokens.last, eos)
        XCTAssertLessThan(tokens.count, 200)
        XCTAssertEqual(stats.stopReason, .eos)
        XCTAssertEqual(tokens, FakeModel.reference(prompt: prompt, maxNewTokens: 200, sampling: .greedy, vocab: vocab, eos: eos))
    }

    func testAPromptThatDoesNotFitIsRefusedBeforeAnyModelCall() async throws {
        let model = FakeModel.CachePredictor(contextLength: 12, prefillLength: 4, vocab: vocab)
        let generator = Generator(predictor: model, eosTokenIds: [])
        do {
            _ = try await generator.generateAll(prompt: Array(repeating: 9, count: 13), maxNewTokens: 1)
            XCTFail("13 prompt tokens cannot fit 12 positions")
        } catch let error as GenerationError {
            XCTAssertEqual(error, .contextFull(position: 0, requested: 13, capacity: 12))
            XCTAssertTrue(error.description.contains("--context-length"))
        }
        XCTAssertTrue(model.windows.isEmpty)
        // Exactly full is fine: 10 prompt tokens + 2 decode steps = 12.
        let (tokens, _) = try await generator.generateAll(prompt: Array(repeating: 9, count: 10), maxNewTokens: 3)
        XCTAssertEqual(tokens.count, 3)
        XCTAssertEqual(model.failures, [])
    }

    func testFillingTheContextWhileDecodingFinishesWithContext() async throws {
        let model = FakeModel.CachePredictor(contextLength: 12, prefillLength: 4, vocab: vocab)
        let generator = Generator(predictor: model, eosTokenIds: [])
        let (streamed, stats) = try await generator.generateAll(prompt: Array(repeating: 9, count: 10), maxNewTokens: 8)
        XCTAssertEqual(stats.stopReason, .context)
        // The prefill token and two decode tokens filled positions 10 and 11; the third needs 12.
        XCTAssertEqual(streamed.count, 3)
        XCTAssertEqual(model.windows.filter { $0.phase == .decode }.map(\.position), [10, 11])
        XCTAssertEqual(model.failures, [])
    }

    func testStreamsTextWithoutBrokenCharacters() async throws {
        let tokenizer = try Tokenizer(directory: Fixtures.url("tokenizers/llama2_sentencepiece"))
        let text = "Hi 😀 naïve 日本 ok"
        let target = tokenizer.encode(text, addSpecialTokens: false)
        // A model that always predicts the next target token.
        var step = 0
        let model = ClosurePredictor(contextLength: 128, prefillLength: 4, onReset: { step = 0 }) { _ in
            var logits = [Float](repeating: 0, count: 2000)
            logits[target[min(step, target.count - 1)]] = 1
            step += 1
            return logits
        }
        let generator = Generator(predictor: model, eosTokenIds: []) { tokenizer.decode($0, skipSpecialTokens: true) }
        var ids: [Int] = [], pieces: [String] = []
        var finished: GenerationStats?
        for try await event in generator.generate(prompt: [1, 5], maxNewTokens: target.count) {
            switch event {
            case let .token(id, piece): ids.append(id); pieces.append(piece)
            case let .finished(stats): finished = stats
            }
        }
        XCTAssertEqual(ids, target)
        XCTAssertEqual(pieces.joined(), tokenizer.decode(target, skipSpecialTokens: true))
        XCTAssertFalse(pieces.contains { $0.contains("\u{FFFD}") })
        XCTAssertTrue(pieces.contains(""), "the emoji's first byte tokens should hold text back")
        XCTAssertEqual(finished?.generatedTokens, target.count)
    }

    func testLeavingTheStreamStopsGeneration() async throws {
        final class Counter: @unchecked Sendable {
            private let lock = NSLock()
            private var n = 0
            func bump() { lock.lock(); n += 1; lock.unlock() }
            var value: Int { lock.lock(); defer { lock.unlock() }; return n }
        }
        let calls = Counter()
        let model = ClosurePredictor(contextLength: 4096, prefillLength: 4) { _ in
            calls.bump()
            try await Task.sleep(nanoseconds: 1_000_000)
            return [0, 1]
        }
        let generator = Generator(predictor: model, eosTokenIds: [])
        var received = 0
        for try await event in generator.generate(prompt: [1], maxNewTokens: 2000) {
            if case .token = event { received += 1 }
            if received == 3 { break }
        }
        try await Task.sleep(nanoseconds: 100_000_000)
        let afterStop = calls.value
        try await Task.sleep(nanoseconds: 100_000_000)
        XCTAssertEqual(calls.value, afterStop, "the model kept running after the consumer left")
        XCTAssertLessThan(afterStop, 50)
    }

    func testStreamCarriesErrors() async throws {
        let model = FakeModel.CachePredictor(contextLength: 4, prefillLength: 4, vocab: vocab)
        let generator = Generator(predictor: model, eosTokenIds: [])
        do {
            for try await _ in generator.generate(prompt: [1, 2, 3, 4, 5], maxNewTokens: 1) {}
            XCTFail("expected contextFull")
        } catch {
            XCTAssertEqual(error as? GenerationError, .contextFull(position: 0, requested: 5, capacity: 4))
        }
    }

    func testCacheWindows() throws {
        var cache = KVCacheState(capacity: 10, prefillLength: 4)
        let windows = try cache.prefillWindows([1, 2, 3, 4, 5, 6])
        XCTAssertEqual(windows, [
            TokenWindow(phase: .prefill, tokens: [1, 2, 3, 4], count: 4, position: 0),
            TokenWindow(phase: .prefill, tokens: [5, 6, 0, 0], count: 2, position: 4),
        ])
        windows.forEach { cache.commit($0) }
        XCTAssertEqual(cache.position, 6)
        XCTAssertEqual(try cache.decodeWindow(7), TokenWindow(phase: .decode, tokens: [7], count: 1, position: 6))
        XCTAssertThrowsError(try cache.prefillWindows([1, 2, 3, 4, 5]))
        XCTAssertThrowsError(try cache.prefillWindows([])) { XCTAssertEqual($0 as? GenerationError, .emptyPrompt) }
        for _ in 0..<4 { cache.commit(try cache.decodeWindow(1)) }
        XCTAssertThrowsError(try cache.decodeWindow(1)) {
            XCTAssertEqual($0 as? GenerationError, .contextFull(position: 10, requested: 1, capacity: 10))
        }
    }
}
