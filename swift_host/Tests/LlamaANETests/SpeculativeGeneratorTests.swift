import XCTest
@testable import LlamaANE

/// Speculative decoding in the `Generator` against a fake model with a verify function: the same
/// tokens as plain decoding, only accepted tokens in the cache, and the decoder's bookkeeping.
final class SpeculativeGeneratorTests: XCTestCase {
    private let vocab = 10

    private func model(context: Int = 128, window: Int = 8) -> FakeTreeModel.TreePredictor {
        FakeTreeModel.TreePredictor(contextLength: context, prefillLength: 8, verifyWindow: window, vocab: vocab)
    }

    func testGreedySpeculativeOutputEqualsPlainGreedyDecoding() async throws {
        for (prompt, draftTokens) in [([1, 2, 3, 1, 2, 3, 1, 2], nil), ([4, 5, 4, 6, 4, 5], 3), ([7], 1), (Array(0..<10), 7)] as [([Int], Int?)] {
            let fake = model()
            let generator = Generator(predictor: fake, eosTokenIds: [])
            let options = SpeculativeDecoding.promptLookup(draftTokens: draftTokens, adaptive: false)
            let (tokens, stats) = try await generator.generateAll(prompt: prompt, maxNewTokens: 40, speculative: options)
            XCTAssertEqual(tokens, FakeTreeModel.reference(prompt: prompt, maxNewTokens: 40, vocab: vocab), "prompt \(prompt)")
            XCTAssertEqual(fake.problems, [])
            let spec = try XCTUnwrap(stats.speculative)
            XCTAssertGreaterThan(spec.verifySteps, 0)
            XCTAssertGreaterThan(spec.acceptedTokens, 0, "the cycling text should let prompt lookup hit")
            XCTAssertGreaterThan(spec.tokensPerStep, 1)
            XCTAssertLessThanOrEqual(spec.acceptedTokens, spec.draftedTokens)
            // One generated token per plain step, per verify step, and per accepted draft (the
            // first comes from the prompt's logits).
            XCTAssertEqual(spec.decodeSteps + spec.verifySteps + spec.acceptedTokens, tokens.count - 1 + rewound(fake, stats))
            XCTAssertTrue(fake.verified.allSatisfy { $0.count - 1 <= (draftTokens ?? 7) })
            // The cache holds what plain decoding would have fed: the prompt and all but the last token.
            XCTAssertEqual(generator.cachedTokens, prompt + tokens.dropLast())
            XCTAssertEqual(Array(fake.cache.prefix(generator.cachedTokens.count)), generator.cachedTokens)
        }
    }

    /// Accepted tokens that were cached past the last generated token (generation ended on a draft).
    private func rewound(_ fake: FakeTreeModel.TreePredictor, _ stats: GenerationStats) -> Int {
        fake.cache.count - (stats.promptTokens + stats.generatedTokens - 1)
    }

    func testOnlyTheAcceptedPathReachesTheCacheAtTheTreePosition() async throws {
        let fake = model()
        let generator = Generator(predictor: fake, eosTokenIds: [])
        let prompt = [1, 2, 3, 1, 2, 3, 1, 2]
        _ = try await generator.generateAll(prompt: prompt, maxNewTokens: 30, speculative: .promptLookup(adaptive: false))
        XCTAssertEqual(fake.problems, [])
        let accepted = fake.writes.filter(\.accepted)
        XCTAssertEqual(accepted.count, fake.verified.count, "one accept per verified tree")
        var rejectedSomewhere = false
        for (write, window) in zip(accepted, fake.verified) {
            XCTAssertEqual(write.position, window.position)
            // The tokens written are one root-to-node path of the tree, root first.
            let tokens = Array(window.tokens.prefix(window.count)).map(Int.init)
            XCTAssertEqual(write.tokens.first, tokens[0])
            XCTAssertLessThanOrEqual(write.tokens.count, window.count)
            rejectedSomewhere = rejectedSomewhere || write.tokens.count < window.count
        }
        XCTAssertTrue(rejectedSomewhere, "some tree should have tokens that never reach the cache")
        // Every cached token is the model's own greedy choice after the tokens before it.
        for end in prompt.count..<generator.cachedTokens.count {
            let history = Array(generator.cachedTokens.prefix(end))
            XCTAssertEqual(generator.cachedTokens[end], Sampler.argmax(FakeTreeModel.logits(history, vocab: vocab)))
        }
    }

    func testEndingOnAnAcceptedDraftRewindsTheDraftsAfterIt() async throws {
        for maxNewTokens in 2...12 {
            let fake = model()
            let generator = Generator(predictor: fake, eosTokenIds: [])
            let prompt = [4, 5, 4, 6, 4, 5, 4, 6, 4]
            let (tokens, _) = try await generator.generateAll(prompt: prompt, maxNewTokens: maxNewTokens,
                                                              speculative: .promptLookup(adaptive: false))
            XCTAssertEqual(tokens, FakeTreeModel.reference(prompt: prompt, maxNewTokens: maxNewTokens, vocab: vocab))
            XCTAssertEqual(generator.cachedTokens, prompt + tokens.dropLast(), "max \(maxNewTokens)")
            // The next generation continues on that cache and still equals plain decoding.
            let next = prompt + tokens
            let (more, stats) = try await generator.generateAll(prompt: next, maxNewTokens: 6, speculative: .promptLookup(adaptive: false))
            XCTAssertEqual(stats.reusedTokens, next.count - 1)
            XCTAssertEqual(more, FakeTreeModel.reference(prompt: next, maxNewTokens: 6, vocab: vocab))
            XCTAssertEqual(fake.problems, [])
        }
    }

    func testEndOfSequenceAndAFullContextFinishAsPlainDecodingDoes() async throws {
        let prompt = [1, 2, 3, 1, 2, 3, 1, 2]
        let plain = FakeTreeModel.reference(prompt: prompt, maxNewTokens: 40, vocab: vocab)
        let eos = plain[9]
        let fake = model()
        let (tokens, stats) = try await Generator(predictor: fake, eosTokenIds: [eos])
            .generateAll(prompt: prompt, maxNewTokens: 40, speculative: .promptLookup(adaptive: false))
        XCTAssertEqual(tokens, Array(plain.prefix(through: plain.firstIndex(of: eos)!)))
        XCTAssertEqual(stats.stopReason, .eos)

        let small = model(context: 20)
        let generator = Generator(predictor: small, eosTokenIds: [])
        let (full, fullStats) = try await generator.generateAll(prompt: prompt, maxNewTokens: 40, speculative: .promptLookup(adaptive: false))
        let (plainFull, plainStats) = try await Generator(predictor: model(context: 20), eosTokenIds: [])
            .generateAll(prompt: prompt, maxNewTokens: 40)
        XCTAssertEqual(fullStats.stopReason, .context)
        XCTAssertEqual(plainStats.stopReason, .context)
        XCTAssertEqual(full, plainFull)
        XCTAssertEqual(generator.cachedTokens.count, 20)
        XCTAssertEqual(small.problems, [])
    }

    func testSpeculativeDecodingIsRefusedBeforeAnyModelCall() async throws {
        let plain = FakeModel.CachePredictor(contextLength: 64, prefillLength: 8, vocab: vocab)
        do {
            _ = try await Generator(predictor: plain, eosTokenIds: []).generateAll(prompt: [1, 2], maxNewTokens: 4, speculative: .promptLookup())
            XCTFail("a predictor without a verify function cannot decode speculatively")
        } catch {
            XCTAssertEqual(error as? GenerationError, .noVerifyWindow)
        }
        XCTAssertTrue(plain.windows.isEmpty)
        for bad in [0, 8] {
            let fake = model(window: 8)
            do {
                _ = try await Generator(predictor: fake, eosTokenIds: []).generateAll(prompt: [1, 2], maxNewTokens: 4,
                                                                                      speculative: .promptLookup(draftTokens: bad))
                XCTFail("\(bad) draft tokens do not fit a window of 8")
            } catch {
                XCTAssertEqual(error as? GenerationError, .draftTokensOutOfRange(bad, verifyWindow: 8))
            }
            XCTAssertTrue(fake.writes.isEmpty)
        }
    }

    /// A chain of k copies of the root, each node with chance `chance`.
    private struct RepeatDrafter: Drafter {
        var chance = 1.0

        func draft(_ tokens: [Int], k: Int) -> DraftTree {
            var tree = DraftTree(root: tokens[tokens.count - 1])
            for _ in 0..<k { tree.add(tree.tokens[0], under: tree.count - 1, confidence: chance) }
            return tree
        }
    }

    func testExpectedTokensOfATree() {
        var tree = DraftTree(root: 1)
        let a = tree.add(2, under: 0, confidence: 0.9)
        tree.add(3, under: a, confidence: 0.9)
        tree.add(4, under: 0, confidence: 0.05)
        XCTAssertEqual(tree.expectedTokens, 1 + 0.9 + 0.81 + 0.05, accuracy: 1e-12)
        XCTAssertEqual(DraftTree(root: 1).expectedTokens, 1)
    }

    func testStepTimesRule() {
        var times = MeasuredStepTimes()
        XCTAssertFalse(times.worthVerifying(expected: 5), "no plain step measured yet")
        times.plain(seconds: 0.1)
        times.plain(seconds: 0.3)
        XCTAssertEqual(times.plainSeconds ?? .nan, 0.2, accuracy: 1e-12)
        XCTAssertNil(times.verifySeconds)
        XCTAssertTrue(times.worthVerifying(expected: 1.01), "a window not measured yet: try one")
        XCTAssertFalse(times.worthVerifying(expected: 1))
        times.verify(seconds: 0.5)
        times.verify(seconds: 0.7)
        XCTAssertEqual(times.verifySeconds ?? .nan, 0.6, accuracy: 1e-12)  // a window costs 3 plain steps
        XCTAssertTrue(times.worthVerifying(expected: 3.1))
        XCTAssertFalse(times.worthVerifying(expected: 2.9))
    }

    func testTheDecoderVerifiesOnlyTreesWorthAWindow() throws {
        let text = [1, 2, 3]
        for (chance, verified) in [(0.9, true), (0.5, false)] {  // 3.1 and 1.9 tokens expected of 4 nodes
            var first = try SpeculativeDecoder(SpeculativeDecoding(drafter: RepeatDrafter(chance: chance), draftTokens: 4),
                                               sampling: .greedy, verifyWindow: 16)
            XCTAssertEqual(first.tree(after: text, room: 50).count, 1, "the first step is a plain one, to measure it")
            let options = SpeculativeDecoding(drafter: RepeatDrafter(chance: chance), draftTokens: 4,
                                              times: FixedStepTimes(plain: 0.1, verify: 0.3))
            var decoder = try SpeculativeDecoder(options, sampling: .greedy, verifyWindow: 16)
            XCTAssertEqual(decoder.tree(after: text, room: 50).count, verified ? 5 : 1, "chance \(chance)")
            XCTAssertEqual(decoder.tree(after: text, room: 0).count, 1, "nothing is drafted without room")
        }
        var fixed = try SpeculativeDecoder(SpeculativeDecoding(drafter: RepeatDrafter(chance: 0.01), adaptive: false),
                                           sampling: .greedy, verifyWindow: 16)
        XCTAssertEqual(fixed.tree(after: text, room: 50).count, 16, "without adaptive, every drafted tree in full")
    }

    func testTheDecoderMeasuresBothSteps() throws {
        var decoder = try SpeculativeDecoder(.promptLookup(), sampling: .greedy, verifyWindow: 16)
        var expected = MeasuredStepTimes()
        var tree = DraftTree(root: 2)
        tree.add(3, under: 0)
        tree.add(4, under: 1)
        for (plain, verify) in [(0.01, 0.012), (0.012, 0.02), (0.011, 0.013)] {
            decoder.recordDecode(seconds: plain)
            expected.plain(seconds: plain)
            decoder.recordVerify(seconds: verify, tree: tree, path: [0, 1])
            expected.verify(seconds: verify)
        }
        XCTAssertEqual(decoder.times as? MeasuredStepTimes, expected)
        XCTAssertNotEqual(expected, MeasuredStepTimes())
        XCTAssertEqual([decoder.stats.verifySteps, decoder.stats.draftedTokens, decoder.stats.acceptedTokens], [3, 6, 3])
        XCTAssertEqual(decoder.stats.tokensPerStep, 2, accuracy: 1e-12)
    }
}
