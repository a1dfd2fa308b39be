import Foundation
import LlamaANE
#if canImport(CoreML)
import CoreML
#endif

/// `llama-ane-swift EXPORT_FOLDER PROMPT [options]`: streams generated text to stdout and reports
/// prefill and decode speeds on stderr.
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
            FileHandle.standardError.write(Data("error: \(error)\n".utf8))
            exit(1)
        }
    }

    static func run(_ options: Options) async throws {
        let model = try ExportedModel(folder: URL(fileURLWithPath: options.folder), verifyHashes: options.verifyHashes)
        let prompt = options.chat
            ? try model.chatPromptTokens([ChatMessage(role: "user", content: options.prompt)])
            : model.promptTokens(options.prompt)
        log("\(model.manifest.name): \(model.manifest.chunks.count) chunks, context \(model.manifest.contextLength), "
            + "prompt \(prompt.count) tokens")
        let predictor = try await makePredictor(model, computeUnits: options.computeUnits)
        let generator = model.generator(predictor: predictor)
        for try await event in generator.generate(prompt: prompt, maxNewTokens: options.maxNewTokens, sampling: options.sampling) {
            switch event {
            case let .token(_, text):
                FileHandle.standardOutput.write(Data(text.utf8))
            case let .finished(stats):
                print("")
                log(String(format: "prefill: %d tokens, %.1f tokens/s; decode: %d tokens, %.1f tokens/s",
                           stats.promptTokens, stats.prefillTokensPerSecond, stats.generatedTokens,
                           stats.decodeTokensPerSecond) + " (\(stats.stopReason.rawValue))")
            }
        }
    }

    static func makePredictor(_ model: ExportedModel, computeUnits: String) async throws -> TokenPredictor {
        #if canImport(CoreML)
        let units: MLComputeUnits
        switch computeUnits {
        case "all": units = .all
        case "cpuAndGPU": units = .cpuAndGPU
        case "cpuOnly": units = .cpuOnly
        default: units = .cpuAndNeuralEngine
        }
        return try await model.makeCoreMLPredictor(computeUnits: units)
        #else
        throw PipelineError.unavailable
        #endif
    }

    static func log(_ message: String) {
        FileHandle.standardError.write(Data((message + "\n").utf8))
    }
}
