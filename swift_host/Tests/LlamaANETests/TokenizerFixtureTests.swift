import Foundation
import XCTest
@testable import LlamaANE

/// Tokenizer ids and decoded text against Hugging Face `tokenizers`, on generated fixtures.
final class TokenizerFixtureTests: XCTestCase {
    private struct Case {
        let text: String
        let ids: [Int]
        let idsWithoutSpecial: [Int]
        let decoded: String
    }

    /// Loads a fixture tokenizer and its cases. Case strings are read through `JSONValue` so
    /// that no Foundation bridging normalizes them.
    private func load(_ name: String) throws -> (Tokenizer, [Case]) {
        let dir = try Fixtures.url("tokenizers/\(name)")
        let tokenizer = try Tokenizer(directory: dir)
        let root = try JSONValue.parse(Data(contentsOf: dir.appendingPathComponent("cases.json")))
        let cases = (root["cases"]?.arrayValue ?? []).map { c in
            Case(text: c["text"]?.stringValue ?? "",
                 ids: c["ids"]?.arrayValue?.compactMap(\.intValue) ?? [],
                 idsWithoutSpecial: c["ids_without_special"]?.arrayValue?.compactMap(\.intValue) ?? [],
                 decoded: c["decoded"]?.stringValue ?? "")
        }
        return (tokenizer, cases)
    }

    private func check(_ name: String, file: StaticString = #filePath, line: UInt = #line) throws {
        let (tokenizer, cases) = try load(name)
        XCTAssertGreaterThanOrEqual(cases.count, 200, "\(name): too few fixture cases", file: file, line: line)
        var failures = 0
        for c in cases {
            let ids = tokenizer.encode(c.text)
            let plain = tokenizer.encode(c.text, addSpecialTokens: false)
            let decoded = tokenizer.decode(c.ids)
            if ids != c.ids || plain != c.idsWithoutSpecial || !decoded.utf8.elementsEqual(c.decoded.utf8) {
                failures += 1
                if failures <= 5 {
                    XCTFail("""
                        \(name): \(String(reflecting: c.text))
                          ids      \(ids)
                          expected \(c.ids)
                          decoded  \(String(reflecting: decoded))
                          expected \(String(reflecting: c.decoded))
                        """, file: file, line: line)
                }
            }
        }
        XCTAssertEqual(failures, 0, "\(name): \(failures) of \(cases.count) cases differ from Hugging Face", file: file, line: line)
    }

    func testSmolLM2ByteLevelBPE() throws { try check("smollm2") }
    func testLlama2SentencePieceByteFallback() throws { try check("llama2_sentencepiece") }
    func testMetaspacePreTokenizer() throws { try check("metaspace_bpe") }
    func testGemmaStyleSentencePieceWithoutDummyPrefix() throws { try check("gemma_sentencepiece") }
    func testLlama3StyleSplitRegex() throws { try check("byte_level_split") }
    func testNFCAndSingleDigitSplits() throws { try check("byte_level_digits_nfc") }
    func testQwen2ByteLevelBPE() throws { try check("qwen2_byte_level") }

    func testQwen2AddedTokensThatAreNotSpecial() throws {
        let (tokenizer, _) = try load("qwen2_byte_level")
        let call = try XCTUnwrap(tokenizer.tokenId("<tool_call>"))
        let end = try XCTUnwrap(tokenizer.tokenId("<|im_end|>"))
        XCTAssertEqual(tokenizer.encode("<tool_call>", addSpecialTokens: false), [call])
        XCTAssertFalse(tokenizer.isSpecial(call))
        XCTAssertTrue(tokenizer.isSpecial(end))
        // skipping special tokens keeps the tool-call markers, as transformers does
        XCTAssertEqual(tokenizer.decode([call, end], skipSpecialTokens: true), "<tool_call>")
        XCTAssertNil(tokenizer.bosToken, "Qwen tokenizers add no BOS")
    }

    func testSpecialTokensAreSingleIds() throws {
        let (tokenizer, _) = try load("smollm2")
        let start = try XCTUnwrap(tokenizer.tokenId("<|im_start|>"))
        let end = try XCTUnwrap(tokenizer.tokenId("<|im_end|>"))
        XCTAssertEqual(tokenizer.encode("<|im_start|>").first, start)
        XCTAssertEqual(tokenizer.encode("x<|im_end|>").last, end)
        XCTAssertTrue(tokenizer.isSpecial(start))
        XCTAssertEqual(tokenizer.decode([start, end], skipSpecialTokens: true), "")
    }

    func testByteFallbackEmitsByteTokens() throws {
        let (tokenizer, _) = try load("llama2_sentencepiece")
        // U+1F600 is outside the trained alphabet: its four UTF-8 bytes come out as <0xNN> tokens.
        let ids = tokenizer.encode("😀", addSpecialTokens: false)
        let names = ids.compactMap { tokenizer.token(forId: $0) }
        XCTAssertEqual(Array(names.suffix(4)), ["<0xF0>", "<0x9F>", "<0x98>", "<0x80>"])
        XCTAssertEqual(tokenizer.decode(ids), "😀")
    }

    func testUnsupportedModelIsRefused() throws {
        let json = #"{"model": {"type": "WordPiece", "vocab": {}}}"#
        XCTAssertThrowsError(try Tokenizer(tokenizerJSON: Data(json.utf8))) { error in
            XCTAssertEqual(error as? TokenizerError, .unsupported(component: "model", type: "WordPiece"))
        }
    }
}
