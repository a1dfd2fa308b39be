import Foundation

/// One message of a conversation.
public struct ChatMessage: Equatable, Sendable {
    public var role: String
    public var content: String

    public init(role: String, content: String) {
        self.role = role
        self.content = content
    }
}

/// A Hugging Face chat template (Jinja), rendered the way transformers' `apply_chat_template` does
/// for the subset of Jinja that chat templates use. Unsupported syntax fails with a message that
/// names it, when the template is parsed.
public struct ChatTemplate {
    public let source: String
    private let nodes: [JinjaNode]

    public init(_ source: String) throws {
        self.source = source
        nodes = try JinjaParser.parse(source)
    }

    /// Variables that switch a template's tool-calling branches on. Their values are JSON objects
    /// whose key order the prompt shows (`tools | tojson`) and a Swift dictionary does not keep, and
    /// a `ChatMessage` carries no tool calls: rendering them here would give a prompt different from
    /// transformers', so they are refused.
    static let toolVariables: Set<String> = ["tools", "documents"]

    /// The prompt text for `messages`. `addGenerationPrompt` appends the assistant's turn header.
    /// `extra` adds variables (e.g. `["enable_thinking": false]`); `bosToken`/`eosToken` fill
    /// `bos_token`/`eos_token`. A non-empty `tools` or `documents` throws `TokenizerError.chatTemplate`.
    public func render(messages: [ChatMessage], addGenerationPrompt: Bool, bosToken: String? = nil,
                       eosToken: String? = nil, extra: [String: Any] = [:]) throws -> String {
        if let name = extra.keys.sorted().first(where: { Self.toolVariables.contains($0) && JinjaValue.from(extra[$0]).isTruthy }) {
            throw TokenizerError.chatTemplate(
                "the chat template's tool-calling branch (`\(name)`) is not supported here: its JSON would not "
                    + "match transformers' prompt; render tool prompts with transformers' apply_chat_template "
                    + "and pass the text as a plain prompt")
        }
        var context: [String: JinjaValue] = [
            "messages": .array(messages.map { .object([("role", .string($0.role)), ("content", .string($0.content))]) }),
            "add_generation_prompt": .bool(addGenerationPrompt),
            "bos_token": .string(bosToken ?? ""),
            "eos_token": .string(eosToken ?? ""),
        ]
        for (k, v) in extra { context[k] = JinjaValue.from(v) }
        var interpreter = JinjaInterpreter(context: context)
        return try interpreter.render(nodes)
    }
}

extension Tokenizer {
    /// The prompt text of `messages` rendered with the tokenizer's chat template and its BOS/EOS tokens.
    public func renderChat(_ messages: [ChatMessage], addGenerationPrompt: Bool = true) throws -> String {
        guard let source = chatTemplate else {
            throw TokenizerError.chatTemplate("this tokenizer has no chat template; pass a plain prompt instead")
        }
        return try ChatTemplate(source).render(messages: messages, addGenerationPrompt: addGenerationPrompt,
                                               bosToken: bosToken, eosToken: eosToken)
    }

    /// Renders the tokenizer's chat template for `messages` and encodes it (without adding special
    /// tokens again: the template writes them).
    public func applyChatTemplate(_ messages: [ChatMessage], addGenerationPrompt: Bool = true) throws -> [Int] {
        encode(try renderChat(messages, addGenerationPrompt: addGenerationPrompt), addSpecialTokens: false)
    }
}
