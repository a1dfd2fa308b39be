import Foundation
import XCTest
@testable import LlamaANE

/// Swift's speculative decoding against what Python's did on the same inputs (`speculative.json`,
/// written by tests/swift_fixtures.py): the prompt-lookup drafter's trees and chances, also along
/// sequences of calls on growing texts (what it learns), ranking, expected tokens and the rule
/// under fixed step times, measured step times, the verify window the real Python pipeline fed the exported
/// embeddings and the slots it fed the verify cache update, the acceptance rule with the seeded
/// generator, and whole generations on a bigram model.
final class SpeculativeFixtureTests: XCTestCase {
    private func load() throws -> JSONValue {
        try JSONValue.parse(Data(contentsOf: try Fixtures.url("speculative.json")))
    }

    private func ints(_ v: JSONValue?) -> [Int] { v?.arrayValue?.compactMap(\.intValue) ?? [] }

    private func floats(_ v: JSONValue?) -> [Float] { v?.arrayValue?.map { Float($0.doubleValue ?? .nan) } ?? [] }

    private func doubles(_ v: JSONValue?) -> [Double] { v?.arrayValue?.map { $0.doubleValue ?? .nan } ?? [] }

    /// The fixture's tree, with its chances of acceptance when it has them.
    private func tree(_ v: JSONValue, probabilities: [[Double]?]? = nil) -> DraftTree {
        let tokens = ints(v["tokens"]), parents = ints(v["parents"]), confidence = doubles(v["confidence"])
        var tree = DraftTree(root: tokens[0])
        for i in 1..<max(tokens.count, 1) {
            let added = tree.add(tokens[i], under: parents[i], probabilities: probabilities?[i],
                                 confidence: confidence.isEmpty ? 1 : confidence[i])
            XCTAssertEqual(added, i, "the fixture's tree has a repeated child")
        }
        return tree
    }

    /// Asserts that `tree` is the fixture's `expected` tree: tokens, parents, order, chances.
    private func assertTree(_ tree: DraftTree, _ expected: JSONValue, _ message: String, line: UInt = #line) {
        XCTAssertEqual(tree.tokens, ints(expected["tokens"]), message, line: line)
        XCTAssertEqual(tree.parents, ints(expected["parents"]), message, line: line)
        assertClose(tree.confidence, doubles(expected["confidence"]), message, line: line)
    }

    private func assertClose(_ a: [Double], _ b: [Double], _ message: String, line: UInt = #line) {
        XCTAssertEqual(a.count, b.count, message, line: line)
        for (x, y) in zip(a, b) where !(x.isNaN && y.isNaN) {  // NaN: none on either side (a null in the fixture)
            XCTAssertEqual(x, y, accuracy: 1e-12 * max(1, abs(y)), message, line: line)
        }
    }

    private func cases(_ key: String) throws -> [JSONValue] {
        let list = try load()[key]?.arrayValue ?? []
        XCTAssertFalse(list.isEmpty, "no \(key) in the fixture")
        return list
    }

    func testPromptLookupFindsPythonsDrafts() throws {
        var drafter = PromptLookupDrafter()  // one drafter for every case, in the fixture's order
        for c in try cases("drafts") {
            let text = ints(c["text"]), k = c["k"]?.intValue ?? 0
            assertTree(drafter.draft(text, k: k), c, "text \(text) k \(k)")
            let continuations = c["continuations"]?.arrayValue?.map {
                PromptLookupDrafter.Continuation(match: $0["match"]?.intValue ?? 0, tokens: ints($0["tokens"]))
            }
            XCTAssertEqual(drafter.continuations(text, length: k), continuations, "text \(text) k \(k)")
        }
    }

    func testPromptLookupLearnsItsChancesAsPythonDoes() throws {
        for (s, session) in try cases("sessions").enumerated() {
            var drafter = PromptLookupDrafter()
            let calls = session.arrayValue ?? []
            XCTAssertGreaterThan(calls.count, 10)
            for (i, c) in calls.enumerated() {
                let text = ints(c["text"]), k = c["k"]?.intValue ?? 0
                assertTree(drafter.draft(text, k: k), c, "session \(s) call \(i)")
                let chances = (1...8).map { m in (1...3).map { v in drafter.chances.chance(match: m, votes: v) } }
                assertClose(chances.flatMap { $0 }, (c["chances"]?.arrayValue ?? []).flatMap(doubles),
                            "session \(s) call \(i): what the drafter learnt")
            }
        }
    }

    func testRankingAndTheRuleArePythons() throws {
        for c in try cases("ranked") {
            let tree = tree(c)
            let ranked = tree.ranked()
            let expected = c["ranked"]?.arrayValue ?? []
            XCTAssertEqual(ranked.map(\.node), expected.map { $0.arrayValue?.first?.intValue ?? -1 }, "tree \(tree.tokens)")
            assertClose(ranked.map(\.chance), expected.map { $0.arrayValue?.last?.doubleValue ?? .nan }, "tree \(tree.tokens)")
            assertClose([tree.expectedTokens], [c["expected_tokens"]?.doubleValue ?? .nan], "tree \(tree.tokens)")
            for v in c["verify"]?.arrayValue?.compactMap(\.arrayValue) ?? [] {  // [plain seconds, verify seconds, worth verifying]
                let times = FixedStepTimes(plain: v[0].doubleValue ?? .nan, verify: v[1].doubleValue ?? .nan)
                XCTAssertEqual(times.worthVerifying(expected: tree.expectedTokens), v[2].boolValue, "tree \(tree.tokens) \(times)")
            }
        }
    }

    func testMeasuredStepTimesArePythons() throws {
        for (s, sequence) in try cases("times").enumerated() {
            var times = MeasuredStepTimes()
            for (i, step) in (sequence.arrayValue ?? []).enumerated() {
                let event = try XCTUnwrap(step["event"]?.arrayValue)
                let seconds = try XCTUnwrap(event[1].doubleValue)
                if event[0].stringValue == "plain" {
                    times.plain(seconds: seconds)
                } else {
                    times.verify(seconds: seconds)
                }
                assertClose([times.plainSeconds ?? .nan, times.verifySeconds ?? .nan],
                            [step["plain_seconds"]?.doubleValue ?? .nan, step["verify_seconds"]?.doubleValue ?? .nan],
                            "sequence \(s) step \(i)")
                for v in step["verify"]?.arrayValue?.compactMap(\.arrayValue) ?? [] {  // [expected tokens, worth verifying]
                    let expected = v[0].doubleValue ?? .nan
                    XCTAssertEqual(times.worthVerifying(expected: expected), v[1].boolValue, "sequence \(s) step \(i) expected \(expected)")
                }
            }
        }
    }

    func testTreeWindowIsWhatPythonFeedsTheVerifyFunction() throws {
        let width = try XCTUnwrap(try load()["verify_window"]?.intValue)
        XCTAssertEqual(try Manifest.load(from: Fixtures.url("export")).verifyWindow, width)
        for c in try cases("windows") {
            let tree = tree(c)
            let position = try XCTUnwrap(c["position"]?.intValue)
            let window = TreeWindow(tree: tree, position: position, width: width)
            XCTAssertEqual(window.tokens.map(Int.init), ints(c["input_ids"]), "tree \(tree.tokens)")
            XCTAssertEqual(window.depths.map(Int.init), ints(c["depths"]), "tree \(tree.tokens)")
            XCTAssertEqual(window.treeMask, floats(c["tree_mask"]), "tree \(tree.tokens)")
            let path = ints(c["path"])
            XCTAssertEqual(window.slots(keeping: path).map(Int.init), ints(c["slots"]), "tree \(tree.tokens) path \(path)")
            XCTAssertEqual(window.tokens(along: path), Array(ints(c["cached"]).suffix(path.count)))
        }
    }

    func testTreeAcceptanceDrawsPythonsPathsAndTokens() throws {
        for c in try cases("choices") {
            let probabilities = c["probabilities"]?.arrayValue?.map { $0.arrayValue?.compactMap(\.doubleValue) }
            let tree = tree(c, probabilities: probabilities)
            let sampling = SamplingParameters(temperature: Float(c["temperature"]?.doubleValue ?? 0), topK: c["top_k"]?.intValue ?? 0,
                                              topP: Float(c["top_p"]?.doubleValue ?? 1), seed: UInt64(c["seed"]?.stringValue ?? "") ?? 0)
            let logits = c["logits"]?.arrayValue?.map(floats) ?? []
            var rng = SeededRandom(seed: sampling.seed)
            let (path, next) = TreeAcceptance.choose(tree, logits: logits, sampling: sampling, rng: &rng)
            XCTAssertEqual(path, ints(c["path"]), "seed \(sampling.seed)")
            XCTAssertEqual(next, c["next"]?.intValue, "seed \(sampling.seed)")
            XCTAssertEqual(String(rng.next()), c["after"]?.stringValue, "seed \(sampling.seed): another count of numbers drawn")
        }
    }

    /// A bigram model with a verify function: the logits after a token are its row of the table.
    private final class BigramVerifier: TreeVerifier, @unchecked Sendable {
        let table: [[Float]]
        let contextLength: Int
        let prefillLength = 4
        let verifyWindow: Int

        init(table: [[Float]], contextLength: Int, verifyWindow: Int) {
            self.table = table
            self.contextLength = contextLength
            self.verifyWindow = verifyWindow
        }

        func predict(_ window: TokenWindow) async throws -> [Float] { table[Int(window.tokens[window.count - 1])] }
        func verify(_ window: TreeWindow) async throws -> [[Float]] { window.tokens.prefix(window.count).map { table[Int($0)] } }
        func accept(_ window: TreeWindow, path: [Int]) async throws {}
        func reset() async throws {}
    }

    func testSpeculativeGenerationGivesPythonsTokensAndCounts() async throws {
        let root = try load()
        let table = root["table"]?.arrayValue?.map(floats) ?? []
        let width = try XCTUnwrap(root["verify_window"]?.intValue)
        for c in try cases("generations") {
            let prompt = ints(c["prompt"])
            let model = BigramVerifier(table: table, contextLength: c["context_length"]?.intValue ?? 0, verifyWindow: width)
            let sampling = SamplingParameters(temperature: Float(c["temperature"]?.doubleValue ?? 0), topK: c["top_k"]?.intValue ?? 0,
                                              topP: Float(c["top_p"]?.doubleValue ?? 1), seed: UInt64(c["seed"]?.stringValue ?? "") ?? 0)
            // With fixed step times, Python verified by the rule under them; without, every drafted tree.
            let line = doubles(c["times"])
            let options = SpeculativeDecoding.promptLookup(draftTokens: c["draft_tokens"]?.intValue, adaptive: !line.isEmpty,
                                                           times: line.isEmpty ? MeasuredStepTimes() : FixedStepTimes(plain: line[0], verify: line[1]))
            let (tokens, stats) = try await Generator(predictor: model, eosTokenIds: [])
                .generateAll(prompt: prompt, maxNewTokens: c["max_new_tokens"]?.intValue ?? 0, sampling: sampling, speculative: options)
            XCTAssertEqual(tokens, ints(c["tokens"]), "prompt \(prompt) times \(line)")
            XCTAssertEqual(stats.stopReason.rawValue, c["finish_reason"]?.stringValue, "prompt \(prompt)")
            let spec = try XCTUnwrap(stats.speculative)
            XCTAssertEqual([spec.verifySteps, spec.draftedTokens, spec.acceptedTokens],
                           ["verify_steps", "drafted_tokens", "accepted_tokens"].map { c[$0]?.intValue ?? -1 }, "prompt \(prompt)")
            // Python also counts the plain step it tried when the context was already full.
            let triedPastTheEnd = stats.stopReason == .context ? 1 : 0
            XCTAssertEqual(spec.decodeSteps + triedPastTheEnd, c["decode_steps"]?.intValue, "prompt \(prompt)")
        }
    }
}
