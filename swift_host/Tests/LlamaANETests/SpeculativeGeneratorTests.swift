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

    /// A drafter without estimates: a chain of k copies of the root.
    private struct RepeatDrafter: Drafter {
        func draft(_ tokens: [Int], k: Int) -> DraftTree {
            var tree = DraftTree(root: tokens[tokens.count - 1])
            for _ in 0..<k { tree.add(tree.tokens[0], under: tree.count - 1) }
            return tree
        }
    }

    func testTreesWithoutEstimatesGrowAfterAFullAcceptanceAndShrinkAfterARejection() throws {
        var decoder = try SpeculativeDecoder(SpeculativeDecoding(drafter: RepeatDrafter(), draftTokens: 7), sampling: .greedy, verifyWindow: 16)
        XCTAssertEqual(decoder.draftLength, 4)
        var chain = DraftTree(root: 1)
        for t in 2...4 { chain.add(t, under: chain.count - 1) }
        decoder.recordVerify(seconds: 1, tree: chain, path: [0, 1, 2, 3])  // down to the leaf
        XCTAssertEqual(decoder.draftLength, 6)
        decoder.recordVerify(seconds: 1, tree: chain, path: [0, 1, 2, 3])
        XCTAssertEqual(decoder.draftLength, 7, "never past the draft tokens asked for")
        decoder.recordVerify(seconds: 1, tree: chain, path: [0, 1])
        XCTAssertEqual(decoder.draftLength, 6)
        decoder.recordDecode(seconds: 1)
        XCTAssertEqual(decoder.tree(after: [5, 5], room: 50).count, 7, "a tree of draftLength tokens")
        XCTAssertEqual(decoder.stats.verifySteps, 3)
        XCTAssertEqual(decoder.stats.draftedTokens, 9)
        XCTAssertEqual(decoder.stats.acceptedTokens, 7)
        XCTAssertEqual(decoder.stats.tokensPerStep, 10.0 / 3, accuracy: 1e-12)
        XCTAssertEqual(decoder.stats.acceptanceRate, 7.0 / 9, accuracy: 1e-12)
    }

    func testDraftingWithoutEstimatesPausesWhileVerifyStepsDoNotPay() throws {
        let options = SpeculativeDecoding(drafter: RepeatDrafter())
        var decoder = try SpeculativeDecoder(options, sampling: .greedy, verifyWindow: 16)
        let text = [1, 2, 3, 1, 2, 3, 1, 2]
        XCTAssertEqual(decoder.tree(after: text, room: 50).count, 1, "the first step is a plain one, to measure it")
        decoder.recordDecode(seconds: 1)  // a plain step: 1 token per second
        XCTAssertGreaterThan(decoder.tree(after: text, room: 50).count, 1)
        XCTAssertEqual(decoder.tree(after: text, room: 0).count, 1, "nothing is drafted without room")
        var tree = DraftTree(root: 2)
        tree.add(3, under: 0)
        for _ in 0..<3 { decoder.recordVerify(seconds: 3, tree: tree, path: [0]) }  // 1 token per 3 s
        XCTAssertTrue(decoder.pays, "four verify steps are needed to judge")
        decoder.recordVerify(seconds: 3, tree: tree, path: [0])
        XCTAssertEqual(decoder.stats.fallbacks, 1)
        XCTAssertEqual(decoder.pausedSteps, 16)
        for _ in 0..<16 { XCTAssertEqual(decoder.tree(after: text, room: 50).count, 1) }
        XCTAssertGreaterThan(decoder.tree(after: text, room: 50).count, 1, "drafting resumes after the cool-down")
        for _ in 0..<4 { decoder.recordVerify(seconds: 3, tree: tree, path: [0]) }
        XCTAssertEqual(decoder.pausedSteps, 32, "each further pause is twice as long")
        // Steps that pay keep drafting on.
        var paying = try SpeculativeDecoder(options, sampling: .greedy, verifyWindow: 16)
        paying.recordDecode(seconds: 1)
        for _ in 0..<8 { paying.recordVerify(seconds: 1, tree: tree, path: [0, 1]) }  // 2 tokens per second
        XCTAssertEqual(paying.stats.fallbacks, 0)
        // Without `adaptive` nothing pauses.
        var fixed = try SpeculativeDecoder(SpeculativeDecoding(drafter: RepeatDrafter(), adaptive: false), sampling: .greedy, verifyWindow: 16)
        fixed.recordDecode(seconds: 1)
        for _ in 0..<8 { fixed.recordVerify(seconds: 3, tree: tree, path: [0]) }
        XCTAssertEqual(fixed.stats.fallbacks, 0)
        XCTAssertEqual(fixed.tree(after: text, room: 50).count, 16, "the full draft size every time")
    }

    func testEstimatedTreesAreSizedByStepCosts() throws {
        let text = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3, 4, 1, 2, 3]
        var lookup = PromptLookupDrafter()
        let full = lookup.draft(text, k: 15)
        XCTAssertGreaterThan(full.count, 4)
        let cheap = FixedStepCosts(intercept: 1, slope: 0.01), dear = FixedStepCosts(intercept: 3, slope: 1)
        XCTAssertEqual(full.planned(by: FixedStepCosts(intercept: 1, slope: 0)), full, "with free nodes every node pays")
        XCTAssertEqual(full.planned(by: dear).count, 1, "no tree beats a plain step that costs a third of a window")
        let sized = full.planned(by: FixedStepCosts(intercept: 1.1, slope: 0.3))
        XCTAssertTrue(sized.count > 1 && sized.count < full.count, "\(sized.count) of \(full.count) nodes")
        XCTAssertEqual(sized, full.best(sized.count - 1), "the best-ranked nodes")

        var decoder = try SpeculativeDecoder(.promptLookup(costs: cheap), sampling: .greedy, verifyWindow: 16)
        XCTAssertEqual(decoder.tree(after: text, room: 50).count, 1, "the first step is a plain one")
        XCTAssertEqual(decoder.drafter as? PromptLookupDrafter, lookup, "but the drafter saw the text (it learns from it)")
        decoder.recordDecode(seconds: 1)
        XCTAssertEqual(decoder.tree(after: text + [4], room: 50), { var d = lookup; return d.draft(text + [4], k: 15) }()
                       .planned(by: cheap))
        for _ in 0..<8 { decoder.recordVerify(seconds: 30, tree: full, path: [0]) }
        XCTAssertEqual(decoder.stats.fallbacks, 0, "an estimated tree is sized by costs, never paused")
        var dearDecoder = try SpeculativeDecoder(.promptLookup(costs: dear), sampling: .greedy, verifyWindow: 16)
        dearDecoder.recordDecode(seconds: 1)
        XCTAssertEqual(dearDecoder.tree(after: text, room: 50).count, 1, "a plain step when no tree pays")
    }

    func testTheDecoderMeasuresStepCosts() throws {
        var decoder = try SpeculativeDecoder(.promptLookup(), sampling: .greedy, verifyWindow: 16)
        var expected = MeasuredStepCosts()
        var tree = DraftTree(root: 2)
        tree.add(3, under: 0)
        tree.add(4, under: 1)
        for (plain, verify) in [(0.01, 0.012), (0.012, 0.02), (0.011, 0.013)] {
            decoder.recordDecode(seconds: plain)
            expected.plain(seconds: plain)
            decoder.recordVerify(seconds: verify, tree: tree, path: [0, 1])
            expected.verify(nodes: 3, seconds: verify)
        }
        XCTAssertEqual(decoder.costs as? MeasuredStepCosts, expected)
        XCTAssertNotEqual(expected, MeasuredStepCosts())
    }
}
