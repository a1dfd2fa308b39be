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
/// state (`ConvStateCarry`) equal to Python's runtime on fixed arrays (`conv_state.json`).
final class ConvStateTests: XCTestCase {
    /// Every phase of every chunk with conv layers reads their state: with input caches as
    /// `conv_state` (Lc, channels, 1, width), returning the window's `conv_new` for the host to carry;
    /// with state caches as a state the chunk writes after `window_tokens`; in the cascade as
    /// `conv_branches` (Lc, channels, B, width) with each branch's `conv_new`. A chunk of conv layers
    /// only has no K/V and no cache update; an attention chunk keeps its K/V as before.
    func testTheConvStateIsWiredByNameInEveryPhase() throws {
        var convOnly = 0, attention = 0
        for name in FamilyExportTests.conv {
            let manifest = try Manifest.load(from: Fixtures.url(name))
            let conv = try XCTUnwrap(manifest.cache.conv, name)
            XCTAssertEqual(Set(conv.layers), Set(manifest.config.convLayers), name)
            XCTAssertEqual(conv.kernel, manifest.config.convKernel)
            XCTAssertGreaterThanOrEqual(conv.width, conv.kernel - 1)
            XCTAssertEqual(conv.channels, manifest.config.hiddenSize)
            XCTAssertNil(manifest.cache.sliding)
            XCTAssertEqual(manifest.rewindLimit, 0, "\(name): a conv state cannot go back")
            let wiring = try PipelineWiring(manifest: manifest)
            let phases = PipelineWiring.phases(of: manifest)
            XCTAssertEqual(phases, [.prefill, .decode, .decodeBranches], name)
            for phase in phases {
                for (i, chunk) in manifest.chunks.enumerated() {
                    let label = "\(name) \(chunk.model) \(phase.rawValue)"
                    let rows = manifest.cacheRows(of: chunk)
                    let function = try manifest.function(chunk.model, phase.rawValue)
                    let inputs = try XCTUnwrap(wiring.chunkInputs[phase]?[i], label)
                    let states = try XCTUnwrap(wiring.chunkStates[phase]?[i], label)
                    let carry = try XCTUnwrap(wiring.convCarry[phase]?[i], label)
                    XCTAssertEqual(rows.conv, chunk.layers.filter(conv.layers.contains).count, label)
                    if rows.full == 0 {
                        XCTAssertNil(chunk.cacheUpdate[phase.rawValue], "\(label): no K/V, no cache update")
                        XCTAssertEqual(try XCTUnwrap(wiring.updatedState[phase]?[i], label), [], label)
                        XCTAssertNil(inputs[TensorNames.kCache], label)
                        XCTAssertFalse(states.contains { $0.name == TensorNames.kCache }, label)
                        if phase == .decode { convOnly += 1 }
                    } else if phase == .decode {
                        attention += 1
                        XCTAssertTrue(inputs[TensorNames.kCache] == .cache(TensorNames.kCache)
                                      || states.contains { $0.name == TensorNames.kCache }, label)
                    }
                    guard rows.conv > 0 else {
                        XCTAssertEqual(carry, ConvCarry.none, label)
                        XCTAssertNil(function.output(TensorNames.convNew), label)
                        continue
                    }
                    let state = [rows.conv, conv.channels, 1, conv.width]
                    let new = function.output(TensorNames.convNew)
                    if phase == .decodeBranches {
                        let width = try XCTUnwrap(manifest.branchWidth)
                        XCTAssertEqual(carry, .branches, label)
                        XCTAssertEqual(inputs[TensorNames.convBranches], .convBranches, label)
                        XCTAssertEqual(function.input(TensorNames.convBranches)?.shape, [rows.conv, conv.channels, width, conv.width])
                        XCTAssertEqual(new?.shape, [rows.conv, conv.channels, 1, width], label)
                    } else if manifest.cache.inStates {
                        XCTAssertEqual(carry, .inState, label)
                        XCTAssertEqual(states.first { $0.name == TensorNames.convState }?.shape, state, label)
                        XCTAssertEqual(inputs[TensorNames.windowTokens], .value(TensorNames.windowTokens), label)
                        XCTAssertNil(new, "\(label): the chunk keeps its state itself")
                    } else {
                        XCTAssertEqual(carry, .fromOutput, label)
                        XCTAssertEqual(inputs[TensorNames.convState], .convState, label)
                        XCTAssertEqual(function.input(TensorNames.convState)?.shape, state, label)
                        let s = phase == .prefill ? manifest.prefillLength : 1
                        XCTAssertEqual(new?.shape, [rows.conv, conv.channels, 1, s], label)
                    }
                }
            }
        }
        XCTAssertGreaterThan(convOnly, 0, "a chunk of conv layers only")
        XCTAssertGreaterThan(attention, 0, "a chunk with attention layers")
    }

    /// A manifest whose conv state disagrees with its config, its chunks or its tensors is refused,
    /// naming the field.
    func testAConvStateThatDisagreesWithTheExportIsRefusedByName() throws {
        let object = try ManifestEdits.object("export_lfm2")
        XCTAssertNoThrow(try ManifestEdits.decode(object))
        func refused(_ edit: (inout [String: Any]) throws -> Void, mentioning words: [String], line: UInt = #line) throws {
            try ManifestEdits.assertRefused(object, edit, mentioning: words, line: line)
        }
        func setConv(_ m: inout [String: Any], _ key: String, _ value: Any) throws {
            try ManifestEdits.setCache(&m, "conv", key, value)
        }
        func editFunction(_ m: inout [String: Any], _ model: String, _ function: String,
                          _ body: (inout [String: Any]) throws -> Void) throws {
            var models = try XCTUnwrap(m["models"] as? [String: Any])
            var entry = try XCTUnwrap(models[model] as? [String: Any])
            var functions = try XCTUnwrap(entry["functions"] as? [String: Any])
            var f = try XCTUnwrap(functions[function] as? [String: Any])
            try body(&f)
            functions[function] = f
            entry["functions"] = functions
            models[model] = entry
            m["models"] = models
        }
        try refused({ try setConv(&$0, "layers", [0, 1]) }, mentioning: ["cache.conv.layers [0, 1]", "config.conv_layers [0, 1, 3]"])
        try refused({ try setConv(&$0, "kernel", 4) }, mentioning: ["cache.conv", "config.conv_kernel 3", "kernel 4"])
        try refused({ try setConv(&$0, "width", 1) }, mentioning: ["cache.conv", "width 1"])
        try refused({ try setConv(&$0, "width", 64) }, mentioning: ["conv_state", "width 64"])
        try refused({ try ManifestEdits.removeCache(&$0, "conv") }, mentioning: ["conv_state", "cache.conv names none"])
        // chunk_1 holds layers 2 (attention) and 3 (conv): a plan giving it layer 1 too disagrees with its state
        try refused({ try ManifestEdits.setChunkLayers(&$0, [[0], [1, 2, 3]]) }, mentioning: ["conv_state of 2 layers", "1 of the chunk's layers [0] convolve"])
        // a chunk whose conv state the host could not carry: it returns no conv_new
        var unreturned = object
        try editFunction(&unreturned, "chunk_1", "decode") { f in
            let outputs = try XCTUnwrap(f["outputs"] as? [[String: Any]])
            f["outputs"] = outputs.filter { $0["name"] as? String != TensorNames.convNew }
        }
        XCTAssertThrowsError(try PipelineWiring(manifest: ManifestEdits.decode(unreturned))) { error in
            XCTAssertEqual(error as? ManifestError, .inconsistent("chunk_1 (decode) does not return conv_new, but its conv "
                + "state is carried by the host from it"))
        }
        // a speculative verify window cannot drop a rejected draft from a conv state
        try refused({ $0["verify_window"] = 8 }, mentioning: ["verify_window is 8", "cache.conv"])
    }

    /// A rewind by any token starts again from position 0 (the conv state holds only the last
    /// tokens' values): a next prompt that extends the cached tokens prefills only its new ones, one
    /// that forgets any of them prefills everything, as Python's runtime does.
    func testAnyRewindStartsAgainFromPositionZero() async throws {
        let manifest = try Manifest.load(from: Fixtures.url("export_lfm2"))
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

    // MARK: ConvStateCarry

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

        func with<R>(_ body: (ConvStateCarry.Tensor<Float>) throws -> R) rethrows -> R {
            try buffer.withUnsafeMutableBufferPointer { p in
                try body(ConvStateCarry.Tensor(base: p.baseAddress!, shape: shape, strides: strides))
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
        let root = try JSONValue.parse(Data(contentsOf: Fixtures.url("conv_state.json")))
        let windows = try XCTUnwrap(root["windows"]?.arrayValue)
        let branches = try XCTUnwrap(root["branches"]?.arrayValue)
        XCTAssertGreaterThanOrEqual(windows.count, 4)
        XCTAssertGreaterThanOrEqual(branches.count, 2)
        for (k, w) in windows.enumerated() {
            let state = Storage(Self.flat(w["state"]), shape: Self.shape(w["state"]), rowPad: 3)
            let new = Storage(Self.flat(w["new"]), shape: Self.shape(w["new"]), rowPad: 5)
            let n = try XCTUnwrap(w["real_tokens"]?.intValue)
            try state.with { s in try new.with { v in try ConvStateCarry.apply(.afterWindow(realTokens: n), to: s, from: v) } }
            XCTAssertEqual(state.values, Self.flat(w["after"]), "window \(k): \(n) real tokens")
            XCTAssertTrue(state.buffer.filter(\.isNaN).count == state.buffer.count - state.values.count, "window \(k): padding untouched")
        }
        for (k, b) in branches.enumerated() {
            let prefix = Storage(Self.flat(b["prefix"]), shape: Self.shape(b["prefix"]), rowPad: 1)
            let copiedShape = Self.shape(b["copied"])
            let all = Storage([Float](repeating: 0, count: copiedShape.reduce(1, *)), shape: copiedShape, rowPad: 2)
            let new = Storage(Self.flat(b["new"]), shape: Self.shape(b["new"]), rowPad: 3)
            try all.with { t in try prefix.with { s in try ConvStateCarry.apply(.copyToBranches, to: t, from: s) } }
            XCTAssertEqual(all.values, Self.flat(b["copied"]), "branches \(k): copies of the prefix's state")
            try all.with { t in try new.with { v in try ConvStateCarry.apply(.afterBranchStep, to: t, from: v) } }
            XCTAssertEqual(all.values, Self.flat(b["after"]), "branches \(k): one step on")
        }
    }

    /// Values that do not fit the state are refused, not read past their end.
    func testMismatchedConvTensorsAreRefused() throws {
        let state = Storage([Float](repeating: 0, count: 2 * 3 * 4), shape: [2, 3, 1, 4])
        let fewer = Storage([Float](repeating: 1, count: 2 * 2 * 5), shape: [2, 2, 1, 5])
        let short = Storage([Float](repeating: 1, count: 2 * 3 * 2), shape: [2, 3, 1, 2])
        XCTAssertThrowsError(try state.with { s in try fewer.with { v in try ConvStateCarry.afterWindow(s, new: v, realTokens: 1) } })
        XCTAssertThrowsError(try state.with { s in try short.with { v in try ConvStateCarry.afterWindow(s, new: v, realTokens: 3) } })
        XCTAssertThrowsError(try state.with { s in try short.with { v in try ConvStateCarry.afterWindow(s, new: v, realTokens: 0) } })
        let branches = Storage([Float](repeating: 0, count: 2 * 3 * 3 * 4), shape: [2, 3, 3, 4])
        XCTAssertThrowsError(try branches.with { t in try short.with { v in try ConvStateCarry.afterBranchStep(t, new: v) } },
                             "two values for three branches")
        XCTAssertEqual(state.values, [Float](repeating: 0, count: 24))
    }

    #if canImport(CoreML)
    /// The LFM2 exports on Core ML (CPU): cascade branches decode as each would alone after the
    /// same prefix (each branch's conv state a copy of the prefix's), and a next prompt that
    /// forgets a token starts again from position 0 and still gives Python's tokens.
    func testCoreMLRunsTheConvStateThroughTheCascadeAndRewinds() async throws {
        for name in FamilyExportTests.conv {
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
            XCTAssertEqual(again.stats.reusedTokens, 0, "\(name): the conv state cannot go back")
            let back = try await generator.generateAll(prompt: e.promptIds, maxNewTokens: e.tokens.count)
            XCTAssertEqual(back.tokens, e.tokens, "\(name): from position 0 again")
        }
    }
    #endif
}
