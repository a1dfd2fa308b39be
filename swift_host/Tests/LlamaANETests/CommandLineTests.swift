import XCTest
@testable import llama_ane_swift
import LlamaANE

final class CommandLineTests: XCTestCase {
    func testParsesFolderPromptAndOptions() throws {
        let o = try XCTUnwrap(try Options.parse(["out/tiny", "Once upon", "-n", "12", "--temperature", "0.7", "--top-k", "40",
                                                 "--top-p", "0.9", "--seed", "7", "--raw", "--branches", "4"]))
        XCTAssertEqual(o.folder, "out/tiny")
        XCTAssertEqual(o.prompt, "Once upon")
        XCTAssertEqual(o.maxNewTokens, 12)
        XCTAssertEqual(o.sampling, SamplingParameters(temperature: 0.7, topK: 40, topP: 0.9, seed: 7))
        XCTAssertTrue(o.raw)
        XCTAssertFalse(try XCTUnwrap(try Options.parse(["f", "p"])).raw, "the chat template is the default")
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
                XCTAssertFalse("\(error)".contains("\n"), "one line: \(error)")
                XCTAssertTrue("\(error)".hasSuffix("(llama-ane-swift --help lists the options)"))
            }
        }
    }

    func testParsesSamplingFiltersAndStops() throws {
        let o = try XCTUnwrap(try Options.parse(["f", "p", "--min-p", "0.05", "--repetition-penalty", "1.3",
                                                 "--stop", "\n\n", "--stop", "User:"]))
        XCTAssertEqual(o.sampling, SamplingParameters(minP: 0.05, repetitionPenalty: 1.3))
        XCTAssertEqual(o.stops, ["\n\n", "User:"])
        XCTAssertFalse(o.interactive)
    }

    func testParsesChat() throws {
        let o = try XCTUnwrap(try Options.parse(["chat", "out/tiny", "--system", "You are terse.", "--stop", "###", "-t", "0.5"]))
        XCTAssertTrue(o.interactive)
        XCTAssertEqual(o.folder, "out/tiny")
        XCTAssertEqual(o.system, "You are terse.")
        XCTAssertEqual(o.stops, ["###"])
        XCTAssertEqual(o.sampling.temperature, 0.5)
        XCTAssertEqual(try Options.parse(["./chat", "p"])?.folder, "./chat", "a folder named chat, as a path")
        XCTAssertFalse(try XCTUnwrap(try Options.parse(["./chat", "p"])).interactive)
    }

    func testRefusesBadSamplingStopAndChatArguments() {
        for bad in [["f", "p", "--min-p", "1.5"], ["f", "p", "--min-p", "-0.1"], ["f", "p", "--repetition-penalty", "0"],
                    ["f", "p", "--repetition-penalty", "inf"], ["f", "p", "--temperature", "nan"], ["f", "p", "--temperature", "inf"],
                    ["f", "p", "--repetition-penalty", "1.2", "--speculative", "lookup"], ["f", "p", "--stop", ""],
                    ["f", "p", "--stop", "x", "--branches", "2"], ["f", "p", "--system", "s"], ["chat"], ["chat", "f", "p"],
                    ["chat", "f", "--branches", "2"], ["chat", "f", "--raw"], ["f", "p", "--chat"], ["f", "p", "--top-k", "-1"]] {
            XCTAssertThrowsError(try Options.parse(bad), "\(bad)") { error in
                XCTAssertFalse("\(error)".contains("\n"), "one line: \(error)")
            }
        }
    }
}
