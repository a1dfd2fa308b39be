import XCTest
@testable import LlamaANE

/// Deltas must add up to the full decode, for every fixture tokenizer and every fixture string.
final class StreamingDetokenizerTests: XCTestCase {
    func testDeltasConcatenateToTheFullDecode() throws {
        for name in ["smollm2", "llama2_sentencepiece", "metaspace_bpe"] {
            let dir = try Fixtures.url("tokenizers/\(name)")
            let tokenizer = try Tokenizer(directory: dir)
            let cases = try JSONValue.parse(Data(contentsOf: dir.appendingPathComponent("cases.json")))["cases"]?.arrayValue ?? []
            XCTAssertFalse(cases.isEmpty)
            for c in cases.prefix(120) {
                let ids = c["ids_without_special"]?.arrayValue?.compactMap(\.intValue) ?? []
                var stream = StreamingDetokenizer { tokenizer.decode($0, skipSpecialTokens: true) }
                var text = ids.map { stream.append($0) }.joined()
                text += stream.finish()
                XCTAssertEqual(Array(text.unicodeScalars), Array(tokenizer.decode(ids, skipSpecialTokens: true).unicodeScalars),
                               "\(name): \(String(reflecting: c["text"]?.stringValue ?? ""))")
            }
        }
    }
}
