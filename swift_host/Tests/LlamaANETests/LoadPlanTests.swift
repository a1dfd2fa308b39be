import Foundation
import XCTest
@testable import LlamaANE

/// The load plan on the real fixture exports, and the lazy loading through it (`PlannedStages`, the
/// loader `CoreMLBackend` uses) with a counting stand-in for the model store: sessions run prefill
/// and decode across context buckets, a cascade and a speculative generation over backends that
/// simulate the functions on token ids and, as `CoreMLBackend` does, ask for the stage of each call's
/// phase and bucket first. Afterwards the store holds exactly the functions of the stages used, each
/// loaded once, priced as the resident model of Python's `contract/resident.py` prices them.
final class LoadPlanTests: XCTestCase {
    typealias Simulated = PipelineSimulationTests.SimulatedBackend
    typealias SimulatedVerify = VerifyPipelineTests.SimulatedVerifyBackend
    typealias Stages = PlannedStages<CountingStore, LoadedStage<PlannedFunction>>

    static let exports = ["export", "export_buckets", "export_folded", "export_gemma3", "export_gemma4", "export_lfm2",
                          "export_lfm2_state", "export_mistral_window", "export_qwen35", "export_qwen35_state", "export_state"]

    /// A stand-in for `CoreMLModelStore`: records every function it is asked for and each load that
    /// succeeded, with the modelled resident bytes after it; the loaded "model" is the function itself.
    actor CountingStore: FunctionStore {
        struct Refused: Error {}
        let runtime: ResidentModel.Runtime
        private let delay: UInt64
        private var failOnce: Set<PlannedFunction>
        /// Every call of `load`, failed ones included.
        private(set) var asked: [PlannedFunction] = []
        /// The functions loaded, in order.
        private(set) var loads: [PlannedFunction] = []
        /// After each load, the modelled resident bytes of every function loaded so far.
        private(set) var residentAfterEachLoad: [Int] = []

        init(runtime: ResidentModel.Runtime, delay: UInt64 = 0, failOnce: Set<PlannedFunction> = []) {
            self.runtime = runtime
            self.delay = delay
            self.failOnce = failOnce
        }

        func load(_ function: PlannedFunction) async throws -> PlannedFunction {
            asked.append(function)
            if delay > 0 { try await Task.sleep(nanoseconds: delay) }
            if failOnce.remove(function) != nil { throw Refused() }
            loads.append(function)
            residentAfterEachLoad.append(ResidentModel(runtime: runtime, holding: loads).bytes)
            return function
        }
    }

    /// A backend that, like `CoreMLBackend`, takes each call's stage from `stages` (made on first use)
    /// before it runs the call on `inner`, which simulates the functions on token ids. It notes a call
    /// whose stage does not hold the function the call runs.
    final class PlannedBackend<Inner: PipelineBackend>: PipelineBackend, @unchecked Sendable {
        struct Activations {
            var inner: Inner.Activations
            /// The window's context bucket, whose stage gives the logits (nil: the whole context).
            var bucket: Int?
        }

        let inner: Inner
        let stages: Stages
        let manifest: Manifest
        private let lock = NSLock()
        private var noted: [String] = []

        init(_ inner: Inner, stages: Stages, manifest: Manifest) {
            self.inner = inner
            self.stages = stages
            self.manifest = manifest
        }

        var chunkCount: Int { inner.chunkCount }
        var problems: [String] { lock.lock(); defer { lock.unlock() }; return noted }

        /// The stage of `phase` at `bucket`; its chunk `chunk` and that chunk's cache update (`update`)
        /// must be the functions of this phase and bucket.
        func stage(_ phase: Phase, bucket: Int?, chunk: Int? = nil, update: Bool = false) async throws -> LoadedStage<PlannedFunction> {
            let bucket = bucket ?? manifest.contextLength
            let stage = try await stages.stage(phase, bucket: bucket)
            let function = manifest.buckets.functionName(phase, bucket: bucket)
            var wrong: [String] = []
            if stage.plan.function != function || stage.embeddings.first?.function != function {
                wrong.append("\(phase.rawValue) at \(bucket) got the stage of \(stage.plan.function)")
            }
            if let chunk {
                let expected = manifest.chunks[chunk]
                if stage.chunks[chunk] != (try PlannedFunction(manifest, model: expected.model, function: function)) {
                    wrong.append("chunk \(chunk) of \(function) is \(stage.chunks[chunk])")
                }
                if update, stage.updates[chunk]?.function != expected.cacheUpdate[function] {
                    wrong.append("chunk \(chunk)'s \(function) cache update is \(String(describing: stage.updates[chunk]))")
                }
            }
            note(wrong)
            return stage
        }

        private func note(_ wrong: [String]) { lock.lock(); noted += wrong; lock.unlock() }

        func embed(_ window: TokenWindow, bucket: Int) async throws -> Activations {
            _ = try await stage(window.phase, bucket: bucket)
            return Activations(inner: try await inner.embed(window, bucket: bucket), bucket: bucket)
        }

        func runChunk(_ index: Int, _ input: Activations, phase: Phase, bucket: Int) async throws -> Activations {
            _ = try await stage(phase, bucket: bucket, chunk: index)
            return Activations(inner: try await inner.runChunk(index, input.inner, phase: phase, bucket: bucket), bucket: input.bucket)
        }

        func updateCache(_ index: Int, phase: Phase, bucket: Int, position: Int) async throws {
            _ = try await stage(phase, bucket: bucket, chunk: index, update: true)
            try await inner.updateCache(index, phase: phase, bucket: bucket, position: position)
        }

        func logits(_ input: Activations, phase: Phase, column: Int) async throws -> [Float] {
            _ = try await stage(phase, bucket: input.bucket)
            return try await inner.logits(input.inner, phase: phase, column: column)
        }

        func resetCaches() async throws { try await inner.resetCaches() }
    }

    // MARK: the plan

    /// Every function of the manifest's models, as (model, function) names.
    private func manifestFunctions(_ manifest: Manifest) -> Set<[String]> {
        Set(manifest.models.flatMap { model, entry in entry.functions.keys.map { [model, $0] } })
    }

    /// Python's resident model of `functions` (`contract/resident.py`), written out from its figures:
    /// per package file, its weights times the first function's multiple plus each further one's.
    private func pythonResident(_ functions: [PlannedFunction], first: Double, further: Double) -> Int {
        var names: [String: Set<String>] = [:], weights: [String: Int] = [:]
        for f in functions {
            names[f.file, default: []].insert(f.functionName)
            weights[f.file] = f.weightBytes
        }
        let total = names.map { file, held in Double(weights[file] ?? 0) * (first + Double(held.count - 1) * further) }.reduce(0, +)
        return Int(total.rounded(.toNearestOrEven))
    }

    func testTheFullPlanIsEveryFunctionOfTheManifestAsPythonsLoadPlanNamesThem() throws {
        for name in Self.exports {
            let manifest = try Manifest.load(from: Fixtures.url(name))
            let plan = try LoadPlan(manifest: manifest)
            let functions = plan.functions
            // Python's load_plan: every function of every model, each once, with its package and weights.
            XCTAssertEqual(Set(functions.map { [$0.model, $0.function] }), manifestFunctions(manifest), name)
            XCTAssertEqual(functions.count, manifest.models.values.map(\.functions.count).reduce(0, +), name)
            for f in functions {
                let entry = try manifest.function(f.model, f.function)
                XCTAssertEqual([f.file, f.functionName], [entry.file, entry.functionName], "\(name) \(f)")
                let weights = try XCTUnwrap(manifest.weights?[f.model], "\(name) records no weights of \(f.model)")
                XCTAssertEqual(f.weightBytes, weights.readBytes ?? weights.bytes, "\(name) \(f)")
            }
            XCTAssertGreaterThan(functions.map(\.weightBytes).reduce(0, +), 0, name)
            // One stage per phase at the whole context, and per smaller bucket for prefill and decode.
            let buckets = manifest.buckets
            let phases = PipelineWiring.phases(of: manifest)
            XCTAssertEqual(plan.stages.map { "\($0.phase.rawValue)@\($0.bucket)" },
                           phases.map { "\($0.rawValue)@\(manifest.contextLength)" }
                           + buckets.sizes.dropLast().flatMap { b in ["prefill@\(b)", "decode@\(b)"] }, name)
            for stage in plan.stages {
                let fn = buckets.functionName(stage.phase, bucket: stage.bucket)
                XCTAssertEqual(stage.function, fn, name)
                XCTAssertEqual(stage.embeddings.map(\.model), manifest.embeddings.models, name)
                XCTAssertEqual(stage.embeddings.map(\.function), [fn] + Array(repeating: stage.phase.rawValue,
                                                                             count: manifest.embeddings.models.count - 1), name)
                XCTAssertEqual(stage.chunks.map(\.model), manifest.chunks.map(\.model), name)
                XCTAssertTrue(stage.chunks.allSatisfy { $0.function == fn }, "\(name) \(fn)")
                let writesInChunk = manifest.cache.inStates && ContextBuckets.isBucketed(stage.phase)
                XCTAssertEqual(stage.updates.map { $0?.function }, manifest.chunks.map { writesInChunk ? nil : $0.cacheUpdate[fn] },
                               "\(name) \(fn)")
                XCTAssertTrue(stage.updates.allSatisfy { $0 == nil || $0?.model == "cache_update" }, name)
                XCTAssertEqual(stage.lmHeads.map(\.model), manifest.lmHead.models, name)
                XCTAssertTrue(stage.lmHeads.allSatisfy { $0.function == stage.phase.rawValue }, name)
            }
            // Python's resident() of the whole plan, from the Forge figures (mid, low, high; one copy).
            let resident = ResidentModel(manifest: manifest, holding: functions)
            XCTAssertEqual(resident.runtime, .coreML, name)
            XCTAssertEqual(resident.bytes, pythonResident(functions, first: 1.45, further: 0.695), name)
            XCTAssertEqual(resident.lowBytes, pythonResident(functions, first: 1.0, further: 0.37), name)
            XCTAssertEqual(resident.highBytes, pythonResident(functions, first: 1.9, further: 1.02), name)
            let packageWeights = Dictionary(functions.map { ($0.file, $0.weightBytes) }, uniquingKeysWith: { first, _ in first })
            XCTAssertEqual(resident.weightCopyBytes,
                           Int(packageWeights.values.map { Double($0) * 1.45 }.reduce(0, +).rounded(.toNearestOrEven)), name)
            XCTAssertEqual(resident.functions, functions.count, name)
            XCTAssertEqual(Set(resident.packages.keys), Set(functions.map(\.file)), name)
            XCTAssertGreaterThan(resident.copies, 1, "\(name): several functions per package, several copies")
        }
    }

    func testTheBucketedExportsStagesNameTheirOwnFunctions() throws {
        let manifest = try Manifest.load(from: Fixtures.url("export_buckets"))
        let plan = try LoadPlan(manifest: manifest)
        let prefill = try XCTUnwrap(plan.stage(.prefill, bucket: 512))
        XCTAssertEqual(prefill.functions.map(\.description), [
            "embeddings.prefill_512", "chunk_0.prefill_512", "chunk_1.prefill_512", "chunk_2.prefill_512",
            "cache_update.prefill_512_l1", "lm_head.prefill",
        ])
        XCTAssertEqual(prefill.updates.compactMap { $0?.description }, Array(repeating: "cache_update.prefill_512_l1", count: 3))
        XCTAssertEqual(try XCTUnwrap(plan.stage(.decode, bucket: 1024)).functions.map(\.description), [
            "embeddings.decode", "chunk_0.decode", "chunk_1.decode", "chunk_2.decode", "cache_update.decode_l1", "lm_head.decode",
        ])
        XCTAssertEqual(plan.functions.count, 22)
        XCTAssertNil(plan.stage(.verify, bucket: 1024))
        XCTAssertNil(plan.stage(.decode, bucket: 100))
        XCTAssertEqual(prefill.functions.map(\.file), ["embeddings.mlpackage", "chunk_0.mlpackage", "chunk_1.mlpackage",
                                                       "chunk_2.mlpackage", "cache_update.mlpackage", "lm_head.mlpackage"])
    }

    func testTheResidentModelCountsFunctionsPerPackageFileAndRuntime() throws {
        let core = ResidentModel.Runtime.coreML
        XCTAssertEqual(core.factor(0), 0)
        XCTAssertEqual(core.factor(1, .low), 1.0)
        XCTAssertEqual(core.factor(1, .high), 1.9)
        XCTAssertEqual(core.factor(4), 1.45 + 3 * 0.695, accuracy: 1e-12)
        XCTAssertEqual(ResidentModel.Runtime.coreAI.factor(4), 0.93)
        XCTAssertTrue(core.source.contains("Anemll Forge") && ResidentModel.modelled.hasPrefix("modelled"))

        var manifest = try Manifest.load(from: Fixtures.url("export"))
        let weights = manifest.models.keys.map { manifest.weightBytes(of: $0) }.reduce(0, +)
        let multifunction = ResidentModel(manifest: manifest, holding: try LoadPlan(manifest: manifest).functions)
        XCTAssertEqual(multifunction.weightCopyBytes, Int((Double(weights) * 1.45).rounded(.toNearestOrEven)))
        XCTAssertEqual(multifunction.packages["chunk_0.mlpackage"]?.functions, ["decode", "decode_branches", "prefill", "verify"])
        XCTAssertEqual(multifunction.packages["chunk_0.mlpackage"]?.residentBytes,
                       Int((Double(manifest.weightBytes(of: "chunk_0")) * (1.45 + 3 * 0.695)).rounded(.toNearestOrEven)))
        XCTAssertEqual(multifunction.copies, 1 + 3 * 0.695 / 1.45, accuracy: 1e-5, "four functions a package: 1 + 3 * 0.695/1.45 copies")

        // One package per function: each package is its own single copy.
        for (model, entry) in manifest.models {
            for fn in entry.functions.keys {
                manifest.models[model]?.functions[fn]?.file = "\(model)_\(fn).mlpackage"
                manifest.models[model]?.functions[fn]?.functionName = "main"
            }
        }
        manifest.multifunction = false
        let perFunction = try LoadPlan(manifest: manifest).functions
        let single = ResidentModel(manifest: manifest, holding: perFunction)
        XCTAssertEqual(single.packages.count, perFunction.count)
        XCTAssertEqual(single.bytes, single.weightCopyBytes)
        XCTAssertEqual(single.bytes, pythonResident(perFunction, first: 1.45, further: 0.695))
        XCTAssertGreaterThan(single.bytes, multifunction.bytes, "every function its own package holds more copies")

        // Core AI: the entry points of a package share one copy.
        manifest = try Manifest.load(from: Fixtures.url("export"))
        manifest.deploymentTarget = "coreai"
        let coreAI = ResidentModel(manifest: manifest, holding: try LoadPlan(manifest: manifest).functions)
        XCTAssertEqual(coreAI.runtime, .coreAI)
        XCTAssertEqual(coreAI.bytes, Int((Double(weights) * 0.93).rounded(.toNearestOrEven)))
        XCTAssertEqual([coreAI.lowBytes, coreAI.highBytes], [coreAI.bytes, coreAI.bytes])

        let none = ResidentModel(manifest: manifest, holding: [])
        XCTAssertEqual([none.bytes, none.weightCopyBytes, none.functions], [0, 0, 0])
        XCTAssertEqual(none.copies, 0)
    }

    // MARK: loading through the plan

    /// The store's record after a session: no function asked for twice, the loads those of `stages`
    /// exactly, priced as Python's resident model prices them.
    private func assertHolds(_ store: CountingStore, _ stages: Stages, exactly expected: [PlannedFunction], count: Int,
                             _ message: String, file: StaticString = #filePath, line: UInt = #line) async {
        let loads = await store.loads, asked = await store.asked
        // as multisets: loads that run concurrently may finish in another order than they were asked
        XCTAssertEqual(asked.map(\.description).sorted(), loads.map(\.description).sorted(),
                       "\(message): a failed or repeated load", file: file, line: line)
        XCTAssertEqual(Set(loads).count, loads.count, "\(message): a function loaded twice: \(loads)", file: file, line: line)
        XCTAssertEqual(Set(loads), Set(expected), message, file: file, line: line)
        XCTAssertEqual(loads.count, count, message, file: file, line: line)
        let loaded = await stages.loaded
        XCTAssertEqual(loaded.map(\.description).sorted(), loads.map(\.description).sorted(), message, file: file,
                       line: line)
        let resident = await stages.resident
        XCTAssertEqual(resident.bytes, pythonResident(expected, first: 1.45, further: 0.695), message, file: file, line: line)
        let steps = await store.residentAfterEachLoad
        XCTAssertEqual(steps.last ?? 0, resident.bytes, message, file: file, line: line)
        XCTAssertEqual(steps, steps.sorted(), "\(message): resident bytes fell as a function loaded", file: file, line: line)
    }

    /// The functions of the stages of `phases` at `bucket` (`nil`: the whole context).
    private func functions(_ plan: LoadPlan, _ stages: [(Phase, Int)]) throws -> [PlannedFunction] {
        StagePlan.unique(try stages.flatMap { try XCTUnwrap(plan.stage($0.0, bucket: $0.1)).functions })
    }

    func testASessionLoadsEachContextBucketsStageOnItsFirstUseOnce() async throws {
        let manifest = try Manifest.load(from: Fixtures.url("export_buckets"))
        XCTAssertEqual(manifest.chunks.count, 3)
        let plan = try LoadPlan(manifest: manifest)
        let store = CountingStore(runtime: plan.runtime)
        let stages = Stages(plan: plan, store: store) { $0 }
        let backend = PlannedBackend(Simulated(contextLength: manifest.contextLength, branchWidth: 0, suffixLength: 0,
                                               buckets: manifest.contextBuckets), stages: stages, manifest: manifest)
        let pipeline = ChunkedPipeline(backend: backend, contextLength: manifest.contextLength, prefillLength: manifest.prefillLength,
                                       buckets: manifest.buckets)
        let asked = await store.asked
        XCTAssertEqual(asked, [], "nothing is loaded before it is used")
        let eos = PipelineSimulationTests.eos, vocab = PipelineSimulationTests.vocab
        let generator = Generator(predictor: pipeline, eosTokenIds: [eos])

        // A short conversation runs in the 512 bucket: its prefill and decode stages only.
        let prompt = Array(10..<110)
        let (reply, _) = try await generator.generateAll(prompt: prompt, maxNewTokens: 8)
        XCTAssertEqual(reply, FakeModel.reference(prompt: prompt, maxNewTokens: 8, sampling: .greedy, vocab: vocab, eos: eos))
        XCTAssertGreaterThan(reply.count, 1, "the generation decodes")
        let small = try functions(plan, [(.prefill, 512), (.decode, 512)])
        await assertHolds(store, stages, exactly: small, count: 12, "the 512 bucket")
        let loads = await store.loads
        XCTAssertTrue(loads.filter { $0.model != "lm_head" }.allSatisfy { $0.function.contains("_512") }, "\(loads)")

        // Past 512 positions the same conversation reaches the whole context's stages; the LM head,
        // which every bucket runs, is not loaded again.
        let longer = prompt + reply + Array(200..<700)
        let (more, stats) = try await generator.generateAll(prompt: longer, maxNewTokens: 4)
        XCTAssertEqual(more, FakeModel.reference(prompt: longer, maxNewTokens: 4, sampling: .greedy, vocab: vocab, eos: eos))
        XCTAssertGreaterThan(more.count, 1, "the generation decodes")
        XCTAssertGreaterThan(stats.reusedTokens, 0)
        XCTAssertGreaterThan(longer.count, 512)
        let all = try functions(plan, [(.prefill, 512), (.decode, 512), (.prefill, 1024), (.decode, 1024)])
        XCTAssertEqual(Set(all), Set(plan.functions))
        await assertHolds(store, stages, exactly: all, count: 22, "every bucket")
        let heads = await store.loads.filter { $0.model == "lm_head" }.map(\.function)
        XCTAssertEqual(heads, ["prefill", "decode"])
        XCTAssertEqual(backend.problems, [])
        XCTAssertEqual(backend.inner.problems, [])
    }

    func testCascadeAndSpeculativeSessionsLoadEachPhaseOnItsFirstUseOnce() async throws {
        for name in ["export", "export_folded"] {
            let manifest = try Manifest.load(from: Fixtures.url(name))
            XCTAssertEqual(manifest.chunks.count, 3)
            let plan = try LoadPlan(manifest: manifest)
            let store = CountingStore(runtime: plan.runtime)
            let stages = Stages(plan: plan, store: store) { $0 }
            let context = manifest.contextLength
            let branches = PlannedBackend(Simulated(contextLength: context, branchWidth: try XCTUnwrap(manifest.branchWidth),
                                                    suffixLength: try XCTUnwrap(manifest.suffixLength),
                                                    buckets: manifest.contextBuckets), stages: stages, manifest: manifest)
            let pipeline = ChunkedPipeline(backend: branches, contextLength: context, prefillLength: manifest.prefillLength,
                                           buckets: manifest.buckets)
            let eos = PipelineSimulationTests.eos, vocab = PipelineSimulationTests.vocab
            let bucket = manifest.buckets.bucket(holding: 20)  // export_folded: 32 of [32, 64]

            // Plain generation: prefill and decode in the bucket that holds the text.
            let generator = Generator(predictor: pipeline, eosTokenIds: [eos])
            let prompt = Array(10..<20)
            let (tokens, _) = try await generator.generateAll(prompt: prompt, maxNewTokens: 6)
            XCTAssertEqual(tokens, FakeModel.reference(prompt: prompt, maxNewTokens: 6, sampling: .greedy, vocab: vocab, eos: eos), name)
            XCTAssertGreaterThan(tokens.count, 1, "\(name): the generation decodes")
            let windows = try functions(plan, [(.prefill, bucket), (.decode, bucket)])
            let heads = manifest.lmHead.models.count
            await assertHolds(store, stages, exactly: windows, count: 2 * (1 + 3 + 1 + heads), "\(name) prefill and decode")

            // A cascade over a prefix adds the decode_branches stage.
            let prefix = Array(10..<21)
            let requests = (0..<3).map { i in
                BranchRequest(sampling: SamplingParameters(temperature: 1, seed: UInt64(i)), maxNewTokens: [4, 9, 6][i])
            }
            let results = try await pipeline.decodeBranches(prefix: prefix, branches: requests, eosTokenIds: [eos])
            XCTAssertEqual(results, requests.map {
                FakeModel.decodeAlone(prefix: prefix, $0, suffixCapacity: manifest.suffixLength ?? 0, vocab: vocab, eos: eos)
            }, name)
            let cascade = StagePlan.unique(windows + (try functions(plan, [(.decodeBranches, context)])))
            await assertHolds(store, stages, exactly: cascade, count: windows.count + 1 + 3 + 1 + heads, "\(name) cascade")

            // Speculative decoding on the same loader adds the verify stage.
            let verifier = PlannedBackend(SimulatedVerify(contextLength: context, verifyWindow: try XCTUnwrap(manifest.verifyWindow)),
                                          stages: stages, manifest: manifest)
            let verifying = ChunkedPipeline(backend: verifier, contextLength: context, prefillLength: manifest.prefillLength,
                                            buckets: manifest.buckets)
            let speculative = Generator(predictor: verifying, eosTokenIds: [])
            let text = [1, 2, 3, 1, 2, 3, 1, 2]
            let (drafted, stats) = try await speculative.generateAll(prompt: text, maxNewTokens: 12,
                                                                     speculative: .promptLookup(adaptive: false))
            XCTAssertEqual(drafted, FakeTreeModel.reference(prompt: text, maxNewTokens: 12, vocab: VerifyPipelineTests.vocab), name)
            XCTAssertGreaterThan(stats.speculative?.verifySteps ?? 0, 0, name)
            let session = StagePlan.unique(cascade + (try functions(plan, [(.verify, context)])))
            await assertHolds(store, stages, exactly: session, count: cascade.count + 1 + 3 + 1 + heads, "\(name) verify")

            // Nothing outside the stages used: with buckets, the whole context's prefill and decode stay unloaded.
            let unused = Set(plan.functions).subtracting(session)
            if bucket == context {
                XCTAssertEqual(unused, [], "\(name): every stage ran")
                XCTAssertEqual(Set(session.map { [$0.model, $0.function] }), manifestFunctions(manifest), name)
            } else {
                XCTAssertEqual(unused, Set(try functions(plan, [(.prefill, context), (.decode, context)])), name)
                XCTAssertEqual(unused.count, 2 * (1 + 3 + 1), name)
            }
            XCTAssertEqual(branches.problems + verifier.problems, [], name)
            XCTAssertEqual(branches.inner.problems + verifier.inner.problems, [], name)
        }
    }

    func testAStateExportsWindowsLoadNoCacheUpdate() async throws {
        let manifest = try Manifest.load(from: Fixtures.url("export_state"))
        XCTAssertTrue(manifest.cache.inStates)
        let plan = try LoadPlan(manifest: manifest)
        let store = CountingStore(runtime: plan.runtime)
        let stages = Stages(plan: plan, store: store) { $0 }
        let backend = PlannedBackend(Simulated(contextLength: manifest.contextLength, branchWidth: try XCTUnwrap(manifest.branchWidth),
                                               suffixLength: try XCTUnwrap(manifest.suffixLength)), stages: stages, manifest: manifest)
        let pipeline = ChunkedPipeline(backend: backend, contextLength: manifest.contextLength, prefillLength: manifest.prefillLength,
                                       cacheInStates: true, buckets: manifest.buckets)
        let generator = Generator(predictor: pipeline, eosTokenIds: [])
        _ = try await generator.generateAll(prompt: Array(10..<20), maxNewTokens: 5)
        let windows = try functions(plan, [(.prefill, 64), (.decode, 64)])
        XCTAssertFalse(windows.contains { $0.model == "cache_update" }, "the chunks write their states themselves")
        await assertHolds(store, stages, exactly: windows, count: 2 * (1 + 3 + 1), "state prefill and decode")

        let requests = [BranchRequest(maxNewTokens: 3), BranchRequest(forcedTokens: [7], maxNewTokens: 4)]
        _ = try await pipeline.decodeBranches(prefix: Array(10..<21), branches: requests, eosTokenIds: [])
        let all = StagePlan.unique(windows + (try functions(plan, [(.decodeBranches, 64)])))
        XCTAssertEqual(all.filter { $0.model == "cache_update" }.map(\.function), ["decode_branches_l1"])
        XCTAssertEqual(Set(all.map { [$0.model, $0.function] }), manifestFunctions(manifest))
        await assertHolds(store, stages, exactly: all, count: 16, "state cascade")
    }

    func testAStageTheExportLacksIsRefusedAndLoadsNothing() async throws {
        let manifest = try Manifest.load(from: Fixtures.url("export_buckets"))
        let plan = try LoadPlan(manifest: manifest)
        let store = CountingStore(runtime: plan.runtime)
        let stages = Stages(plan: plan, store: store) { $0 }
        let cases: [(Phase, Int, Error)] = [
            (.verify, 1024, GenerationError.noVerifyWindow), (.decodeBranches, 1024, GenerationError.noBranchWidth),
            (.prefill, 100, ManifestError.inconsistent("the export has no prefill function at context bucket 100 (context buckets "
                + "[512, 1024]; decode_branches and verify run at the whole context)")),
        ]
        for (phase, bucket, expected) in cases {
            do {
                _ = try await stages.stage(phase, bucket: bucket)
                XCTFail("\(phase) at \(bucket) was made")
            } catch {
                XCTAssertEqual("\(error)", "\(expected)")
            }
        }
        let asked = await store.asked
        XCTAssertEqual(asked, [])
    }

    func testConcurrentFirstUsesShareOneLoadOfEachFunction() async throws {
        let manifest = try Manifest.load(from: Fixtures.url("export_buckets"))
        let plan = try LoadPlan(manifest: manifest)
        let store = CountingStore(runtime: plan.runtime, delay: 1_000_000)
        let stages = Stages(plan: plan, store: store) { $0 }
        // prefill_512 and prefill both hold lm_head's prefill function
        let made = try await withThrowingTaskGroup(of: String.self) { group in
            for i in 0..<16 {
                group.addTask { try await stages.stage(.prefill, bucket: i % 2 == 0 ? 512 : 1024).plan.function }
            }
            return try await group.reduce(into: [String]()) { $0.append($1) }
        }
        XCTAssertEqual(made.sorted(), Array(repeating: "prefill", count: 8) + Array(repeating: "prefill_512", count: 8))
        let expected = try functions(plan, [(.prefill, 512), (.prefill, 1024)])
        await assertHolds(store, stages, exactly: expected, count: 11, "concurrent first uses")
        let heads = await store.asked.filter { $0.model == "lm_head" }
        XCTAssertEqual(heads.map(\.function), ["prefill"])
    }

    func testAFailedLoadIsNotKeptAndTheNextUseTriesAgain() async throws {
        let manifest = try Manifest.load(from: Fixtures.url("export"))
        let plan = try LoadPlan(manifest: manifest)
        let failing = try PlannedFunction(manifest, model: "chunk_1", function: "decode")
        let store = CountingStore(runtime: plan.runtime, failOnce: [failing])
        let stages = Stages(plan: plan, store: store) { $0 }
        do {
            _ = try await stages.stage(.decode, bucket: 64)
            XCTFail("the stage was made without chunk_1's decode function")
        } catch {
            XCTAssertTrue(error is CountingStore.Refused)
        }
        let before = await store.loads
        XCTAssertEqual(before.map(\.description), ["embeddings.decode", "chunk_0.decode"], "loaded before the failure, and kept")
        let stage = try await stages.stage(.decode, bucket: 64)
        XCTAssertEqual(stage.chunks.map(\.description), ["chunk_0.decode", "chunk_1.decode", "chunk_2.decode"])
        let asked = await store.asked
        XCTAssertEqual(asked.filter { $0 == failing }.count, 2)
        XCTAssertEqual(asked.count, try functions(plan, [(.decode, 64)]).count + 1, "only the failed function is asked again")
        let loads = await store.loads
        XCTAssertEqual(Set(loads), Set(try functions(plan, [(.decode, 64)])))
        XCTAssertEqual(Set(loads).count, loads.count)
    }
}

extension LoadPlanTests.PlannedBackend: BranchBackend where Inner: BranchBackend {
    var branchWidth: Int { inner.branchWidth }
    var suffixLength: Int { inner.suffixLength }

    func embedBranches(_ step: BranchStep) async throws -> Activations {
        _ = try await stage(.decodeBranches, bucket: nil)
        return Activations(inner: try await inner.embedBranches(step), bucket: nil)
    }

    func runBranchChunk(_ index: Int, _ input: Activations) async throws -> Activations {
        _ = try await stage(.decodeBranches, bucket: nil, chunk: index)
        return Activations(inner: try await inner.runBranchChunk(index, input.inner), bucket: input.bucket)
    }

    func updateSuffix(_ index: Int, suffixPositions: [Int32]) async throws {
        _ = try await stage(.decodeBranches, bucket: nil, chunk: index, update: true)
        try await inner.updateSuffix(index, suffixPositions: suffixPositions)
    }

    func branchLogits(_ input: Activations) async throws -> [[Float]] {
        _ = try await stage(.decodeBranches, bucket: input.bucket)
        return try await inner.branchLogits(input.inner)
    }

    func resetSuffixes() async throws { try await inner.resetSuffixes() }
}

extension LoadPlanTests.PlannedBackend: VerifyBackend where Inner: VerifyBackend {
    var verifyWindow: Int { inner.verifyWindow }

    func embedTree(_ window: TreeWindow) async throws -> Activations {
        _ = try await stage(.verify, bucket: nil)
        return Activations(inner: try await inner.embedTree(window), bucket: nil)
    }

    func acceptTree(_ index: Int, slots: [Int32]) async throws {
        _ = try await stage(.verify, bucket: nil, chunk: index, update: true)
        try await inner.acceptTree(index, slots: slots)
    }

    func treeLogits(_ input: Activations, count: Int) async throws -> [[Float]] {
        _ = try await stage(.verify, bucket: input.bucket)
        return try await inner.treeLogits(input.inner, count: count)
    }
}
