import Foundation
import LlamaANE

/// Command-line options, parsed by hand (the package takes no dependencies).
struct Options: Equatable {
    /// `chat EXPORT_FOLDER`: a conversation read from standard input; otherwise one generation.
    var interactive = false
    var folder: String = ""
    var prompt: String = ""
    /// The chat's system message.
    var system: String?
    /// The text ends before the first of these (Python's `--stop`).
    var stops: [String] = []
    var maxNewTokens = 64
    var sampling = SamplingParameters()
    /// Feed the prompt as plain text instead of one user turn in the export's chat template.
    var raw = false
    var branches = 0
    var verifyHashes = false
    var computeUnits = "cpuAndNeuralEngine"
    /// The drafter of speculative decoding ("lookup"), nil for plain decoding.
    var speculative: String?
    var draftTokens: Int?

    static let usage = """
        usage: llama-ane-swift EXPORT_FOLDER PROMPT [options]
               llama-ane-swift chat EXPORT_FOLDER [--system TEXT] [options]

        Runs an export written by `llama-ane export` with Core ML and streams the text. `chat` holds a
        conversation on one cache, a turn per line of standard input: /reset starts a new one (the
        system message stays), /quit or the end of input leaves, /help lists the commands. (An export
        folder named "chat" is ./chat.)

        options:
          -n, --max-new-tokens N   tokens to generate (default 64)
          -t, --temperature T      0 is greedy (default 0)
              --top-k K            keep the K most likely tokens (default 0: all)
              --top-p P            nucleus sampling threshold (default 1: off)
              --min-p P            keep tokens at least P times as likely as the most likely one
                                   (0...1, default 0: off)
              --repetition-penalty R
                                   divide positive logits of the last 64 context tokens by R and
                                   multiply negative ones (> 0, default 1: off)
              --stop TEXT          end the text before TEXT (repeatable)
          -s, --seed S             sampler seed (default 0)
              --branches N         decode N continuations over the prompt as one shared prefix
                                   (cascade; branch i samples with seed S+i)
              --speculative lookup draft token trees by prompt lookup and verify each in one window
                                   (the export's verify function); the same tokens as without
              --draft-tokens K     at most K drafted tokens per tree (default: the verify window - 1)
              --raw                feed the prompt as plain text to continue (default: one user
                                   turn in the export's chat template, when it records one)
              --system TEXT        chat: the system message, kept when the context shifts
              --verify-hashes      check every file's sha256 against the manifest first
              --compute-units U    cpuAndNeuralEngine (default), all, cpuAndGPU or cpuOnly
          -h, --help               show this help
        """

    /// Why the arguments were refused: one line naming the option.
    struct ParseError: Error, CustomStringConvertible, Equatable {
        let message: String
        var description: String { "\(message) (llama-ane-swift --help lists the options)" }
    }

    /// Speculative decoding as asked for, nil for plain decoding.
    var speculativeDecoding: SpeculativeDecoding? {
        speculative == nil ? nil : .promptLookup(draftTokens: draftTokens)
    }

    /// Parses the arguments after the program name. `nil` means help was asked for.
    static func parse(_ arguments: [String]) throws -> Options? {
        var options = Options()
        var positional: [String] = []
        var i = 0
        if arguments.first == "chat" {
            options.interactive = true
            i = 1
        }
        func value(_ flag: String) throws -> String {
            i += 1
            guard i < arguments.count else { throw ParseError(message: "\(flag) needs a value") }
            return arguments[i]
        }
        func number<T: LosslessStringConvertible>(_ flag: String, _ type: T.Type) throws -> T {
            let text = try value(flag)
            guard let v = T(text) else { throw ParseError(message: "\(flag) expects a number, got \"\(text)\"") }
            return v
        }
        while i < arguments.count {
            let arg = arguments[i]
            switch arg {
            case "-h", "--help": return nil
            case "-n", "--max-new-tokens": options.maxNewTokens = try number(arg, Int.self)
            case "-t", "--temperature": options.sampling.temperature = try number(arg, Float.self)
            case "--top-k": options.sampling.topK = try number(arg, Int.self)
            case "--top-p": options.sampling.topP = try number(arg, Float.self)
            case "--min-p": options.sampling.minP = try number(arg, Float.self)
            case "--repetition-penalty": options.sampling.repetitionPenalty = try number(arg, Float.self)
            case "--stop": options.stops.append(try value(arg))
            case "--system": options.system = try value(arg)
            case "-s", "--seed": options.sampling.seed = try number(arg, UInt64.self)
            case "--raw": options.raw = true
            case "--branches": options.branches = try number(arg, Int.self)
            case "--speculative":
                options.speculative = try value(arg)
                guard options.speculative == "lookup" else {
                    throw ParseError(message: "--speculative must be lookup, got \"\(options.speculative ?? "")\"")
                }
            case "--draft-tokens": options.draftTokens = try number(arg, Int.self)
            case "--verify-hashes": options.verifyHashes = true
            case "--compute-units":
                options.computeUnits = try value(arg)
                guard ["cpuAndNeuralEngine", "all", "cpuAndGPU", "cpuOnly"].contains(options.computeUnits) else {
                    throw ParseError(message: "unknown compute units \"\(options.computeUnits)\"")
                }
            case "--":
                positional += arguments[(i + 1)...]
                i = arguments.count
            default:
                if arg.hasPrefix("-"), arg.count > 1, Double(arg) == nil {
                    throw ParseError(message: "unknown option \(arg)")
                }
                positional.append(arg)
            }
            i += 1
        }
        if options.interactive {
            guard positional.count == 1 else {
                throw ParseError(message: "chat expects EXPORT_FOLDER alone (turns come from standard input), got "
                    + "\(positional.count) positional argument(s)")
            }
            options.folder = positional[0]
            if options.raw { throw ParseError(message: "--raw is for a single prompt; chat always uses the chat template") }
            if options.branches > 0 { throw ParseError(message: "--branches is for a single prompt, not chat") }
        } else {
            guard positional.count == 2 else {
                throw ParseError(message: "expected EXPORT_FOLDER and PROMPT, got \(positional.count) positional argument(s)")
            }
            options.folder = positional[0]
            options.prompt = positional[1]
            if options.system != nil { throw ParseError(message: "--system is for chat (llama-ane-swift chat EXPORT_FOLDER)") }
        }
        if let empty = options.stops.firstIndex(of: "") {
            throw ParseError(message: "--stop number \(empty + 1) is empty; pass the text to stop at")
        }
        if !options.stops.isEmpty, options.branches > 0 {
            throw ParseError(message: "--stop does not apply to --branches; drop one")
        }
        guard options.branches >= 0 else { throw ParseError(message: "--branches must be >= 0") }
        if options.draftTokens != nil, options.speculative == nil {
            throw ParseError(message: "--draft-tokens needs --speculative lookup")
        }
        guard (options.draftTokens ?? 1) >= 1 else { throw ParseError(message: "--draft-tokens must be at least 1") }
        if options.speculative != nil, options.branches > 0 {
            throw ParseError(message: "--speculative and --branches do not go together")
        }
        guard options.maxNewTokens > 0 else { throw ParseError(message: "--max-new-tokens must be at least 1") }
        let s = options.sampling
        guard s.temperature >= 0, s.temperature.isFinite else { throw ParseError(message: "--temperature must be a finite number >= 0") }
        guard s.topP > 0, s.topP <= 1 else { throw ParseError(message: "--top-p must be in (0, 1]") }
        guard s.topK >= 0 else { throw ParseError(message: "--top-k must be >= 0") }
        guard s.minP >= 0, s.minP <= 1 else { throw ParseError(message: "--min-p must be in [0, 1]") }
        guard s.repetitionPenalty > 0, s.repetitionPenalty.isFinite else {
            throw ParseError(message: "--repetition-penalty must be a finite number > 0")
        }
        if s.repetitionPenalty != 1, options.speculative != nil {
            throw ParseError(message: "--repetition-penalty cannot be combined with --speculative; drop one")
        }
        return options
    }
}
