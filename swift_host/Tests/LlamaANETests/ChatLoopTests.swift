import Foundation
import XCTest
@testable import llama_ane_swift
@testable import LlamaANE

/// The CLI's chat loop over the SmolLM2 tokenizer and its chat template with the fake model: lines
/// are turns, /reset and /quit are commands, the end of input leaves, stop strings cut replies.
final class ChatLoopTests: XCTestCase {
    private let vocab = 300  // ids below 300 of the SmolLM2 vocabulary: special tokens and single bytes
    private let imEnd = 2

    /// Read once: building the SmolLM2 vocabulary takes seconds in a debug build.
    private static let tokenizer = Result { try Tokenizer(directory: Fixtures.url("tokenizers/smollm2")) }

    private final class Output: @unchecked Sendable {
        var text = ""
        var log = ""
    }

    /// Runs the loop on `lines` and returns what it wrote, the conversation and how many lines it read.
    private func chat(_ lines: [String], stops: [String] = [], maxNewTokens: Int = 12) async throws
        -> (out: Output, conversation: Conversation, read: Int)
    {
        let tokenizer = try Self.tokenizer.get()
        let model = FakeModel.CachePredictor(contextLength: 512, prefillLength: 16, vocab: vocab, eos: imEnd)
        let generator = Generator(predictor: model, eosTokenIds: [imEnd]) { tokenizer.decode($0, skipSpecialTokens: true) }
        let conversation = try Conversation(generator: generator, tokenizer: tokenizer, system: "You are terse.")
        let out = Output()
        var read = 0
        let loop = ChatLoop(conversation: conversation, maxNewTokens: maxNewTokens, sampling: .greedy, speculative: nil,
                            stops: stops, readLine: {
                                defer { read += 1 }
                                return read < lines.count ? lines[read] : nil
                            }, write: { out.text += $0 }, log: { out.log += $0 })
        await loop.run()
        return (out, conversation, read)
    }

    func testTurnsResetAndQuit() async throws {
        let (out, conversation, read) = try await chat(["Hello!", "", "And then?", "/reset", "Hi again", "/quit", "never read"])
        XCTAssertEqual(read, 6, "nothing is read after /quit")
        // After /reset the conversation holds the system message and the last turn only.
        XCTAssertEqual(conversation.messages.map(\.role), ["system", "user", "assistant"])
        XCTAssertEqual(conversation.messages[1].content, "Hi again")
        XCTAssertTrue(out.log.contains("[new conversation]"))
        XCTAssertEqual(out.log.components(separatedBy: "finish: ").count - 1, 3, "one summary per turn")
        // Each reply is written as the conversation recorded it, one line each.
        let (single, alone, _) = try await chat(["Hi again"])
        XCTAssertEqual(single.text, alone.messages[2].content + "\n")
        XCTAssertTrue(out.text.hasSuffix(single.text))
    }

    func testEndOfInputLeavesAndUnknownCommandsAreReported() async throws {
        let (out, conversation, read) = try await chat(["/frobnicate", "/help"])
        XCTAssertEqual(read, 3, "the end of input (nil) ends the loop")
        XCTAssertTrue(out.log.contains("[unknown command /frobnicate; /help for commands]"))
        XCTAssertTrue(out.log.contains("/reset"))
        XCTAssertEqual(conversation.messages.count, 1, "commands are no turns")
    }

    func testStopStringsCutTheReply() async throws {
        // A question the fake model answers at some length, to stop inside the answer.
        var question = ""
        var plain = Output()
        for q in ["Hello!", "And then?", "Tell me about rivers.", "Why?", "Go on."] {
            (plain, _, _) = try await chat([q], maxNewTokens: 24)
            question = q
            if plain.text.unicodeScalars.count > 9 { break }
        }
        let reply = plain.text.unicodeScalars.dropLast()  // the newline after the reply
        XCTAssertGreaterThan(reply.count, 8, "a reply long enough to stop inside")
        // Stop at a piece of the reply's middle: the reply ends before its first occurrence.
        let stop = String(String.UnicodeScalarView(reply.dropFirst(4).prefix(3)))
        let (cut, conversation, _) = try await chat([question], stops: [stop], maxNewTokens: 24)
        let at = try XCTUnwrap(plain.text.range(of: stop))
        let expected = String(plain.text[..<at.lowerBound])
        // Text already shown stays shown: at most the stop string's first characters follow.
        XCTAssertTrue(cut.text.hasPrefix(expected), "\(cut.text) should start with \(expected)")
        let tail = String(cut.text.dropFirst(expected.count).dropLast())
        XCTAssertTrue(stop.hasPrefix(tail) && tail != stop, "\(tail) after the cut")
        XCTAssertTrue(cut.text.hasSuffix("\n"))
        XCTAssertTrue(cut.log.contains("finish: stop"))
        // The stopped turn ends in the background; the next turn waits for it and follows its reply.
        _ = try await conversation.sendAll("Thanks.", maxNewTokens: 1)
        XCTAssertEqual(conversation.messages.map(\.role), ["system", "user", "assistant", "user", "assistant"],
                       "a stopped reply is kept")
    }
}
