/// Why a generation, or one branch of a cascade, ended. The raw values are the vocabulary the
/// Python runtime uses (`llama_ane.runtime.sampling.FINISH_REASONS`, its `finish_reason` strings);
/// the generated fixture `generation.json` checks that both lists agree.
public enum FinishReason: String, CaseIterable, Equatable, Sendable {
    /// An end-of-sequence token was sampled.
    case eos
    /// A stop string appeared in the text (Python's `stop=`; here `StopStrings`).
    case stop
    /// `maxNewTokens` tokens were generated.
    case length
    /// The KV cache is full (for a cascade branch: its private suffix cache).
    case context
}
