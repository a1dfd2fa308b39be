import Foundation
import LlamaANE
#if canImport(CoreML)
import CoreML
#endif

/// `llama-ane-swift EXPORT_FOLDER PROMPT [options]`: streams generated text to stdout and reports
/// prefill and decode speeds on stderr. `llama-ane-swift chat EXPORT_FOLDER`: a conversation, a turn
/// per line of stdin.
@main
enum LlamaANECLI {
    static func main() async {
        do {
            guard let options = try Options.parse(Array(CommandLine.arguments.dropFirst())) else {
                print(Options.usage)
                return
            }
            try await run(options)
        } catch {
            FileHandle.standardError.write(Data("Error: \(error)\n".utf8))
            exit(1)
        }
    }

    static func run(_ options: Options) async throws {
        let model = try ExportedModel(folder: URL(fileURLWithPath: options.folder), verifyHashes: options.verifyHashes)
        if options.interactive {
            try await chat(model, options: options)
            return
        }
        let chatTemplate = !(model.manifest.tokenizer.chatTemplate ?? "").isEmpty && !options.raw
        let prompt = chatTemplate
            ? try model.chatPromptTokens([ChatMessage(role: "user", content: options.prompt)])
            : model.promptTokens(options.prompt)
        log("\(model.manifest.name): \(model.manifest.chunks.count) chunks, context \(model.manifest.contextLength), "
            + "prompt \(prompt.count) tokens")
        if options.branches > 0 {
            try await runBranches(model, prompt: prompt, options: options)
            return
        }
        let predictor = try await makePredictor(model, computeUnits: options.computeUnits)
        let generator = model.generator(predictor: predictor)
        var text = StopStrings(options.stops)
        var generated = 0
        for try await event in generator.generate(prompt: prompt, maxNewTokens: options.maxNewTokens, sampling: options.sampling,
                                                  speculative: options.speculativeDecoding) {
            switch event {
            case let .token(id, piece):
                write(text.push(piece))
                if !model.eosTokenIds.contains(id) { generated += 1 }
                if text.stopped {  // leaving the stream ends the generation after the running model call
                    print("")
                    log("\(generated) tokens (stop)")
                    return
                }
            case let .finished(stats):
                print("")
                log(String(format: "prefill: %d tokens, %.1f tokens/s; decode: %d tokens, %.1f tokens/s",
                           stats.prefilledTokens, stats.prefillTokensPerSecond, stats.generatedTokens,
                           stats.decodeTokensPerSecond) + " (\(stats.stopReason.rawValue))")
                if let spec = stats.speculative {
                    log(String(format: "speculative: %d verify + %d plain steps, %.2f tokens per verify step, "
                               + "acceptance %.2f", spec.verifySteps, spec.decodeSteps,
                               spec.tokensPerStep, spec.acceptanceRate))
                }
            }
        }
    }

    /// `--branches N`: N sampled continuations of the prompt, decoded as a cascade over it.
    static func runBranches(_ model: ExportedModel, prompt: [Int], options: Options) async throws {
        #if canImport(CoreML)
        let pipeline = try await model.makeCoreMLPredictor(computeUnits: computeUnits(options.computeUnits))
        let requests = (0..<options.branches).map { i in
            BranchRequest(sampling: options.sampling.branch(i), maxNewTokens: options.maxNewTokens)
        }
        let start = Date()
        let results = try await pipeline.decodeBranches(prefix: prompt, branches: requests, eosTokenIds: model.eosTokenIds)
        let seconds = Date().timeIntervalSince(start)
        for (i, r) in results.enumerated() {
            print("--- branch \(i) (\(r.tokens.count) tokens, \(r.stopReason.rawValue))")
            print(model.tokenizer.decode(r.tokens, skipSpecialTokens: true))
        }
        let total = results.map(\.tokens.count).reduce(0, +)
        log(String(format: "%d branches, %d tokens in %.2f s (prefill included): %.1f tokens/s",
                   results.count, total, seconds, Double(total) / max(seconds, 1e-9)))
        #else
        throw PipelineError.unavailable
        #endif
    }

    /// `chat EXPORT_FOLDER`: turns read from stdin on one conversation; past the context it shifts,
    /// keeping the system message, as Python's chat does.
    static func chat(_ model: ExportedModel, options: Options) async throws {
        let system = options.system.map { [ChatMessage(role: "system", content: $0)] } ?? []
        let keep = system.isEmpty ? 0 : try model.tokenizer.applyChatTemplate(system, addGenerationPrompt: false).count
        let predictor = try await makePredictor(model, computeUnits: options.computeUnits)
        let conversation = try Conversation(generator: model.generator(predictor: predictor), tokenizer: model.tokenizer,
                                            system: options.system, overflow: .shift(keep: keep))
        log("\(model.manifest.name): context \(model.manifest.contextLength); /help for commands")
        await ChatLoop(conversation: conversation, maxNewTokens: options.maxNewTokens, sampling: options.sampling,
                       speculative: options.speculativeDecoding, stops: options.stops,
                       readLine: { Swift.readLine(strippingNewline: true) }, write: write,
                       log: { FileHandle.standardError.write(Data($0.utf8)) }).run()
    }

    static func makePredictor(_ model: ExportedModel, computeUnits name: String) async throws -> TokenPredictor {
        #if canImport(CoreML)
        return try await model.makeCoreMLPredictor(computeUnits: computeUnits(name))
        #else
        throw PipelineError.unavailable
        #endif
    }

    #if canImport(CoreML)
    static func computeUnits(_ name: String) -> MLComputeUnits {
        switch name {
        case "all": return .all
        case "cpuAndGPU": return .cpuAndGPU
        case "cpuOnly": return .cpuOnly
        default: return .cpuAndNeuralEngine
        }
    }
    #endif

    static func write(_ text: String) {
        FileHandle.standardOutput.write(Data(text.utf8))
    }

    static func log(_ message: String) {
        FileHandle.standardError.write(Data((message + "\n").utf8))
    }
}
