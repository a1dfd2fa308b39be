import Foundation
import XCTest
@testable import LlamaANE

/// The Swift generator, sampler (min-p and the repetition penalty included), stop strings and cascade
/// scheduler against what Python's generation loop and sampler gave on the same bigram model, prompt
/// and seed (`generation.json`, written by tests/swift_fixtures.py): one finish-reason vocabulary, one
/// generator, one per-branch seeding rule.
///
/// Python's token ids stop before an end-of-sequence token; the Swift stream includes it, so it is
/// dropped here before comparing.
final class GenerationFixtureTests: XCTestCase {
    private struct Run {
        let tokens: [Int]
        let finishReason: String
        let text: String
    }

    private struct Case {
        let prompt: [Int]
        let maxNewTokens: Int
        let contextLength: Int
        let prefillLength: Int
        let sampling: SamplingParameters
        let stop: [String]
        let single: Run
        let branches: [Run]
    }

    private struct Fixture {
        let finishReasons: [String]
        let generators: [(seed: UInt64, next: [UInt64])]
        let eos: Int
        let table: [[Float]]
        let cases: [Case]
    }

    private func load() throws -> Fixture {
        let root = try JSONValue.parse(Data(contentsOf: try Fixtures.url("generation.json")))
        func run(_ v: JSONValue) -> Run {
            Run(tokens: v["tokens"]?.arrayValue?.compactMap(\.intValue) ?? [],
                finishReason: v["finish_reason"]?.stringValue ?? "", text: v["text"]?.stringValue ?? "")
        }
        let cases = (root["cases"]?.arrayValue ?? []).map { c in
            Case(prompt: c["prompt"]?.arrayValue?.compactMap(\.intValue) ?? [],
                 maxNewTokens: c["max_new_tokens"]?.intValue ?? 0,
                 contextLength: c["context_length"]?.intValue ?? 0,
                 prefillLength: c["prefill_length"]?.intValue ?? 0,
                 sampling: SamplingParameters(temperature: Float(c["temperature"]?.doubleValue ?? 0),
                                              topK: c["top_k"]?.intValue ?? 0,
                                              topP: Float(c["top_p"]?.doubleValue ?? 1),
                                              minP: Float(c["min_p"]?.doubleValue ?? 0),
                                              repetitionPenalty: Float(c["repetition_penalty"]?.doubleValue ?? 1),
                                              seed: UInt64(c["seed"]?.stringValue ?? "") ?? 0),
                 stop: c["stop"]?.arrayValue?.compactMap(\.stringValue) ?? [],
                 single: run(c),
                 branches: (c["branches"]?.arrayValue ?? []).map(run))
        }
        let generators = (root["generators"]?.arrayValue ?? []).map { g in
            (seed: UInt64(g["seed"]?.stringValue ?? "") ?? 0,
             next: (g["next"]?.arrayValue ?? []).compactMap { $0.stringValue.flatMap { UInt64($0) } })
        }
        let table = (root["table"]?.arrayValue ?? []).map { row in
            (row.arrayValue ?? []).map { Float($0.doubleValue ?? .nan) }
        }
        let fixture = Fixture(finishReasons: root["finish_reasons"]?.arrayValue?.compactMap(\.stringValue) ?? [],
                              generators: generators, eos: root["eos"]?.intValue ?? -1, table: table, cases: cases)
        XCTAssertFalse(fixture.cases.isEmpty)
        XCTAssertFalse(fixture.generators.isEmpty)
        return fixture
    }

    private func withoutEndOfSequence(_ tokens: [Int], _ eos: Int) -> [Int] {
        tokens.last == eos ? Array(tokens.dropLast()) : tokens
    }

    func testFinishReasonsAreThePythonVocabulary() throws {
        XCTAssertEqual(FinishReason.allCases.map(\.rawValue), try load().finishReasons)
    }

    func testSeededRandomGivesPythonsNumbers() throws {
        for g in try load().generators {
            var rng = SeededRandom(seed: g.seed)
            XCTAssertEqual(g.next.map { _ in rng.next() }, g.next, "seed \(g.seed)")
        }
    }

    func testGeneratorGivesPythonsTokensAndFinishReasons() async throws {
        let f = try load()
        let table = f.table
        XCTAssertTrue(f.cases.contains { $0.sampling.minP > 0 } && f.cases.contains { $0.sampling.repetitionPenalty != 1 })
        for c in f.cases where c.stop.isEmpty {  // stop strings: below
            let model = ClosurePredictor(contextLength: c.contextLength, prefillLength: c.prefillLength) { window in
                table[Int(window.tokens[window.count - 1])]
            }
            let generator = Generator(predictor: model, eosTokenIds: [f.eos])
            let (tokens, stats) = try await generator.generateAll(prompt: c.prompt, maxNewTokens: c.maxNewTokens,
                                                                  sampling: c.sampling)
            XCTAssertEqual(withoutEndOfSequence(tokens, f.eos), c.single.tokens, "prompt \(c.prompt)")
            XCTAssertEqual(stats.stopReason.rawValue, c.single.finishReason, "prompt \(c.prompt)")
        }
    }

    /// The text streamed through `StopStrings` (as the CLI streams it), cut where Python's
    /// `TextStream` cut it, and the generation left at the token that completed the stop string.
    func testStopStringsCutWherePythonCuts() async throws {
        let f = try load()
        let table = f.table
        XCTAssertTrue(f.cases.contains { $0.single.finishReason == "stop" })
        for c in f.cases where c.single.finishReason != "eos" {
            let model = ClosurePredictor(contextLength: c.contextLength, prefillLength: c.prefillLength) { window in
                table[Int(window.tokens[window.count - 1])]
            }
            let generator = Generator(predictor: model, eosTokenIds: [f.eos]) { $0.map(String.init).joined(separator: " ") }
            var stops = StopStrings(c.stop)
            var tokens: [Int] = []
            var shown = ""
            var reason = ""
            for try await event in generator.generate(prompt: c.prompt, maxNewTokens: c.maxNewTokens, sampling: c.sampling) {
                switch event {
                case let .token(id, text):
                    tokens.append(id)
                    shown += stops.push(text)
                case let .finished(stats):
                    reason = stats.stopReason.rawValue
                }
                if stops.stopped {
                    reason = FinishReason.stop.rawValue
                    break
                }
            }
            XCTAssertEqual(tokens, c.single.tokens, "prompt \(c.prompt)")
            XCTAssertEqual(reason, c.single.finishReason, "prompt \(c.prompt)")
            XCTAssertEqual(stops.text, c.single.text, "prompt \(c.prompt)")
            XCTAssertTrue(shown.hasPrefix(stops.text), "prompt \(c.prompt)")
        }
    }

    func testCascadeBranchesArePythonsSeedPlusIndex() async throws {
        let f = try load()
        let table = f.table
        let width = 3
        for c in f.cases where !c.branches.isEmpty {
            let scheduler = CascadeScheduler(branchWidth: width, prefixLength: c.prompt.count,
                                             suffixCapacity: c.maxNewTokens + 1, eosTokenIds: [f.eos])
            let requests = c.branches.indices.map {
                BranchRequest(sampling: c.sampling.branch($0), maxNewTokens: c.maxNewTokens)
            }
            let results = try await scheduler.run(requests, prefixLogits: table[c.prompt.last!]) { step in
                (0..<width).map { slot in
                    step.active[slot] ? table[Int(step.tokens[slot])] : [Float](repeating: 0, count: table.count)
                }
            }
            XCTAssertEqual(results.map { withoutEndOfSequence($0.tokens, f.eos) }, c.branches.map(\.tokens),
                           "prompt \(c.prompt)")
            XCTAssertEqual(results.map(\.stopReason.rawValue), c.branches.map(\.finishReason), "prompt \(c.prompt)")
        }
    }
}
