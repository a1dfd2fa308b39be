/// GPT-2's reversible map between bytes and printable Unicode scalars, used by byte-level BPE
/// (Llama 3, SmolLM2, GPT-2): every byte of the UTF-8 input becomes one visible character
/// before the BPE model sees it, and the decoder maps the characters back to bytes.
enum ByteLevel {
    /// `byteToScalar[b]` is the character standing for byte `b`.
    static let byteToScalar: [Unicode.Scalar] = {
        var printable = Set<UInt32>()
        for range in [0x21...0x7E, 0xA1...0xAC, 0xAE...0xFF] { for v in range { printable.insert(UInt32(v)) } }
        var table = [Unicode.Scalar](repeating: " ", count: 256)
        var next: UInt32 = 256
        for b in 0..<256 {
            if printable.contains(UInt32(b)) {
                table[b] = Unicode.Scalar(UInt32(b))!
            } else {
                table[b] = Unicode.Scalar(next)!
                next += 1
            }
        }
        return table
    }()

    /// The inverse of `byteToScalar`.
    static let scalarToByte: [Unicode.Scalar: UInt8] = {
        var map: [Unicode.Scalar: UInt8] = [:]
        for (b, s) in byteToScalar.enumerated() { map[s] = UInt8(b) }
        return map
    }()

    /// The byte-level spelling of `text`: one scalar per UTF-8 byte.
    static func encode(_ text: String) -> String {
        var scalars = String.UnicodeScalarView()
        for b in text.utf8 { scalars.append(byteToScalar[Int(b)]) }
        return String(scalars)
    }

    /// The bytes a byte-level token spells, or nil when it holds a scalar outside the alphabet
    /// (added tokens such as `<|im_start|>` are plain ASCII and map to themselves).
    static func bytes(of token: String) -> [UInt8]? {
        var out: [UInt8] = []
        for s in token.unicodeScalars {
            guard let b = scalarToByte[s] else { return nil }
            out.append(b)
        }
        return out
    }

    /// GPT-2's split pattern, used by the ByteLevel pre-tokenizer when `use_regex` is true.
    static let gpt2Pattern = #"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"#
}
