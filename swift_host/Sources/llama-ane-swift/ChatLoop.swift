import Foundation
import LlamaANE

/// `llama-ane-swift chat`: a conversation on one cache, a turn per line read, as Python's
/// `llama-ane chat` (its /reset and /quit; the end of input leaves too). A turn that fails is reported
/// on one `Error:` line and the conversation goes on as it was.
struct ChatLoop {
    static let commands = [
        ("/help", "this list"),
        ("/reset", "a new conversation (the system message stays)"),
        ("/quit", "leave (also the end of input)"),
    ]

    let conversation: Conversation
    let maxNewTokens: Int
    let sampling: SamplingParameters
    let speculative: SpeculativeDecoding?
    let stops: [String]
    /// The next line typed, nil at the end of input.
    let readLine: () -> String?
    /// The reply's text (standard output).
    let write: (String) -> Void
    /// Prompts, commands' answers and each turn's numbers (standard error).
    let log: (String) -> Void

    func run() async {
        while true {
            log("> ")
            guard let raw = readLine() else { return }
            let line = raw.trimmingCharacters(in: .whitespacesAndNewlines)
            if line.isEmpty { continue }
            if line.hasPrefix("/") {
                if await command(line) { continue }
                return
            }
            do {
                try await turn(line)
            } catch {
                write("\n")
                log("Error: \(error)\n")
            }
        }
    }

    /// Runs a /command; false to quit.
    private func command(_ line: String) async -> Bool {
        let name = line.split(separator: " ", maxSplits: 1).first.map(String.init) ?? line
        switch name {
        case "/quit", "/exit":
            return false
        case "/reset":
            await conversation.reset()
            log("[new conversation]\n")
        case "/help":
            for (command, what) in Self.commands { log("  \(command.padding(toLength: 7, withPad: " ", startingAt: 0))  \(what)\n") }
        default:
            log("[unknown command \(name); /help for commands]\n")
        }
        return true
    }

    /// One turn: streams the reply, cut at the first stop string, then its numbers.
    private func turn(_ line: String) async throws {
        var text = StopStrings(stops)
        var generated = 0
        var finished: GenerationStats?
        for try await event in conversation.send(line, maxNewTokens: maxNewTokens, sampling: sampling,
                                                 speculative: speculative) {
            switch event {
            case let .token(id, piece):
                if !conversation.generator.eosTokenIds.contains(id) { generated += 1 }
                write(text.push(piece))
            case let .finished(stats):
                finished = stats
            }
            if text.stopped { break }  // ends the turn after the running model call
        }
        write("\n")
        let reason = text.stopped ? FinishReason.stop : finished?.stopReason
        var summary = "[\(generated) tokens, finish: \(reason?.rawValue ?? "-")"
        if let stats = finished {
            summary += String(format: " | prefill %d new tokens (%d reused) | decode %.1f tokens/s",
                              stats.prefilledTokens, stats.reusedTokens, stats.decodeTokensPerSecond)
            if stats.shifts > 0 { summary += " | context shifted \(stats.shifts)x" }
        }
        log(summary + "]\n")
    }
}
