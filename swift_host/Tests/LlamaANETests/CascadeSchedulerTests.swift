import XCTest
@testable import LlamaANE

/// The scheduler against a fake "decode_branches" model that keeps a private suffix cache per slot.
final class CascadeSchedulerTests: XCTestCase {
    private let vocab = 40
    private let eos = 2
    private let prefix = [11, 12, 13, 14, 15]

    private func requests() -> [BranchRequest] {
        (0..<7).map { i in
            BranchRequest(forcedTokens: i % 3 == 0 ? [] : Array(repeating: 20 + i, count: i % 3),
                          sampling: SamplingParameters(temperature: 1, topK: 8, seed: UInt64(100 + i)),
                          maxNewTokens: [0, 1, 5, 12, 30, 30, 9][i])
        } + [BranchRequest(forcedTokens: Array(30..<50), maxNewTokens: 4)]  // more forced tokens than the suffix holds
    }

    func testEveryGroupingEqualsDecodingEachBranchAlone() async throws {
        let suffixCapacity = 16
        let expected = requests().map {
            FakeModel.decodeAlone(prefix: prefix, $0, suffixCapacity: suffixCapacity, vocab: vocab, eos: eos)
        }
        XCTAssertTrue(expected.contains { $0.stopReason == .eos }, "the fixture should exercise EOS")
        XCTAssertTrue(expected.contains { $0.stopReason == .context }, "the fixture should exercise a full suffix")

        for width in [1, 3, 4, 8] {
            let scheduler = CascadeScheduler(branchWidth: width, prefixLength: prefix.count,
                                             suffixCapacity: suffixCapacity, eosTokenIds: [eos])
            var slotCache = [[Int]](repeating: [], count: width)
            var fedPerBranch = [Int](repeating: 0, count: requests().count)
            var problems: [String] = []
            let results = try await scheduler.run(requests(), prefixLogits: FakeModel.logits(prefix, vocab: vocab, eos: eos)) { step in
                XCTAssertEqual(step.tokens.count, width)
                if step.startsGroup { slotCache = [[Int]](repeating: [], count: width) }
                return (0..<width).map { slot in
                    guard step.active[slot] else {
                        if step.tokens[slot] != 0 { problems.append("inactive slot \(slot) carries a token") }
                        return [Float](repeating: 0, count: self.vocab)
                    }
                    guard let b = step.branches[slot] else { problems.append("active slot without a branch"); return [] }
                    fedPerBranch[b] += 1
                    // Writing at the given position, as a real cache would, overwrites stale entries.
                    let pos = step.suffixPositions[slot]
                    if pos > slotCache[slot].count { problems.append("suffix position \(pos) skips entries") }
                    slotCache[slot] = Array(slotCache[slot].prefix(pos)) + [Int(step.tokens[slot])]
                    return FakeModel.logits(self.prefix + slotCache[slot], vocab: self.vocab, eos: self.eos)
                }
            }
            XCTAssertEqual(problems, [], "width \(width)")
            XCTAssertEqual(results, expected, "width \(width)")
            // A branch is active exactly for the tokens it feeds: masked out once it has stopped.
            for (b, r) in requests().enumerated() {
                // Fed: the forced tokens, then every generated token but the last.
                let fed = expected[b].stopReason == .context ? suffixCapacity
                    : r.forcedTokens.count + max(expected[b].tokens.count - 1, 0)
                XCTAssertEqual(fedPerBranch[b], r.maxNewTokens == 0 ? 0 : fed, "width \(width) branch \(b)")
            }
        }
    }

    func testGroupsRunInOrderAndNeverExceedTheWidth() async throws {
        let scheduler = CascadeScheduler(branchWidth: 3, prefixLength: 1, suffixCapacity: 100, eosTokenIds: [])
        let reqs = (0..<8).map { _ in BranchRequest(maxNewTokens: 4) }
        var groupsSeen: [Int] = []
        _ = try await scheduler.run(reqs, prefixLogits: [0, 1]) { step in
            if groupsSeen.last != step.group { groupsSeen.append(step.group) }
            let members = step.branches.compactMap { $0 }
            XCTAssertEqual(Set(members), Set((step.group * 3)..<min(step.group * 3 + 3, 8)))
            return Array(repeating: [0, 1], count: 3)
        }
        XCTAssertEqual(groupsSeen, [0, 1, 2])
    }

    func testZeroWidthIsRefused() async {
        let scheduler = CascadeScheduler(branchWidth: 0, prefixLength: 1, suffixCapacity: 4, eosTokenIds: [])
        do {
            _ = try await scheduler.run([BranchRequest(maxNewTokens: 2)], prefixLogits: [0]) { _ in [] }
            XCTFail("expected noBranchWidth")
        } catch {
            XCTAssertEqual(error as? GenerationError, .noBranchWidth)
        }
    }
}
