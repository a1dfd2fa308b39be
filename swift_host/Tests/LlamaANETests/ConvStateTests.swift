import Foundation
import XCTest
@testable import LlamaANE
#if canImport(CoreML)
import CoreML
#endif

/// LFM2's conv layers' state (`cache.conv`) in the exports of `FamilyExportTests.conv` (input caches
/// with a chunk of conv layers only and a cascade; state caches, a chunk per layer, a cascade and a
/// folded head): the state wired by name in every phase, a manifest whose state disagrees with the
/// export refused by name, rewinds starting again from position 0, and the host's moves of the
/// state (`StateCarry`) equal to Python's runtime on fixed arrays (`conv_state.json`).
final class ConvStateTests: XCTestCase {
    /// Every phase of every chunk with conv layers (and Qwen3.5's linear-attention layers, which also
    /// keep a recurrent state) reads their states: with input caches as `conv_state` (Lc, channels, 1,
    /// width) and `delta_state` (Ld, H*Dk, 1, Dv), returning `conv_new` (the window's values) and
    /// `delta_new` (the state after it) for the host to carry; with state caches as states the chunk
    /// writes after `window_tokens`; in the cascade as `conv_branches` (Lc, channels, B, width) and
    /// `delta_branches` (Ld*B, H*Dk, 1, Dv, layer-major) with each branch's `conv_new` and `delta_new`.
    /// A chunk of such layers only has no K/V and no cache update; an attention chunk keeps its K/V
    /// as before.
    func testTheCarriedStatesAreWiredByNameInEveryPhase() throws {
        var stateOnly = 0, attention = 0, recurrent = 0
        for name in FamilyExportTests.conv + FamilyExportTests.delta {
            let manifest = try Manifest.load(from: Fixtures.url(name))
            let config = manifest.config
            let conv = try XCTUnwrap(manifest.cache.conv, name)
            XCTAssertEqual(Set(conv.layers), Set(config.convLayers + config.deltaLayers), name)
            XCTAssertEqual(conv.kernel, config.convKernel)
            XCTAssertGreaterThanOrEqual(conv.width, conv.kernel - 1)
            if let delta = manifest.cache.delta {
                XCTAssertTrue(["qwen3_5_text", "olmo_hybrid"].contains(config.modelType ?? ""), name)
                XCTAssertEqual(Set(delta.layers), Set(config.deltaLayers), name)
                XCTAssertEqual([delta.heads, delta.keyDim, delta.valueDim], [config.deltaValueHeads, config.deltaKeyDim, config.deltaValueDim])
            } else {
                XCTAssertEqual(conv.channels, config.hiddenSize)
                XCTAssertEqual(config.deltaLayers, [], name)
            }
            XCTAssertNil(manifest.cache.sliding)
            XCTAssertEqual(manifest.rewindLimit, 0, "\(name): a conv state cannot go back")
            let wiring = try PipelineWiring(manifest: manifest)
            let phases = PipelineWiring.phases(of: manifest)
            XCTAssertEqual(phases, [.prefill, .decode, .decodeBranches], name)
            let width = try XCTUnwrap(manifest.branchWidth)
            for phase in phases {
                for (i, chunk) in manifest.chunks.enumerated() {
                    let label = "\(name) \(chunk.model) \(phase.rawValue)"
                    let rows = manifest.cacheRows(of: chunk)
                    let function = try manifest.function(chunk.model, phase.rawValue)
                    let inputs = try XCTUnwrap(wiring.chunkInputs[phase]?[i], label)
                    let states = try XCTUnwrap(wiring.chunkStates[phase]?[i], label)
                    XCTAssertEqual(rows.conv, chunk.layers.filter(conv.layers.contains).count, label)
                    XCTAssertEqual(rows.delta, chunk.layers.filter(config.deltaLayers.contains).count, label)
                    if rows.full == 0 {
                        XCTAssertNil(chunk.cacheUpdate[phase.rawValue], "\(label): no K/V, no cache update")
                        XCTAssertEqual(try XCTUnwrap(wiring.updatedState[phase]?[i], label), [], label)
                        XCTAssertNil(inputs[TensorNames.kCache], label)
                        XCTAssertFalse(states.contains { $0.name == TensorNames.kCache }, label)
                        if phase == .decode { stateOnly += 1 }
                    } else if phase == .decode {
                        attention += 1
                        XCTAssertTrue(inputs[TensorNames.kCache] == .cache(TensorNames.kCache)
                                      || states.contains { $0.name == TensorNames.kCache }, label)
                    }
                    for carried in CarriedState.allCases {
                        let carry = wiring.carry(carried, phase, chunk: i)
                        let new = function.output(carried.newName)
                        let layers = carried == .conv ? rows.conv : rows.delta
                        guard layers > 0, let channels = carried == .conv ? conv.channels : manifest.cache.delta?.channels else {
                            XCTAssertEqual(carry, CarryMode.none, label)
                            XCTAssertNil(new, label)
                            continue
                        }
                        let columns = carried == .conv ? conv.width : manifest.cache.delta?.valueDim ?? 0
                        let state = [layers, channels, 1, columns]
                        if carried == .delta, phase == .decode { recurrent += 1 }
                        if phase == .decodeBranches {
                            // conv: the branches along axis 2, each one value; recurrent: layer-major rows, each a state
                            let branches = carried == .conv ? [layers, channels, width, columns] : [layers * width, channels, 1, columns]
                            XCTAssertEqual(carry, .branches, label)
                            XCTAssertEqual(inputs[carried.branchesName], .carriedBranches(carried), label)
                            XCTAssertEqual(function.input(carried.branchesName)?.shape, branches, label)
                            XCTAssertEqual(new?.shape, carried == .conv ? [layers, channels, 1, width] : branches, label)
                        } else if manifest.cache.inStates {
                            XCTAssertEqual(carry, .inState, label)
                            XCTAssertEqual(states.first { $0.name == carried.stateName }?.shape, state, label)
                            XCTAssertEqual(inputs[TensorNames.windowTokens], .value(TensorNames.windowTokens), label)
                            XCTAssertNil(new, "\(label): the chunk keeps its state itself")
                        } else {
                            XCTAssertEqual(carry, .fromOutput, label)
                            XCTAssertEqual(inputs[carried.stateName], .carriedState(carried), label)
                            XCTAssertEqual(function.input(carried.stateName)?.shape, state, label)
                            let s = phase == .prefill ? manifest.prefillLength : 1
                            XCTAssertEqual(new?.shape, carried == .conv ? [layers, channels, 1, s] : state, label)
                            if carried == .delta {  // padded tokens must not move the recurrent state
                                XCTAssertEqual(inputs[TensorNames.windowTokens], .value(TensorNames.windowTokens), label)
                            }
                        }
                    }
                }
            }
        }
        XCTAssertGreaterThan(stateOnly, 0, "a chunk of conv (or linear-attention) layers only")
        XCTAssertGreaterThan(attention, 0, "a chunk with attention layers")
        XCTAssertGreaterThan(recurrent, 0, "chunks with a recurrent state")
    }

    /// A manifest whose conv state disagrees with its config, its chunks or its tensors is refused,
    /// naming the field.
    func testAConvStateThatDisagreesWithTheExportIsRefusedByName() throws {
        let object = try ManifestEdits.object("export_lfm2")
        XCTAssertNoThrow(try ManifestEdits.decode(object))
        func refused(_ edit: (inout [String: Any]) throws -> Void, mentioning words: [String], line: UInt = #line) throws {
            try ManifestEdits.assertRefused(object, edit, mentioning: words, line: line)
        }
        try refused(ManifestEdits.cacheEdit("conv", "layers", [0, 1]), mentioning: ["cache.conv.layers [0, 1]", "config.conv_layers [0, 1, 3]"])
        try refused(ManifestEdits.cacheEdit("conv", "kernel", 4), mentioning: ["cache.conv", "config.conv_kernel 3", "kernel 4"])
        try refused(ManifestEdits.cacheEdit("conv", "width", 1), mentioning: ["cache.conv", "width 1"])
        try refused(ManifestEdits.cacheEdit("conv", "width", 64), mentioning: ["conv_state", "width 64"])
        try refused({ try ManifestEdits.removeCache(&$0, "conv") }, mentioning: ["conv_state", "cache.conv names none"])
        // chunk_1 holds layers 2 (attention) and 3 (conv): a plan giving it layer 1 too disagrees with its state
        try refused({ try ManifestEdits.setChunkLayers(&$0, [[0], [1, 2, 3]]) }, mentioning: ["conv_state of 2 layers", "1 of the chunk's layers [0] convolve"])
        // a chunk whose conv state the host could not carry: it returns no conv_new
        try ManifestEdits.assertCarryNeedsOutput(object, TensorNames.convNew, carrying: TensorNames.convState)
        // a speculative verify window cannot drop a rejected draft from a conv state
        try refused({ $0["verify_window"] = 8 }, mentioning: ["verify_window is 8", "cache.conv"])
    }

    /// A rewind by any token starts again from position 0 (the conv state holds only the last
    /// tokens' values, a recurrent state all of them folded in): a next prompt that extends the
    /// cached tokens prefills only its new ones, one that forgets any of them prefills everything,
    /// as Python's runtime does.
    func testAnyRewindStartsAgainFromPositionZero() async throws {
        for name in ["export_lfm2", "export_qwen35"] {
            try await assertRewindsStartAgain(name)
        }
    }

    private func assertRewindsStartAgain(_ name: String) async throws {
        let manifest = try Manifest.load(from: Fixtures.url(name))
        XCTAssertEqual(manifest.rewindLimit, 0, name)
        let recorder = RecordingGenerator(manifest, rewindLimit: manifest.rewindLimit)
        let generator = recorder.generator!
        let first = Array(10..<30)
        _ = try await generator.generateAll(prompt: first, maxNewTokens: 1)
        let cached = generator.cachedTokens

        recorder.windows = []
        let (_, extended) = try await generator.generateAll(prompt: cached + [40, 41], maxNewTokens: 1)
        XCTAssertEqual(extended.reusedTokens, cached.count, "nothing forgotten: the state goes on")
        XCTAssertEqual(recorder.windows.first?.position, cached.count)

        recorder.windows = []
        let diverged = Array(first[..<(first.count - 1)]) + [50]
        let (_, fresh) = try await generator.generateAll(prompt: diverged, maxNewTokens: 1)
        XCTAssertEqual(fresh.reusedTokens, 0, "one token forgotten: the state cannot go back")
        XCTAssertEqual(fresh.prefilledTokens, diverged.count)
        XCTAssertEqual(recorder.windows.first?.position, 0)
        XCTAssertEqual(generator.cachedTokens, diverged)
    }

    // MARK: StateCarry

    /// Row-major values of `shape` stored with each row padded to `rowPad` extra elements (as an
    /// IOSurface pads its rows), and the tensor over that storage.
    private final class Storage {
        var buffer: [Float]
        let shape: [Int]
        let strides: [Int]

        init(_ values: [Float], shape: [Int], rowPad: Int = 0) {
            let row = shape[3] + rowPad
            strides = [shape[1] * shape[2] * row, shape[2] * row, row, 1]
            self.shape = shape
            buffer = [Float](repeating: .nan, count: shape[0] * strides[0])
            for (flat, v) in values.enumerated() { buffer[offset(flat)] = v }
        }

        private func offset(_ flat: Int) -> Int {
            var rest = flat, offset = 0
            for d in stride(from: 3, through: 0, by: -1) {
                offset += (rest % shape[d]) * strides[d]
                rest /= shape[d]
            }
            return offset
        }

        var values: [Float] { (0..<shape.reduce(1, *)).map { buffer[offset($0)] } }

        func with<R>(_ body: (StateCarry.Tensor<Float>) throws -> R) rethrows -> R {
            try buffer.withUnsafeMutableBufferPointer { p in
                try body(StateCarry.Tensor(base: p.baseAddress!, shape: shape, strides: strides))
            }
        }
    }

    private static func flat(_ v: JSONValue?) -> [Float] {
        guard let list = v?.arrayValue else { return v?.doubleValue.map { [Float($0)] } ?? [] }
        return list.flatMap { flat($0) }
    }

    private static func shape(_ v: JSONValue?) -> [Int] {
        guard let list = v?.arrayValue else { return [] }
        return [list.count] + shape(list.first)
    }

    /// The state after a window of n real tokens, and each cascade branch's (a copy of the prefix's,
    /// then one step on), on storage with padded rows: Python's runtime's values exactly.
    func testConvStateMovesAsPythonsRuntimeMovesIt() throws {
        try assertMovesAsPython(.conv, windows: "windows", branches: "branches", minimumWindows: 4)
    }

    /// Qwen3.5's recurrent state (`CarriedState.delta`): a window's delta_new replaces it, the cascade's
    /// branches are layer-major copies of the prefix's which a step's delta_new replaces, on storage
    /// with padded rows: Python's runtime's values exactly.
    func testRecurrentStateMovesAsPythonsRuntimeMovesIt() throws {
        try assertMovesAsPython(.delta, windows: "delta_windows", branches: "delta_branches", minimumWindows: 2)
    }

    /// `carried`'s moves (`CarriedState.afterWindow`, `.copyToBranches`, `.afterBranchStep`) on the
    /// cases of conv_state.json's lists `windows` and `branches`: each must give Python's values and
    /// change the state.
    private func assertMovesAsPython(_ carried: CarriedState, windows: String, branches: String, minimumWindows: Int) throws {
        let root = try JSONValue.parse(Data(contentsOf: Fixtures.url("conv_state.json")))
        let windowCases = try XCTUnwrap(root[windows]?.arrayValue)
        let branchCases = try XCTUnwrap(root[branches]?.arrayValue)
        XCTAssertGreaterThanOrEqual(windowCases.count, minimumWindows)
        XCTAssertGreaterThanOrEqual(branchCases.count, 2)
        for (k, w) in windowCases.enumerated() {
            let state = Storage(Self.flat(w["state"]), shape: Self.shape(w["state"]), rowPad: 3)
            let new = Storage(Self.flat(w["new"]), shape: Self.shape(w["new"]), rowPad: 5)
            let n = w["real_tokens"]?.intValue ?? 1
            XCTAssertNotEqual(state.values, Self.flat(w["after"]), "\(windows) \(k): the state must change")
            try state.with { s in try new.with { v in try StateCarry.apply(carried.afterWindow(realTokens: n), to: s, from: v) } }
            XCTAssertEqual(state.values, Self.flat(w["after"]), "\(windows) \(k): \(n) real tokens")
            XCTAssertTrue(state.buffer.filter(\.isNaN).count == state.buffer.count - state.values.count, "window \(k): padding untouched")
        }
        for (k, b) in branchCases.enumerated() {
            let prefix = Storage(Self.flat(b["prefix"]), shape: Self.shape(b["prefix"]), rowPad: 1)
            let copiedShape = Self.shape(b["copied"])
            let all = Storage([Float](repeating: 0, count: copiedShape.reduce(1, *)), shape: copiedShape, rowPad: 2)
            let new = Storage(Self.flat(b["new"]), shape: Self.shape(b["new"]), rowPad: 3)
            try all.with { t in try prefix.with { s in try StateCarry.apply(carried.copyToBranches, to: t, from: s) } }
            XCTAssertEqual(all.values, Self.flat(b["copied"]), "\(branches) \(k): copies of the prefix's state")
            try all.with { t in try new.with { v in try StateCarry.apply(carried.afterBranchStep, to: t, from: v) } }
            XCTAssertEqual(all.values, Self.flat(b["after"]), "\(branches) \(k): one step on")
        }
    }

    /// Values that do not fit the state are refused, not read past their end.
    func testMismatchedConvTensorsAreRefused() throws {
        let state = Storage([Float](repeating: 0, count: 2 * 3 * 4), shape: [2, 3, 1, 4])
        let fewer = Storage([Float](repeating: 1, count: 2 * 2 * 5), shape: [2, 2, 1, 5])
        let short = Storage([Float](repeating: 1, count: 2 * 3 * 2), shape: [2, 3, 1, 2])
        XCTAssertThrowsError(try state.with { s in try fewer.with { v in try StateCarry.afterWindow(s, new: v, realTokens: 1) } })
        XCTAssertThrowsError(try state.with { s in try short.with { v in try StateCarry.afterWindow(s, new: v, realTokens: 3) } })
        XCTAssertThrowsError(try state.with { s in try short.with { v in try StateCarry.afterWindow(s, new: v, realTokens: 0) } })
        let branches = Storage([Float](repeating: 0, count: 2 * 3 * 3 * 4), shape: [2, 3, 3, 4])
        XCTAssertThrowsError(try branches.with { t in try short.with { v in try StateCarry.afterBranchStep(t, new: v) } },
                             "two values for three branches")
        XCTAssertEqual(state.values, [Float](repeating: 0, count: 24))
        // recurrent states: a replacement of another shape, branch rows that are no multiple of the layers
        let other = Storage([Float](repeating: 1, count: 2 * 3 * 5), shape: [2, 3, 1, 5])
        XCTAssertThrowsError(try state.with { s in try other.with { v in try StateCarry.replace(s, with: v) } })
        let rows = Storage([Float](repeating: 0, count: 3 * 3 * 4), shape: [3, 3, 1, 4])
        XCTAssertThrowsError(try rows.with { t in try state.with { s in try StateCarry.copyToBranchRows(s, into: t) } },
                             "three rows for two layers")
        XCTAssertEqual(state.values, [Float](repeating: 0, count: 24))
        XCTAssertEqual(rows.values, [Float](repeating: 0, count: 36))
    }

    #if canImport(CoreML)
    /// The LFM2 exports on Core ML (CPU): cascade branches decode as each would alone after the
    /// same prefix (each branch's conv state a copy of the prefix's), and a next prompt that
    /// forgets a token starts again from position 0 and still gives Python's tokens.
    func testCoreMLRunsTheConvStateThroughTheCascadeAndRewinds() async throws {
        for name in FamilyExportTests.conv + FamilyExportTests.delta {
            let model = try ExportedModel(folder: Fixtures.url(name))
            let e = try FamilyExportTests.expected(name)
            let predictor = try await model.makeCoreMLPredictor(computeUnits: .cpuOnly)
            let prefix = Array(e.promptIds.prefix(13))
            let requests = [BranchRequest(maxNewTokens: 5), BranchRequest(forcedTokens: [e.tokens[0], e.tokens[1]], maxNewTokens: 5),
                            BranchRequest(forcedTokens: [7], maxNewTokens: 5)]
            let results = try await predictor.decodeBranches(prefix: prefix, branches: requests, eosTokenIds: [])
            let generator = model.generator(predictor: predictor)
            for (request, result) in zip(requests, results) {
                let alone = try await generator.generateAll(prompt: prefix + request.forcedTokens, maxNewTokens: 5)
                XCTAssertEqual(result.tokens, alone.tokens, "\(name): branch \(request.forcedTokens)")
            }
            let full = try await generator.generateAll(prompt: e.promptIds, maxNewTokens: e.tokens.count)
            XCTAssertEqual(full.tokens, e.tokens, name)
            let again = try await generator.generateAll(prompt: Array(e.promptIds.dropLast()) + [e.promptIds.last! == 5 ? 6 : 5],
                                                        maxNewTokens: 2)
            XCTAssertEqual(again.stats.reusedTokens, 0, "\(name): the conv (and recurrent) state cannot go back")
            let back = try await generator.generateAll(prompt: e.promptIds, maxNewTokens: e.tokens.count)
            XCTAssertEqual(back.tokens, e.tokens, "\(name): from position 0 again")
        }
    }
    #endif
}
