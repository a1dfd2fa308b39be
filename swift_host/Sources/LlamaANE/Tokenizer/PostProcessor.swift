/// The `post_processor` section of tokenizer.json, reduced to what changes ids for one sequence:
/// the special tokens a `TemplateProcessing` puts around it (Llama's BOS).
struct PostProcessor {
    /// Ids before and after the sequence when special tokens are added.
    let prefix: [Int]
    let suffix: [Int]

    static func from(json: JSONValue?) throws -> PostProcessor? {
        guard let json, !json.isNull else { return nil }
        guard let type = json["type"]?.stringValue else { throw TokenizerError.malformed("post_processor without a type") }
        switch type {
        case "Sequence":
            var prefix: [Int] = [], suffix: [Int] = []
            for item in json["processors"]?.arrayValue ?? [] {
                if let p = try from(json: item) { prefix += p.prefix; suffix = p.suffix + suffix }
            }
            return PostProcessor(prefix: prefix, suffix: suffix)
        case "ByteLevel":
            return PostProcessor(prefix: [], suffix: [])  // offsets only, ids unchanged
        case "TemplateProcessing":
            let specials = json["special_tokens"]?.objectValue ?? []
            func ids(of name: String) throws -> [Int] {
                guard let entry = specials.first(where: { $0.0 == name })?.1,
                      let list = entry["ids"]?.arrayValue?.compactMap(\.intValue) else {
                    throw TokenizerError.malformed("TemplateProcessing names special token \(name) without ids")
                }
                return list
            }
            var prefix: [Int] = [], suffix: [Int] = []
            var seenSequence = false
            for item in json["single"]?.arrayValue ?? [] {
                if item["Sequence"] != nil {
                    seenSequence = true
                } else if let name = item["SpecialToken"]?["id"]?.stringValue {
                    if seenSequence { suffix += try ids(of: name) } else { prefix += try ids(of: name) }
                }
            }
            return PostProcessor(prefix: prefix, suffix: suffix)
        default:
            throw TokenizerError.unsupported(component: "post_processor", type: type)
        }
    }

    func apply(_ ids: [Int]) -> [Int] { prefix + ids + suffix }
}
