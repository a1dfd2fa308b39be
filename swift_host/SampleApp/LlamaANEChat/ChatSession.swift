import Foundation
import LlamaANE

/// Loads an export folder, keeps the conversation and streams the assistant's replies.
@MainActor
final class ChatSession: ObservableObject {
    /// One line of the transcript.
    struct Line: Identifiable {
        let id = UUID()
        let role: String
        var text: String
    }

    @Published var lines: [Line] = []
    @Published var status = "No model loaded."
    @Published var isBusy = false
    @Published var isReady = false

    private var model: ExportedModel?
    private var generator: Generator?
    private var task: Task<Void, Never>?

    /// The export folder bundled with the app as a folder reference named "Model", if any.
    static var bundledExport: URL? { Bundle.main.url(forResource: "Model", withExtension: nil) }

    func load(_ folder: URL) async {
        isBusy = true
        defer { isBusy = false }
        status = "Loading \(folder.lastPathComponent)… (the first launch compiles the models)"
        do {
            let model = try ExportedModel(folder: folder)
            let predictor = try await model.makeCoreMLPredictor()
            self.model = model
            generator = model.generator(predictor: predictor)
            isReady = true
            status = "\(model.manifest.name), context \(model.manifest.contextLength) tokens"
        } catch {
            isReady = false
            status = "Could not load the model: \(error)"
        }
    }

    func send(_ text: String, maxNewTokens: Int = 256, sampling: SamplingParameters = SamplingParameters(temperature: 0.7, topP: 0.9, seed: 0)) {
        guard let model, let generator, !isBusy else { return }
        lines.append(Line(role: "user", text: text))
        let history = lines.map { ChatMessage(role: $0.role, content: $0.text) }
        lines.append(Line(role: "assistant", text: ""))
        let index = lines.count - 1
        isBusy = true
        task = Task {
            defer { isBusy = false }
            do {
                let prompt = model.tokenizer.chatTemplate != nil
                    ? try model.chatPromptTokens(history)
                    : model.promptTokens(history.map(\.content).joined(separator: "\n"))
                for try await event in generator.generate(prompt: prompt, maxNewTokens: maxNewTokens, sampling: sampling) {
                    switch event {
                    case let .token(_, piece):
                        lines[index].text += piece
                    case let .finished(stats):
                        status = String(format: "prefill %.0f tok/s, decode %.1f tok/s", stats.prefillTokensPerSecond,
                                        stats.decodeTokensPerSecond)
                    }
                }
            } catch is CancellationError {
                status = "Stopped."
            } catch {
                status = "\(error)"
            }
        }
    }

    func stop() { task?.cancel() }
}
