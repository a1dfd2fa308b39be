import Foundation

/// SHA-256 (FIPS 180-4), used to check the hashes a manifest records. CryptoKit is not available
/// on Linux and the package takes no dependencies, so it is implemented here.
struct SHA256 {
    private var state: [UInt32] = [
        0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19,
    ]
    private var buffer: [UInt8] = []
    private var length: UInt64 = 0

    private static let k: [UInt32] = [
        0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
        0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
        0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
        0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
        0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
        0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
        0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
        0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
    ]

    mutating func update<S: Sequence>(_ bytes: S) where S.Element == UInt8 {
        for b in bytes {
            buffer.append(b)
            length &+= 1
            if buffer.count == 64 { compress(buffer); buffer.removeAll(keepingCapacity: true) }
        }
    }

    mutating func update(_ data: Data) {
        data.withUnsafeBytes { raw in
            let bytes = raw.bindMemory(to: UInt8.self)
            var i = 0
            // Top up a partial block, then compress whole blocks straight from the input.
            while !buffer.isEmpty, i < bytes.count { update(CollectionOfOne(bytes[i])); i += 1 }
            while i + 64 <= bytes.count {
                compress(UnsafeBufferPointer(rebasing: bytes[i..<i + 64]))
                length &+= 64
                i += 64
            }
            if i < bytes.count { update(UnsafeBufferPointer(rebasing: bytes[i...])) }
        }
    }

    /// The digest as lowercase hex.
    mutating func finalizeHex() -> String {
        let bitLength = length &* 8
        var pad: [UInt8] = [0x80]
        while (buffer.count + pad.count) % 64 != 56 { pad.append(0) }
        for shift in stride(from: 56, through: 0, by: -8) { pad.append(UInt8(truncatingIfNeeded: bitLength >> UInt64(shift))) }
        let savedLength = length
        update(pad)
        length = savedLength
        return state.map { String(format: "%08x", $0) }.joined()
    }

    private mutating func compress<C: RandomAccessCollection>(_ block: C) where C.Element == UInt8, C.Index == Int {
        var w = [UInt32](repeating: 0, count: 64)
        let base = block.startIndex
        for t in 0..<16 {
            w[t] = UInt32(block[base + 4 * t]) << 24 | UInt32(block[base + 4 * t + 1]) << 16
                | UInt32(block[base + 4 * t + 2]) << 8 | UInt32(block[base + 4 * t + 3])
        }
        for t in 16..<64 {
            let s0 = rotr(w[t - 15], 7) ^ rotr(w[t - 15], 18) ^ (w[t - 15] >> 3)
            let s1 = rotr(w[t - 2], 17) ^ rotr(w[t - 2], 19) ^ (w[t - 2] >> 10)
            w[t] = w[t - 16] &+ s0 &+ w[t - 7] &+ s1
        }
        var a = state[0], b = state[1], c = state[2], d = state[3]
        var e = state[4], f = state[5], g = state[6], h = state[7]
        for t in 0..<64 {
            let s1 = rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)
            let ch = (e & f) ^ (~e & g)
            let t1 = h &+ s1 &+ ch &+ Self.k[t] &+ w[t]
            let s0 = rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)
            let maj = (a & b) ^ (a & c) ^ (b & c)
            let t2 = s0 &+ maj
            h = g; g = f; f = e; e = d &+ t1
            d = c; c = b; b = a; a = t1 &+ t2
        }
        state[0] &+= a; state[1] &+= b; state[2] &+= c; state[3] &+= d
        state[4] &+= e; state[5] &+= f; state[6] &+= g; state[7] &+= h
    }

    private func rotr(_ x: UInt32, _ n: UInt32) -> UInt32 { (x >> n) | (x << (32 - n)) }

    /// SHA-256 hex of `data`.
    static func hex(_ data: Data) -> String {
        var h = SHA256()
        h.update(data)
        return h.finalizeHex()
    }

    /// The manifest hash of a path: a file's SHA-256, or for a directory (an .mlpackage) the SHA-256
    /// over "relative/path\0<file sha256 hex>\n" for each regular file in sorted path order.
    static func manifestHash(of url: URL) throws -> String {
        var isDirectory: ObjCBool = false
        guard FileManager.default.fileExists(atPath: url.path, isDirectory: &isDirectory) else {
            throw CocoaError(.fileNoSuchFile)
        }
        if !isDirectory.boolValue { return hex(try Data(contentsOf: url, options: .mappedIfSafe)) }
        var files: [String] = []
        let base = url.standardizedFileURL.path
        if let walker = FileManager.default.enumerator(atPath: base) {
            for case let rel as String in walker {
                var dir: ObjCBool = false
                if FileManager.default.fileExists(atPath: base + "/" + rel, isDirectory: &dir), !dir.boolValue {
                    files.append(rel)
                }
            }
        }
        // Python sorts str paths by code point; compare UTF-8 bytes, which orders the same way.
        files.sort { Array($0.utf8).lexicographicallyPrecedes(Array($1.utf8)) }
        var h = SHA256()
        for rel in files {
            let digest = hex(try Data(contentsOf: URL(fileURLWithPath: base + "/" + rel), options: .mappedIfSafe))
            h.update(Array(rel.utf8) + [0] + Array(digest.utf8) + [0x0A])
        }
        return h.finalizeHex()
    }
}
