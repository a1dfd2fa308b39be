import XCTest
@testable import llama_ane_swift
import LlamaANE

final class CommandLineTests: XCTestCase {
    func testParsesFolderPromptAndOptions() throws {
        let o = try XCTUnwrap(try Options.parse(["out/tiny", "Once upon", "-n", "12", "--temperature", "0.7", "--top-k", "40",
                                                 "--top-p", "0.9", "--seed", "7", "--chat", "--branches", "4"]))
        XCTAssertEqual(o.folder, "out/tiny")
        XCTAssertEqual(o.prompt, "Once upon")
        XCTAssertEqual(o.maxNewTokens, 12)
        XCTAssertEqual(o.sampling, SamplingParameters(temperature: 0.7, topK: 40, topP: 0.9, seed: 7))
        XCTAssertTrue(o.chat)
        XCTAssertEqual(o.branches, 4)
        XCTAssertNil(try Options.parse(["--help"]))
        XCTAssertEqual(try Options.parse(["f", "--", "-starts with a dash"])?.prompt, "-starts with a dash")
    }

    func testParsesSpeculativeDecoding() throws {
        let o = try XCTUnwrap(try Options.parse(["f", "p", "--speculative", "lookup", "--draft-tokens", "6"]))
        XCTAssertEqual(o.speculative, "lookup")
        XCTAssertEqual(o.draftTokens, 6)
        let speculative = try XCTUnwrap(o.speculativeDecoding)
        XCTAssertEqual(speculative.drafter as? PromptLookupDrafter, PromptLookupDrafter())
        XCTAssertEqual(speculative.draftTokens, 6)
        XCTAssertTrue(speculative.adaptive)
        XCTAssertNil(try Options.parse(["f", "p"])?.speculativeDecoding)
    }

    func testRefusesBadArguments() {
        for bad in [["only-folder"], ["f", "p", "-n"], ["f", "p", "-n", "x"], ["f", "p", "--top-p", "0"],
                    ["f", "p", "--frobnicate"], ["f", "p", "-n", "0"], ["f", "p", "--compute-units", "gpu"], ["f", "p", "--branches", "-1"],
                    ["f", "p", "--speculative", "draft:out"], ["f", "p", "--draft-tokens", "4"],
                    ["f", "p", "--speculative", "lookup", "--draft-tokens", "0"], ["f", "p", "--speculative", "lookup", "--branches", "2"]] {
            XCTAssertThrowsError(try Options.parse(bad), "\(bad)") { error in
                XCTAssertTrue("\(error)".contains("usage:"), "errors end with the usage text")
            }
        }
    }
}
