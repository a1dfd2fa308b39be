import Foundation
import XCTest
@testable import LlamaANE
#if canImport(CoreML)
import CoreML
#endif

/// Exports of the families whose sliding windows are shorter than the context (a Gemma 3 with
/// local-RoPE sliding layers between global ones, every phase; a Mistral with its window on every
/// layer, caches in states and the head folded; a Gemma 4 with per-layer inputs, wider global layers
/// and KV-shared layers, every phase, see Gemma4ManifestTests), of LFM2 (conv layers beside attention layers,
/// with input caches and with state caches) and of Qwen3.5 (linear-attention layers beside gated
/// attention, with input caches and with state caches, see DeltaStateTests), against what Python did with the same exports
/// (`families.json`, written by tests/swift_fixtures.py): the manifest and its wiring, the prompt's
/// and the chat prompt's ids, and a greedy generation whose windows (ids, position, real tokens)
/// must be the ones Python fed the exported embeddings. Off Apple platforms the model is Python's
/// logits replayed step by step; with Core ML, the export itself runs.
final class FamilyExportTests: XCTestCase {
    static let windowed = ["export_gemma3", "export_mistral_window", "export_gemma4"]
    static let conv = ["export_lfm2", "export_lfm2_state"]
    /// Qwen3.5's: linear-attention layers (a conv and a recurrent state each) beside gated attention;
    /// OLMo-Hybrid's, their variant (its beta scale and gated norm's eps config fields), beside OLMo 3's.
    static let delta = ["export_qwen35", "export_qwen35_state", "export_olmo_hybrid"]
    static let exports = windowed + conv + delta

    struct Step {
        let phase: String
        let ids: [Int32]
        let position: Int
        let count: Int
        let logits: [Float]
    }

    struct Expected {
        let prompt: String
        let promptIds: [Int]
        let messages: [ChatMessage]
        let chatRendered: String
        let chatIds: [Int]
        let tokens: [Int]
        let steps: [Step]
    }

    static func expected(_ name: String) throws -> Expected {
        let root = try JSONValue.parse(Data(contentsOf: Fixtures.url("families.json")))
        let e = try XCTUnwrap(root[name], "families.json has no \(name)")
        func ints(_ v: JSONValue?) -> [Int] { v?.arrayValue?.compactMap(\.intValue) ?? [] }
        return Expected(
            prompt: e["prompt"]?.stringValue ?? "", promptIds: ints(e["prompt_ids"]),
            messages: (e["messages"]?.arrayValue ?? []).map {
                ChatMessage(role: $0["role"]?.stringValue ?? "", content: $0["content"]?.stringValue ?? "")
            },
            chatRendered: e["chat_rendered"]?.stringValue ?? "", chatIds: ints(e["chat_ids"]), tokens: ints(e["tokens"]),
            steps: (e["steps"]?.arrayValue ?? []).map { s in
                Step(phase: s["function"]?.stringValue ?? "", ids: ints(s["input_ids"]).map { Int32($0) },
                     position: s["position"]?.intValue ?? -1, count: s["count"]?.intValue ?? -1,
                     logits: (s["logits"]?.arrayValue ?? []).map { Float($0.doubleValue ?? .nan) })
            })
    }

    func testTheSlidingLayersReadTheirMasksAndLocalTablesFromTheEmbeddings() throws {
        for name in Self.windowed {
            let manifest = try Manifest.load(from: Fixtures.url(name))
            let window = try XCTUnwrap(manifest.config.slidingWindow)
            XCTAssertLessThan(window, manifest.contextLength, "\(name): the window must be shorter than the context")
            XCTAssertFalse(manifest.config.slidingLayers.isEmpty)
            let wiring = try PipelineWiring(manifest: manifest)
            let gemma = manifest.config.ropeLocalTheta != nil
            for phase in PipelineWiring.phases(of: manifest) {
                let masks = phase == .decodeBranches ? ["sliding_prefix_mask", "sliding_suffix_mask"] : ["sliding_mask"]
                let extras = masks + (gemma ? ["cos_local", "sin_local"] : [])
                let embeddings = try manifest.function(manifest.embeddings.models[0], phase.rawValue)
                for (i, chunk) in manifest.chunks.enumerated() {
                    let inputs = try XCTUnwrap(wiring.chunkInputs[phase]?[i])
                    let slides = !Set(chunk.layers).isDisjoint(with: manifest.config.slidingLayers)
                    for extra in extras where slides {
                        XCTAssertEqual(inputs[extra], .embeddingsOutput(extra), "\(name) \(chunk.model) \(phase)")
                        let spec = try XCTUnwrap(embeddings.output(extra))
                        XCTAssertEqual(try manifest.function(chunk.model, phase.rawValue).input(extra), spec,
                                       "the chunk reads the tensor the embeddings write")
                    }
                }
            }
            XCTAssertEqual(PipelineWiring.phases(of: manifest).count, gemma ? 4 : 2)
        }
    }

    func testAChunkWhoseSlidingMaskNothingProducesIsRefused() throws {
        var manifest = try Manifest.load(from: Fixtures.url("export_gemma3"))
        manifest.models["embeddings"]?.functions["decode"]?.outputs.removeAll { $0.name == "sliding_mask" }
        XCTAssertThrowsError(try PipelineWiring(manifest: manifest)) { error in
            XCTAssertEqual(error as? PipelineError, .unwiredInput(model: "chunk_0 (decode)", input: "sliding_mask"))
        }
    }

    func testAConfigFieldThisHostDoesNotKnowIsRefusedByName() throws {
        let url = try Fixtures.url("export_gemma3").appendingPathComponent(Manifest.fileName)
        var object = try XCTUnwrap(JSONSerialization.jsonObject(with: Data(contentsOf: url)) as? [String: Any])
        XCTAssertNoThrow(try Manifest.decode(JSONSerialization.data(withJSONObject: object)))
        var config = try XCTUnwrap(object["config"] as? [String: Any])
        config["per_layer_inputs"] = true
        config["attention_sink_tokens"] = 4
        object["config"] = config
        XCTAssertThrowsError(try Manifest.decode(JSONSerialization.data(withJSONObject: object))) { error in
            XCTAssertEqual(error as? ManifestError, .unknownConfigField("attention_sink_tokens"))
            XCTAssertTrue("\(error)".contains("config.attention_sink_tokens"), "\(error)")
        }
    }

    func testAFalconH1ExportIsRefusedByItsFieldName() throws {
        let url = try Fixtures.url("export_gemma3").appendingPathComponent(Manifest.fileName)
        var object = try XCTUnwrap(JSONSerialization.jsonObject(with: Data(contentsOf: url)) as? [String: Any])
        var config = try XCTUnwrap(object["config"] as? [String: Any])
        config["mamba_layers"] = [0, 1]
        config["mamba_multipliers"] = ["key_multiplier": 0.5]
        object["config"] = config
        XCTAssertThrowsError(try Manifest.decode(JSONSerialization.data(withJSONObject: object))) { error in
            XCTAssertEqual(error as? ManifestError, .unsupportedConfigField(
                "mamba_layers", lacks: "Falcon-H1's Mamba-2 mixers beside attention in the same layer"))
            XCTAssertTrue("\(error)".contains("config.mamba_layers"), "\(error)")
        }
    }

    func testPromptAndChatPromptIdsArePythons() throws {
        for name in Self.exports {
            let model = try ExportedModel(folder: Fixtures.url(name))
            let e = try Self.expected(name)
            XCTAssertEqual(model.promptTokens(e.prompt), e.promptIds, name)
            XCTAssertEqual(try model.tokenizer.renderChat(e.messages, addGenerationPrompt: true), e.chatRendered, name)
            XCTAssertEqual(try model.chatPromptTokens(e.messages), e.chatIds, name)
        }
    }

    /// The generator over Python's logits, replayed in order: each window Swift asks for must be the
    /// one Python fed the embeddings at that step, and the greedy tokens must be Python's.
    func testGreedyGenerationFeedsPythonsWindowsAndGivesPythonsTokens() async throws {
        for name in Self.exports {
            let model = try ExportedModel(folder: Fixtures.url(name))
            let e = try Self.expected(name)
            if let window = model.manifest.config.slidingWindow {
                XCTAssertGreaterThan(e.promptIds.count + e.tokens.count, window * 2, "the generation must run well past the window")
            } else {
                XCTAssertNotEqual(e.promptIds.count % model.manifest.prefillLength, 0, "\(name): a padded prefill window")
            }
            let replay = Replay(e.steps, vocab: model.manifest.config.vocabSize)
            let predictor = ClosurePredictor(contextLength: model.manifest.contextLength,
                                             prefillLength: model.manifest.prefillLength,
                                             rewindLimit: model.manifest.rewindLimit) { replay.answer($0) }
            let generated = try await model.generator(predictor: predictor)
                .generateAll(prompt: e.promptIds, maxNewTokens: e.tokens.count)
            XCTAssertEqual(replay.problems, [], name)
            XCTAssertEqual(replay.next, e.steps.count, "\(name): every step Python made")
            XCTAssertEqual(generated.tokens, e.tokens, name)
        }
    }

    /// Python's steps in order: the logits of each, and how the windows asked for differ from them.
    final class Replay: @unchecked Sendable {
        private let steps: [Step]
        private let vocab: Int
        private let lock = NSLock()
        private(set) var next = 0
        private(set) var problems: [String] = []

        init(_ steps: [Step], vocab: Int) {
            self.steps = steps
            self.vocab = vocab
        }

        func answer(_ window: TokenWindow) -> [Float] {
            lock.lock(); defer { lock.unlock() }
            guard next < steps.count else {
                problems.append("step \(next): Python made only \(steps.count) steps")
                return [Float](repeating: 0, count: vocab)
            }
            let step = steps[next]
            next += 1
            let got = "\(window.phase.rawValue) \(window.tokens) at \(window.position), \(window.count) real"
            let want = "\(step.phase) \(step.ids) at \(step.position), \(step.count) real"
            if got != want { problems.append("step \(next - 1): Swift ran \(got), Python \(want)") }
            return step.logits
        }
    }

    #if canImport(CoreML)
    /// The export itself on Core ML (CPU, fp16): the first step's logits close to Python's (the
    /// mil backend's execution of the same programs) and the same greedy tokens.
    func testCoreMLRunsTheWindowedExportsAsPythonDoes() async throws {
        for name in Self.exports {
            let model = try ExportedModel(folder: Fixtures.url(name))
            let e = try Self.expected(name)
            let predictor = try await model.makeCoreMLPredictor(computeUnits: .cpuOnly)
            let first = Array(e.promptIds.prefix(model.manifest.prefillLength))
            let window = TokenWindow(phase: .prefill, tokens: first.map { Int32($0) }, count: first.count, position: 0)
            let logits = try await predictor.predict(window)
            let want = try XCTUnwrap(e.steps.first).logits
            XCTAssertEqual(logits.count, want.count)
            let worst = zip(logits, want).map { abs($0 - $1) }.max() ?? .infinity
            XCTAssertLessThan(worst, 0.05, "\(name): first step's logits")
            try await predictor.reset()
            let generated = try await model.generator(predictor: predictor).generateAll(prompt: e.promptIds,
                                                                                         maxNewTokens: e.tokens.count)
            XCTAssertEqual(generated.tokens, e.tokens, name)
        }
    }
    #endif
}
