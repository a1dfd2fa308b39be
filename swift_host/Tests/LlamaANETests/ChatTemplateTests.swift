import Foundation
import XCTest
@testable import LlamaANE

/// Chat templates rendered here against jinja2's renderings (generated fixtures).
final class ChatTemplateTests: XCTestCase {
    func testMatchesJinja2Renderings() throws {
        let root = try JSONValue.parse(Data(contentsOf: Fixtures.url("chat_templates.json")))
        let templates = root["templates"]?.arrayValue ?? []
        XCTAssertGreaterThanOrEqual(templates.count, 7)
        XCTAssertTrue(templates.contains { $0["name"]?.stringValue == "qwen2_chatml" })
        XCTAssertTrue(templates.contains { $0["name"]?.stringValue == "qwen3_chatml" })
        // the families' templates: in their own style, and those the family exports carry
        for family in ["gemma3_style", "smollm3_style", "phi3_style", "granite_style", "olmo2_style", "family_gemma3_text",
                       "family_smollm3", "family_granite", "family_olmo2", "family_phi3", "family_mistral"] {
            XCTAssertTrue(templates.contains { $0["name"]?.stringValue == family }, family)
        }
        var checked = 0, errors = 0
        for t in templates {
            let name = t["name"]?.stringValue ?? "?"
            let template = try ChatTemplate(try XCTUnwrap(t["template"]?.stringValue))
            for c in t["cases"]?.arrayValue ?? [] {
                let messages = (c["messages"]?.arrayValue ?? []).map {
                    ChatMessage(role: $0["role"]?.stringValue ?? "", content: $0["content"]?.stringValue ?? "")
                }
                var extra: [String: Any] = [:]
                for (key, value) in c["extra"]?.objectValue ?? [] {
                    extra[key] = value.boolValue ?? value.stringValue ?? value.doubleValue as Any
                }
                let render = {
                    try template.render(messages: messages, addGenerationPrompt: c["add_generation_prompt"]?.boolValue ?? false,
                                        bosToken: t["bos_token"]?.stringValue, eosToken: t["eos_token"]?.stringValue,
                                        extra: extra)
                }
                if let expectedError = c["error"]?.stringValue {
                    XCTAssertThrowsError(try render(), "\(name): \(messages)") { error in
                        XCTAssertEqual(error as? TokenizerError, .chatTemplate(expectedError))
                    }
                    errors += 1
                } else {
                    XCTAssertEqual(try render(), c["rendered"]?.stringValue, "\(name): \(messages)")
                }
                checked += 1
            }
        }
        XCTAssertGreaterThanOrEqual(checked, 24)
        XCTAssertGreaterThan(errors, 0, "the fixtures should include a template that raises")
    }

    func testToolCallingBranchIsAClearError() throws {
        let root = try JSONValue.parse(Data(contentsOf: Fixtures.url("chat_templates.json")))
        let source = try XCTUnwrap(root["templates"]?.arrayValue?.first { $0["name"]?.stringValue == "qwen2_chatml" }?["template"]?.stringValue)
        let template = try ChatTemplate(source)
        let messages = [ChatMessage(role: "user", content: "What is 2+3?")]
        let tools: [Any] = [["type": "function", "function": ["name": "add", "parameters": ["type": "object"]]]]
        XCTAssertThrowsError(try template.render(messages: messages, addGenerationPrompt: true, extra: ["tools": tools])) { error in
            guard case let .chatTemplate(message)? = error as? TokenizerError else { return XCTFail("\(error)") }
            XCTAssertTrue(message.contains("tools") && message.contains("apply_chat_template"), message)
        }
        // without tools the same template renders its plain ChatML branch
        let text = try template.render(messages: messages, addGenerationPrompt: true, extra: ["tools": [Any]()])
        XCTAssertTrue(text.hasSuffix("<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"), text)
    }

    func testRaiseExceptionBecomesAnError() throws {
        let root = try JSONValue.parse(Data(contentsOf: Fixtures.url("chat_templates.json")))
        let source = try XCTUnwrap(root["templates"]?.arrayValue?.first { $0["name"]?.stringValue == "llama2_chat" }?["template"]?.stringValue)
        let messages = [ChatMessage(role: "user", content: "a"), ChatMessage(role: "user", content: "b")]
        XCTAssertThrowsError(try ChatTemplate(source).render(messages: messages, addGenerationPrompt: false)) { error in
            XCTAssertEqual(error as? TokenizerError, .chatTemplate("Conversation roles must alternate user/assistant/user/assistant/..."))
        }
    }

    func testExpressionsAndWhitespaceControl() throws {
        func render(_ s: String, _ extra: [String: Any] = [:]) throws -> String {
            try ChatTemplate(s).render(messages: [], addGenerationPrompt: false, extra: extra)
        }
        XCTAssertEqual(try render("{{ 1 + 2 * 3 }}|{{ 7 // 2 }}|{{ 'a' ~ 1 }}|{{ [1,2,3][-1] }}|{{ 'hello'[1:3] }}"), "7|3|a1|3|el")
        XCTAssertEqual(try render("{% set ns = namespace(n=0) %}{% for x in xs %}{% set ns.n = ns.n + x %}{% endfor %}{{ ns.n }}", ["xs": [1, 2, 3]]), "6")
        XCTAssertEqual(try render("{% for x in xs if x > 1 %}{{ loop.index }}{{ x }}{% if not loop.last %},{% endif %}{% endfor %}", ["xs": [1, 2, 3]]), "12,23")
        XCTAssertEqual(try render("  {%- if true -%}  x  {%- endif %}\n"), "x")
        XCTAssertEqual(try render("a\n  {% if true %}\nb\n  {% endif %}\nc"), "a\nb\nc")
        XCTAssertEqual(try render("{{ x is defined }}{{ y is not none }}{{ 'b' in 'abc' }}{{ 3 not in [1] }}", ["y": 1]), "FalseTrueTrueTrue")
        XCTAssertEqual(try render("{{ ' hi '|trim|upper }}{{ xs|length }}{{ xs|join('-') }}{{ d|tojson }}", ["xs": [1, 2], "d": ["k": "v\n"]]),
                       "HI21-2{\"k\": \"v\\n\"}")
        XCTAssertEqual(try render("{{ 'yes' if flag else 'no' }}", ["flag": false]), "no")
        XCTAssertThrowsError(try ChatTemplate("{% macro m() %}{% endmacro %}")) { error in
            XCTAssertTrue("\(error)".contains("macro"))
        }
    }

    func testExportedModelBuildsChatPrompts() throws {
        let model = try ExportedModel(folder: Fixtures.url("export"))
        let ids = try model.chatPromptTokens([ChatMessage(role: "user", content: "Hello")])
        let text = model.tokenizer.decode(ids)
        XCTAssertTrue(text.hasPrefix("<|im_start|>user\nHello<|im_end|>\n"), text)
        XCTAssertTrue(text.hasSuffix("<|im_start|>assistant\n"), text)
        XCTAssertEqual(ids.first, model.manifest.tokenizer.specialTokens["<|im_start|>"])
        XCTAssertFalse(model.eosTokenIds.isEmpty)
        XCTAssertEqual(model.promptTokens("Hello"), model.tokenizer.encode("Hello"))
    }
}
