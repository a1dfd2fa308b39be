import Foundation
import XCTest
@testable import LlamaANE

/// `Conversation` over the SmolLM2 tokenizer and its chat template, with the fake model: each turn
/// prefills only its new tokens and replies as a full recompute of its whole prompt would.
final class ConversationTests: XCTestCase {
    /// Ids below 300 of the SmolLM2 vocabulary: special tokens and single bytes.
    private let vocab = 300
    private let imEnd = 2

    private func smolLM2() throws -> Tokenizer {
        try Tokenizer(directory: Fixtures.url("tokenizers/smollm2"))
    }

    /// A generator over a fresh fake model that stops at <|im_end|>.
    private func makeGenerator(contextLength: Int = 512) -> (FakeModel.CachePredictor, Generator) {
        let model = FakeModel.CachePredictor(contextLength: contextLength, prefillLength: 16, vocab: vocab, eos: imEnd)
        return (model, Generator(predictor: model, eosTokenIds: [imEnd]))
    }

    func testEachTurnPrefillsOnlyItsNewTokensAndRepliesAsFromAnEmptyCache() async throws {
        let tokenizer = try smolLM2()
        let (model, generator) = makeGenerator()
        let conversation = try Conversation(generator: generator, tokenizer: tokenizer, system: "You are terse.")
        var messages = [ChatMessage(role: "system", content: "You are terse.")]
        var known: (tokens: [Int], text: String) = ([], "")  // what the conversation's ids stand for

        // The first reply stops at max tokens, so its last token was never fed and runs in the next prefill.
        let turns = [("Hello there!", 2), ("And what about the Neural Engine?", 12), ("Thanks 😀", 12), ("Bye.", 12)]
        for (turn, (text, maxNewTokens)) in turns.enumerated() {
            messages.append(ChatMessage(role: "user", content: text))
            let rendered = try tokenizer.renderChat(messages)
            // The template extends what was said: only the text after the last reply is tokenized.
            XCTAssertTrue(rendered.hasPrefix(known.text))
            let prompt = known.tokens + tokenizer.encode(String(rendered.dropFirst(known.text.count)), addSpecialTokens: false)
            if turn == 0 { XCTAssertEqual(prompt, try tokenizer.applyChatTemplate(messages)) }
            let cached = generator.cachedTokens
            XCTAssertEqual(Array(prompt.prefix(cached.count)), cached, "the cache holds a prefix of the new prompt")

            model.windows = []
            let (reply, stats) = try await conversation.sendAll(text, maxNewTokens: maxNewTokens)
            XCTAssertEqual(stats.promptTokens, prompt.count)
            XCTAssertEqual(stats.reusedTokens, cached.count)
            XCTAssertEqual(stats.prefilledTokens, prompt.count - cached.count)
            XCTAssertEqual(model.tokensRun(.prefill), prompt.count - cached.count, "turn \(turn)")
            XCTAssertEqual(model.windows.filter { $0.phase == .prefill }.first?.position, cached.count)
            XCTAssertEqual(model.tokensRun(.decode), reply.count - 1)
            if turn > 0 { XCTAssertLessThan(stats.prefilledTokens, prompt.count / 2) }

            XCTAssertEqual(reply, FakeModel.reference(prompt: prompt, maxNewTokens: maxNewTokens, sampling: .greedy, vocab: vocab, eos: imEnd))
            let (fresh, generatorFromScratch) = makeGenerator()
            let (alone, aloneStats) = try await generatorFromScratch.generateAll(prompt: prompt, maxNewTokens: maxNewTokens)
            XCTAssertEqual(reply, alone)
            XCTAssertEqual(aloneStats.reusedTokens, 0)
            XCTAssertEqual(fresh.failures, [])

            let replyIds = reply.last == imEnd ? Array(reply.dropLast()) : reply
            let replyText = tokenizer.decode(replyIds, skipSpecialTokens: true)
            messages.append(ChatMessage(role: "assistant", content: replyText))
            known = (prompt + replyIds, rendered + replyText)
            XCTAssertEqual(conversation.messages, messages)
            XCTAssertEqual(conversation.tokens, known.tokens)
            XCTAssertEqual(generator.cachedTokens, prompt + reply.dropLast())
        }
        XCTAssertEqual(model.failures, [])
    }

    func testSpeculativeTurnsReplyAsPlainTurnsDo() async throws {
        let tokenizer = try smolLM2()
        let vocab = 10  // the tree model's logits cycle, so prompt lookup finds its drafts
        var replies: [[[Int]]] = []
        for speculative in [nil, SpeculativeDecoding.promptLookup(adaptive: false)] {
            // logits cover the tokenizer's ids: prompt lookup may draft the prompt's
            let model = FakeTreeModel.TreePredictor(contextLength: 512, prefillLength: 16, verifyWindow: 8, vocab: vocab,
                                                    size: 49152)  // SmolLM2's vocabulary
            let generator = Generator(predictor: model, eosTokenIds: [])
            let conversation = try Conversation(generator: generator, tokenizer: tokenizer, system: "You are terse.")
            var turns: [[Int]] = []
            for text in ["Hello there!", "And again?"] {
                let prompt = try conversation.promptTokens(for: conversation.messages + [ChatMessage(role: "user", content: text)])
                let (reply, stats) = try await conversation.sendAll(text, maxNewTokens: 24, speculative: speculative)
                XCTAssertEqual(reply, FakeTreeModel.reference(prompt: prompt.tokens, maxNewTokens: 24, vocab: vocab))
                XCTAssertEqual(stats.speculative == nil, speculative == nil)
                if let spec = stats.speculative { XCTAssertGreaterThan(spec.acceptedTokens, 0) }
                turns.append(reply)
            }
            XCTAssertEqual(model.problems, [])
            replies.append(turns)
        }
        XCTAssertEqual(replies[0], replies[1])
    }

    func testATemplateThatRewritesEarlierTurnsKeepsTheCommonPrefix() async throws {
        let tokenizer = try smolLM2()
        // Marks the latest message, so a new turn changes the text of the previous one.
        tokenizer.chatTemplate = "{% for m in messages %}<|im_start|>{{ m['role'] }}{% if loop.last %} (latest){% endif %}\n"
            + "{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
        let (model, generator) = makeGenerator()
        let conversation = try Conversation(generator: generator, tokenizer: tokenizer, system: "Be brief.")
        _ = try await conversation.sendAll("First question, a long one.", maxNewTokens: 8)
        let cached = generator.cachedTokens

        model.windows = []
        let (reply, stats) = try await conversation.sendAll("Second.", maxNewTokens: 8)
        let prompt = try tokenizer.applyChatTemplate(Array(conversation.messages.dropLast()))  // tokenized whole
        let common = zip(cached, prompt).prefix { $0 == $1 }.count
        XCTAssertGreaterThan(common, 0)
        XCTAssertLessThan(common, cached.count)
        XCTAssertEqual(stats.reusedTokens, common)
        XCTAssertEqual(stats.prefilledTokens, prompt.count - common)
        XCTAssertEqual(model.windows.filter { $0.phase == .prefill }.first?.position, common)
        XCTAssertEqual(model.tokensRun(.prefill), prompt.count - common)
        XCTAssertEqual(reply, FakeModel.reference(prompt: prompt, maxNewTokens: 8, sampling: .greedy, vocab: vocab, eos: imEnd))
        XCTAssertEqual(model.failures, [])
    }

    func testATurnThatDoesNotFitLeavesTheConversationAndResetStartsANewOne() async throws {
        let tokenizer = try smolLM2()
        let (model, generator) = makeGenerator(contextLength: 96)
        let conversation = try Conversation(generator: generator, tokenizer: tokenizer, system: "Be brief.")
        _ = try await conversation.sendAll("Hi", maxNewTokens: 4)
        let (messages, tokens) = (conversation.messages, conversation.tokens)
        XCTAssertEqual(messages.count, 3)

        do {
            _ = try await conversation.sendAll(String(repeating: "many words ", count: 40), maxNewTokens: 4)
            XCTFail("the turn cannot fit 96 positions")
        } catch let error as GenerationError {
            guard case .contextFull = error else { return XCTFail("\(error)") }
        }
        XCTAssertEqual(conversation.messages, messages)
        XCTAssertEqual(conversation.tokens, tokens)

        let cached = generator.cachedTokens
        await conversation.reset()
        XCTAssertEqual(conversation.messages, [ChatMessage(role: "system", content: "Be brief.")])
        XCTAssertEqual(conversation.tokens, [])
        // A new conversation is tokenized whole; the cache still serves the system message.
        model.windows = []
        let (reply, stats) = try await conversation.sendAll("Hello again", maxNewTokens: 4)
        let prompt = try tokenizer.applyChatTemplate([ChatMessage(role: "system", content: "Be brief."),
                                                      ChatMessage(role: "user", content: "Hello again")])
        let common = zip(cached, prompt).prefix { $0 == $1 }.count
        XCTAssertGreaterThanOrEqual(common, try tokenizer.applyChatTemplate([ChatMessage(role: "system", content: "Be brief.")],
                                                                             addGenerationPrompt: false).count)
        XCTAssertEqual(stats.reusedTokens, common)
        XCTAssertEqual(reply, FakeModel.reference(prompt: prompt, maxNewTokens: 4, sampling: .greedy, vocab: vocab, eos: imEnd))
        XCTAssertEqual(model.failures, [])
    }

    func testATokenizerWithoutAChatTemplateCannotHoldAConversation() throws {
        let tokenizer = try smolLM2()
        tokenizer.chatTemplate = nil
        let (_, generator) = makeGenerator()
        XCTAssertThrowsError(try Conversation(generator: generator, tokenizer: tokenizer)) { error in
            guard case .chatTemplate = error as? TokenizerError else { return XCTFail("\(error)") }
        }
    }
}
