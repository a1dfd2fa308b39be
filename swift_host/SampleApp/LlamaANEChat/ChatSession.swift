import Foundation
import LlamaANE

/// Loads an export folder, keeps the conversation on one KV cache and streams the assistant's
/// replies: each turn prefills only its new tokens.
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
    /// The chat on `generator`'s cache; nil when the export has no chat template (plain prompts then).
    private var conversation: Conversation?
    private var task: Task<Void, Never>?

    /// The export folder bundled with the app as a folder reference named "Model", if any.
    static var bundledExport: URL? { Bundle.main.url(forResource: "Model", withExtension: nil) }

    func load(_ folder: URL) async {
        isBusy = true
        defer { isBusy = false }
        status = "Loading \(folder.lastPathComponent)…"
        do {
            let model = try ExportedModel(folder: folder)
            let predictor = try await model.makeCoreMLPredictor()
            let generator = model.generator(predictor: predictor)
            self.model = model
            self.generator = generator
            conversation = model.tokenizer.chatTemplate != nil ? try model.conversation(generator: generator) : nil
            lines = []
            isReady = true
            status = "\(model.manifest.name), context \(model.manifest.contextLength) tokens (the first reply loads "
                + "the models, and on the first launch compiles them)"
        } catch {
            isReady = false
            status = "Could not load the model: \(error)"
        }
    }

    func send(_ text: String, maxNewTokens: Int = 256, sampling: SamplingParameters = SamplingParameters(temperature: 0.7, topP: 0.9, seed: 0)) {
        guard let model, let generator, !isBusy else { return }
        lines.append(Line(role: "user", text: text))
        let history = lines.map { ChatMessage(role: $0.role, content: $0.text) }
        let reply = Line(role: "assistant", text: "")
        lines.append(reply)
        let conversation = self.conversation
        isBusy = true
        task = Task {
            defer { isBusy = false }
            do {
                let events = conversation?.send(text, maxNewTokens: maxNewTokens, sampling: sampling)
                    ?? generator.generate(prompt: model.promptTokens(history.map(\.content).joined(separator: "\n")),
                                          maxNewTokens: maxNewTokens, sampling: sampling)
                for try await event in events {
                    switch event {
                    case let .token(_, piece):
                        // The line is gone when the conversation was started over meanwhile.
                        if let index = lines.firstIndex(where: { $0.id == reply.id }) { lines[index].text += piece }
                    case let .finished(stats):
                        status = String(format: "prefill %d new tokens (%d reused from the cache), %.0f tok/s; decode %.1f tok/s",
                                        stats.prefilledTokens, stats.reusedTokens, stats.prefillTokensPerSecond,
                                        stats.decodeTokensPerSecond)
                    }
                }
                if Task.isCancelled { status = "Stopped." }
            } catch is CancellationError {
                status = "Stopped."
            } catch {
                status = "\(error)"
            }
        }
    }

    func stop() { task?.cancel() }

    /// Stops the reply being written, if any, and starts a new conversation. The cache keeps its
    /// tokens, so the new conversation still reuses what it starts with in common (the template's
    /// system header, for instance).
    func startOver() {
        task?.cancel()
        lines = []
        status = "New conversation."
        if let conversation { Task { await conversation.reset() } }
    }
}
