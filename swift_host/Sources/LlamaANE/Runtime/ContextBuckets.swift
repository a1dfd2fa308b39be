/// The context buckets of an export (docs/manifest.md, "Context buckets"): cache lengths T, ascending
/// to `context_length`, each with its own prefill and decode functions in the embeddings, the chunks
/// and the cache update. A window ending at position p runs in the smallest T >= p, so a step reads
/// no more of the cache than the conversation fills.
///
/// The one place the Swift side names bucketed functions; it mirrors `bucket_function`,
/// `bucket_of` and `base_function` of the Python package's `contract/specs.py`.
public struct ContextBuckets: Equatable, Sendable {
    /// Cache lengths, strictly ascending; the last is `contextLength`.
    public let sizes: [Int]
    public var contextLength: Int { sizes[sizes.count - 1] }

    /// `sizes` must ascend strictly to `contextLength` (the manifest check refuses anything else).
    public init(_ sizes: [Int], contextLength: Int) {
        precondition(!sizes.isEmpty && sizes.last == contextLength && zip(sizes, sizes.dropFirst()).allSatisfy { $0 < $1 }
                     && sizes[0] > 0, "context buckets \(sizes) must ascend to the context length \(contextLength)")
        self.sizes = sizes
    }

    /// One bucket: the whole context (an export without buckets).
    public init(contextLength: Int) { self.init([contextLength], contextLength: contextLength) }

    /// The smallest bucket that holds `positions` cache positions (the whole context past the largest).
    public func bucket(holding positions: Int) -> Int {
        sizes.first { $0 >= positions } ?? contextLength
    }

    /// The functions that have bucketed copies: the others ("decode_branches", "verify") always run
    /// at the whole context.
    public static func isBucketed(_ phase: Phase) -> Bool { phase == .prefill || phase == .decode }

    /// The function of `phase` at `bucket`: the plain name at the whole context, else e.g. "decode_512".
    public func functionName(_ phase: Phase, bucket: Int) -> String {
        precondition(bucket == contextLength || (Self.isBucketed(phase) && sizes.contains(bucket)),
                     "no \(phase.rawValue) function at context bucket \(bucket) (buckets \(sizes))")
        return bucket == contextLength ? phase.rawValue : "\(phase.rawValue)_\(bucket)"
    }

    /// The function a bucketed one is a copy of ("decode_512" -> "decode"); other names unchanged.
    public static func baseFunction(_ name: String) -> String {
        guard let cut = name.lastIndex(of: "_") else { return name }
        let base = String(name[..<cut]), size = name[name.index(after: cut)...]
        return !size.isEmpty && size.allSatisfy(\.isASCIIDigit) && isBucketed(Phase(rawValue: base)) ? base : name
    }

    /// The cache length a function reads: its bucket for "prefill_512" and its cache update
    /// "prefill_512_l3", `contextLength` for every other function.
    public static func bucket(ofFunction name: String, contextLength: Int) -> Int {
        var function = name
        if let cut = name.range(of: "_l", options: .backwards), !name[cut.upperBound...].isEmpty,
           name[cut.upperBound...].allSatisfy(\.isASCIIDigit) {
            function = String(name[..<cut.lowerBound])  // a cache update: "<function>_l<layers>"
        }
        let base = baseFunction(function)
        guard base != function, let size = Int(function.dropFirst(base.count + 1)) else { return contextLength }
        return size
    }

    private static func isBucketed(_ phase: Phase?) -> Bool { phase.map(isBucketed) ?? false }
}

private extension Character {
    var isASCIIDigit: Bool { isASCII && isNumber }
}
