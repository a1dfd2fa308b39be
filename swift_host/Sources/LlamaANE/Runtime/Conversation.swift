import Foundation

/// A multi-turn chat on one `Generator` and its KV cache, so that each turn prefills only its own
/// new tokens.
///
/// The conversation is kept twice: as messages, rendered with the tokenizer's chat template, and as
/// token ids (`tokens`: the last turn's prompt ids and the reply's generated ids), which stand for
/// the rendered text up to the end of the reply. A new turn renders the whole conversation; when
/// that text starts with the text the ids stand for, the prompt is those ids plus the tokens of the
/// text that follows, and the generator prefills only what follows (and the reply's last token when
/// it was not end-of-sequence: sampled, it was never fed). When the template rewrites earlier turns
/// instead, the whole text is tokenized again and the generator still reuses the longest common prefix.
///
/// Turns run one at a time. A turn that was stopped or failed after some tokens keeps the reply as
/// far as it went; one that produced no token leaves the conversation as it was. A turn whose
/// prompt outgrows the context fails with `GenerationError.contextFull` (one that fills it while
/// decoding finishes with `FinishReason.context`): `reset()` and start again; unless the
/// conversation was made with `overflow: .shift(keep:)`: then the generator keeps the first `keep`
/// tokens (the system message) and the most recent ones, and the conversation goes on.
public final class Conversation: @unchecked Sendable {
    public let generator: Generator
    public let tokenizer: Tokenizer
    /// The system message every conversation starts with, if any.
    public let system: String?
    /// What a turn does when the conversation no longer fits the context.
    public let overflow: ContextOverflow
    private let turns = SerialJobs()
    private let lock = NSLock()
    /// The messages, the token ids and the text they stand for; read and written under `lock`.
    private var state: State

    private struct State {
        var messages: [ChatMessage]
        /// The last prompt's ids followed by the reply's generated ids (end-of-sequence excluded).
        var tokens: [Int] = []
        /// The rendered text `tokens` stand for: the last prompt's text followed by the reply's.
        var coveredText = ""
    }

    /// Throws when the tokenizer has no chat template or it cannot be parsed.
    public init(generator: Generator, tokenizer: Tokenizer, system: String? = nil, overflow: ContextOverflow = .stop) throws {
        guard let source = tokenizer.chatTemplate else {
            throw TokenizerError.chatTemplate("this tokenizer has no chat template, so it cannot hold a conversation; "
                + "generate from a plain prompt instead")
        }
        _ = try ChatTemplate(source)
        self.generator = generator
        self.tokenizer = tokenizer
        self.system = system
        self.overflow = overflow
        state = State(messages: Self.opening(system))
    }

    /// The messages so far (the system message first, if any).
    public var messages: [ChatMessage] { locked { $0.messages } }

    /// The token ids of the conversation up to the end of the last reply: the last prompt's ids
    /// followed by the reply's generated ids (without an end-of-sequence token). Empty before the
    /// first reply.
    public var tokens: [Int] { locked { $0.tokens } }

    /// Adds the user's `text` and streams the assistant's reply, generated on the shared cache.
    /// The `finished` stats say how many prompt tokens were reused and prefilled. With
    /// `speculative`, the reply is decoded speculatively (see `Generator`): the same tokens greedily,
    /// and the stats count its verify steps.
    public func send(_ text: String, maxNewTokens: Int, sampling: SamplingParameters = .greedy,
                     speculative: SpeculativeDecoding? = nil) -> AsyncThrowingStream<GenerationEvent, Error>
    {
        AsyncThrowingStream { continuation in
            let task = Task {
                do {
                    try await self.turns.run {
                        try await self.turn(text, maxNewTokens: maxNewTokens, sampling: sampling,
                                            speculative: speculative) { continuation.yield($0) }
                    }
                    continuation.finish()
                } catch {
                    continuation.finish(throwing: error)
                }
            }
            continuation.onTermination = { _ in task.cancel() }
        }
    }

    /// Sends `text` and waits for the whole reply: its token ids and the stats.
    public func sendAll(_ text: String, maxNewTokens: Int, sampling: SamplingParameters = .greedy,
                        speculative: SpeculativeDecoding? = nil) async throws -> (tokens: [Int], stats: GenerationStats)
    {
        var tokens: [Int] = []
        for try await event in send(text, maxNewTokens: maxNewTokens, sampling: sampling, speculative: speculative) {
            switch event {
            case let .token(id, _): tokens.append(id)
            case let .finished(stats): return (tokens, stats)
            }
        }
        throw CancellationError()  // the stream ended without finishing: the caller was cancelled
    }

    /// The prompt ids for `messages` (this conversation's messages and a new one) followed by the
    /// assistant's turn header, and the text they render to.
    public func promptTokens(for messages: [ChatMessage]) throws -> (tokens: [Int], text: String) {
        let text = try tokenizer.renderChat(messages, addGenerationPrompt: true)
        let known = locked { $0 }
        if !known.tokens.isEmpty, let rest = Self.text(text, after: known.coveredText) {
            return (known.tokens + tokenizer.encode(rest, addSpecialTokens: false), text)
        }
        return (tokenizer.encode(text, addSpecialTokens: false), text)
    }

    /// Starts a new conversation (with the same system message) once the running turn has ended.
    /// The generator's cache keeps its tokens, so the next prompt still reuses what it starts with
    /// in common with them (the system message, the template's header).
    public func reset() async {
        _ = try? await turns.run { self.locked { $0 = State(messages: Self.opening(self.system)) } }
    }

    private func turn(_ text: String, maxNewTokens: Int, sampling: SamplingParameters,
                      speculative: SpeculativeDecoding?, emit: (GenerationEvent) -> Void) async throws {
        let messages = self.messages + [ChatMessage(role: "user", content: text)]
        let prompt = try promptTokens(for: messages)
        var generated: [Int] = []
        var recorded = false
        /// Adds the user's message and the reply so far to the conversation.
        func record() {
            guard !recorded, !generated.isEmpty else { return }
            recorded = true
            var reply = generated
            if let last = reply.last, generator.eosTokenIds.contains(last) { reply.removeLast() }
            let replyText = tokenizer.decode(reply, skipSpecialTokens: true)
            locked {
                $0.messages = messages + [ChatMessage(role: "assistant", content: replyText)]
                $0.tokens = prompt.tokens + reply
                $0.coveredText = prompt.text + replyText
            }
        }
        do {
            for try await event in generator.generate(prompt: prompt.tokens, maxNewTokens: maxNewTokens, sampling: sampling,
                                                            overflow: overflow, speculative: speculative) {
                switch event {
                case let .token(id, _): generated.append(id)
                case .finished: record()  // before the consumer sees the end
                }
                emit(event)
            }
        } catch {
            record()
            throw error
        }
        record()  // stopped early: the reply as far as it went
    }

    private static func opening(_ system: String?) -> [ChatMessage] {
        system.map { [ChatMessage(role: "system", content: $0)] } ?? []
    }

    /// The part of `text` after `prefix`, compared by Unicode scalars; nil when `text` does not start with it.
    private static func text(_ text: String, after prefix: String) -> String? {
        guard text.unicodeScalars.starts(with: prefix.unicodeScalars) else { return nil }
        var rest = String.UnicodeScalarView()
        rest.append(contentsOf: text.unicodeScalars.dropFirst(prefix.unicodeScalars.count))
        return String(rest)
    }

    private func locked<T>(_ body: (inout State) -> T) -> T {
        lock.lock(); defer { lock.unlock() }
        return body(&state)
    }
}
