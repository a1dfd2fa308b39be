/// The BPE `model` of tokenizer.json: a vocabulary, ranked merges, and what to do with characters
/// the vocabulary lacks (byte fallback to `<0xNN>` tokens, or an unknown token).
///
/// Tables are keyed by UTF-8 bytes, not `String`, so canonically equivalent spellings stay apart.
final class BPEModel {
    private let vocab: [[UInt8]: Int]
    let idToToken: [Int: String]
    /// (left id, right id) packed in a UInt64 -> (rank, merged id).
    private let merges: [UInt64: (rank: Int, id: Int)]
    private let unkId: Int?
    private let fuseUnk: Bool
    private let byteFallbackIds: [Int]?
    private let ignoreMerges: Bool
    private let continuingSubwordPrefix: [UInt8]
    private let endOfWordSuffix: [UInt8]

    init(json: JSONValue) throws {
        let type = json["type"]?.stringValue ?? "BPE"
        guard type == "BPE" else { throw TokenizerError.unsupported(component: "model", type: type) }
        guard let vocabPairs = json["vocab"]?.objectValue else { throw TokenizerError.malformed("BPE model without a vocab") }
        var vocab: [[UInt8]: Int] = [:]
        var idToToken: [Int: String] = [:]
        vocab.reserveCapacity(vocabPairs.count)
        for (token, idValue) in vocabPairs {
            guard let id = idValue.intValue else { throw TokenizerError.malformed("vocab entry \(token) has no integer id") }
            vocab[Array(token.utf8)] = id
            idToToken[id] = token
        }
        self.vocab = vocab
        self.idToToken = idToToken

        continuingSubwordPrefix = Array((json["continuing_subword_prefix"]?.stringValue ?? "").utf8)
        endOfWordSuffix = Array((json["end_of_word_suffix"]?.stringValue ?? "").utf8)

        var merges: [UInt64: (rank: Int, id: Int)] = [:]
        let mergeList = json["merges"]?.arrayValue ?? []
        merges.reserveCapacity(mergeList.count)
        for (rank, entry) in mergeList.enumerated() {
            let parts: [String]
            if let s = entry.stringValue {
                // "a b": split at the first space only (tokens never contain a plain space here).
                guard let space = s.utf8.firstIndex(of: UInt8(ascii: " ")) else {
                    throw TokenizerError.malformed("merge \"\(s)\" is not two tokens separated by a space")
                }
                parts = [String(decoding: s.utf8[s.utf8.startIndex..<space], as: UTF8.self),
                         String(decoding: s.utf8[s.utf8.index(after: space)...], as: UTF8.self)]
            } else if let a = entry.arrayValue, a.count == 2, let l = a[0].stringValue, let r = a[1].stringValue {
                parts = [l, r]
            } else {
                throw TokenizerError.malformed("merge #\(rank) is neither \"a b\" nor [a, b]")
            }
            let left = Array(parts[0].utf8), right = Array(parts[1].utf8)
            guard let l = vocab[left], let r = vocab[right] else {
                throw TokenizerError.malformed("merge \"\(parts[0]) \(parts[1])\" names a token missing from the vocab")
            }
            let mergedRight = right.starts(with: continuingSubwordPrefix) ? Array(right.dropFirst(continuingSubwordPrefix.count)) : right
            guard let m = vocab[left + mergedRight] else {
                throw TokenizerError.malformed("merge \"\(parts[0]) \(parts[1])\" makes a token missing from the vocab")
            }
            let key = Self.pairKey(l, r)
            merges[key] = (rank, m)  // a repeated pair keeps its last rank, as in Hugging Face
        }
        self.merges = merges

        if let unk = json["unk_token"]?.stringValue {
            guard let id = vocab[Array(unk.utf8)] else { throw TokenizerError.malformed("unk_token \(unk) is not in the vocab") }
            unkId = id
        } else {
            unkId = nil
        }
        fuseUnk = json["fuse_unk"]?.boolValue ?? false
        ignoreMerges = json["ignore_merges"]?.boolValue ?? false
        if json["byte_fallback"]?.boolValue == true {
            let ids = (0..<256).map { vocab[Array(Self.byteTokenName(UInt8($0)).utf8)] }
            byteFallbackIds = ids.allSatisfy { $0 != nil } ? ids.map { $0! } : nil
        } else {
            byteFallbackIds = nil
        }
    }

    static func byteTokenName(_ b: UInt8) -> String {
        let hex = String(b, radix: 16, uppercase: true)
        return "<0x" + (hex.count == 1 ? "0" + hex : hex) + ">"
    }

    private static func pairKey(_ a: Int, _ b: Int) -> UInt64 { UInt64(UInt32(truncatingIfNeeded: a)) << 32 | UInt64(UInt32(truncatingIfNeeded: b)) }

    func tokenId(_ token: String) -> Int? { vocab[Array(token.utf8)] }

    /// The ids of one pre-tokenized word.
    func tokenize(_ word: String) -> [Int] {
        let bytes = Array(word.utf8)
        if bytes.isEmpty { return [] }
        if ignoreMerges, let id = vocab[bytes] { return [id] }

        // One symbol per Unicode scalar (Rust `char`), unknown ones through byte fallback or unk.
        var ids: [Int] = []
        var pendingUnk = false
        var start = 0
        while start < bytes.count {
            var end = start + 1
            while end < bytes.count, bytes[end] & 0xC0 == 0x80 { end += 1 }
            var key = Array(bytes[start..<end])
            if start > 0 { key = continuingSubwordPrefix + key }
            if end == bytes.count { key += endOfWordSuffix }
            if let id = vocab[key] {
                if pendingUnk, let unkId { ids.append(unkId); pendingUnk = false }
                ids.append(id)
            } else if let byteIds = byteFallbackIds {
                // As in Hugging Face, a pending unknown is flushed after the fallback bytes.
                for b in key { ids.append(byteIds[Int(b)]) }
            } else if let unkId {
                if pendingUnk, !fuseUnk { ids.append(unkId) }
                pendingUnk = true
            }
            start = end
        }
        if pendingUnk, let unkId { ids.append(unkId) }
        return mergeAll(ids)
    }

    /// Applies merges lowest rank first (leftmost first among equal ranks), like Hugging Face's
    /// `Word::merge_all`, with a heap of candidate pairs and lazy invalidation.
    private func mergeAll(_ ids: [Int]) -> [Int] {
        guard ids.count > 1 else { return ids }
        var symbols = ids
        var prev = Array(-1..<(ids.count - 1))
        var next = Array(1...ids.count)
        next[ids.count - 1] = -1
        var alive = [Bool](repeating: true, count: ids.count)
        var heap = MergeHeap()
        for i in 0..<(ids.count - 1) {
            if let m = merges[Self.pairKey(ids[i], ids[i + 1])] { heap.push(.init(rank: m.rank, pos: i, id: m.id)) }
        }
        while let top = heap.pop() {
            guard alive[top.pos], next[top.pos] >= 0 else { continue }
            let right = next[top.pos]
            guard let m = merges[Self.pairKey(symbols[top.pos], symbols[right])], m.id == top.id else { continue }
            symbols[top.pos] = top.id
            alive[right] = false
            next[top.pos] = next[right]
            if next[right] >= 0 { prev[next[right]] = top.pos }
            if prev[top.pos] >= 0, let m = merges[Self.pairKey(symbols[prev[top.pos]], top.id)] {
                heap.push(.init(rank: m.rank, pos: prev[top.pos], id: m.id))
            }
            if next[top.pos] >= 0, let m = merges[Self.pairKey(top.id, symbols[next[top.pos]])] {
                heap.push(.init(rank: m.rank, pos: top.pos, id: m.id))
            }
        }
        return (0..<symbols.count).filter { alive[$0] }.map { symbols[$0] }
    }
}

/// A binary min-heap of merge candidates ordered by (rank, position).
private struct MergeHeap {
    struct Entry {
        let rank: Int
        let pos: Int
        let id: Int
        func precedes(_ o: Entry) -> Bool { rank != o.rank ? rank < o.rank : pos < o.pos }
    }

    private var items: [Entry] = []

    mutating func push(_ e: Entry) {
        items.append(e)
        var i = items.count - 1
        while i > 0 {
            let parent = (i - 1) / 2
            guard items[i].precedes(items[parent]) else { break }
            items.swapAt(i, parent)
            i = parent
        }
    }

    mutating func pop() -> Entry? {
        guard !items.isEmpty else { return nil }
        let top = items[0]
        let last = items.removeLast()
        if !items.isEmpty {
            items[0] = last
            var i = 0
            while true {
                let l = 2 * i + 1, r = l + 1
                var best = i
                if l < items.count, items[l].precedes(items[best]) { best = l }
                if r < items.count, items[r].precedes(items[best]) { best = r }
                if best == i { break }
                items.swapAt(i, best)
                i = best
            }
        }
        return top
    }
}
