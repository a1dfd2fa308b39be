import Foundation
import XCTest
@testable import LlamaANE

/// The manifest is untrusted input: every case of `tests/fixtures/bad_manifests` (the corpus the
/// Python tests apply too; its README describes the format), applied to a copy of the fixture
/// export, must be refused by `Manifest.load` with a `ManifestError` naming what the case names.
final class ManifestFaultTests: XCTestCase {
    /// The repository's `tests/fixtures/bad_manifests`, four folders above this file.
    static let corpus = URL(fileURLWithPath: #filePath)
        .deletingLastPathComponent().deletingLastPathComponent().deletingLastPathComponent().deletingLastPathComponent()
        .appendingPathComponent("tests/fixtures/bad_manifests")

    private var scratch: URL!

    override func setUpWithError() throws {
        scratch = FileManager.default.temporaryDirectory.appendingPathComponent("llama-ane-faults-\(UUID().uuidString)")
        try FileManager.default.createDirectory(at: scratch, withIntermediateDirectories: true)
    }

    override func tearDownWithError() throws {
        try? FileManager.default.removeItem(at: scratch)
    }

    struct CorpusError: Error, CustomStringConvertible {
        let description: String
    }

    static func cases() throws -> [(name: String, body: [String: Any])] {
        let names = try FileManager.default.contentsOfDirectory(atPath: corpus.path).filter { $0.hasSuffix(".json") }.sorted()
        return try names.map { name in
            let data = try Data(contentsOf: corpus.appendingPathComponent(name))
            guard let body = try JSONSerialization.jsonObject(with: data) as? [String: Any] else {
                throw CorpusError(description: "\(name) is not a JSON object")
            }
            return (String(name.dropLast(".json".count)), body)
        }
    }

    /// `node` with the value at the dotted field path `parts` set to `value`, or removed when nil. A
    /// key holding dots is the shortest run of parts that names a key of the object reached; at the
    /// last step the rest of the path is the key.
    static func edit(_ node: Any, _ parts: [String], _ value: Any?) throws -> Any {
        if var list = node as? [Any] {
            guard let i = Int(parts[0]), list.indices.contains(i) else {
                throw CorpusError(description: "no list index \(parts[0])")
            }
            if parts.count > 1 {
                list[i] = try edit(list[i], Array(parts.dropFirst()), value)
            } else if let value {
                list[i] = value
            } else {
                list.remove(at: i)
            }
            return list
        }
        guard var object = node as? [String: Any] else { throw CorpusError(description: "cannot step into \(parts)") }
        let n = (1...parts.count).first { object[parts[..<$0].joined(separator: ".")] != nil } ?? parts.count
        let key = parts[..<n].joined(separator: ".")
        if n == parts.count {
            object[key] = value
        } else {
            guard let child = object[key] else { throw CorpusError(description: "no field \(key)") }
            object[key] = try edit(child, Array(parts[n...]), value)
        }
        return object
    }

    /// Applies a corpus case to the export copy `folder`; `outside` is a folder beside it.
    static func apply(_ body: [String: Any], to folder: URL, outside: URL) throws {
        let url = folder.appendingPathComponent(Manifest.fileName)
        var manifest = try JSONSerialization.jsonObject(with: Data(contentsOf: url))
        if let replacement = body["replace"] { manifest = replacement }
        for (field, value) in (body["set"] as? [String: Any] ?? [:]).sorted(by: { $0.key < $1.key }) {
            manifest = try edit(manifest, field.components(separatedBy: "."), value)
        }
        for field in body["delete"] as? [String] ?? [] {
            manifest = try edit(manifest, field.components(separatedBy: "."), nil)
        }
        let data = manifest is NSNull ? Data("null".utf8) : try JSONSerialization.data(withJSONObject: manifest)
        try data.write(to: url)
        if let link = body["symlink"] as? String {
            let target = folder.appendingPathComponent(link)
            let copy = outside.appendingPathComponent(target.lastPathComponent)
            try FileManager.default.copyItem(at: target, to: copy)
            try FileManager.default.removeItem(at: target)
            try FileManager.default.createSymbolicLink(at: target, withDestinationURL: copy)
        }
    }

    private func copyOfExport(_ name: String) throws -> (export: URL, outside: URL) {
        let root = scratch.appendingPathComponent(name)
        let export = root.appendingPathComponent("export"), outside = root.appendingPathComponent("outside")
        try FileManager.default.createDirectory(at: outside, withIntermediateDirectories: true)
        try FileManager.default.copyItem(at: try Fixtures.url("export"), to: export)
        return (export, outside)
    }

    func testTheCorpusIsThereAndTheHarnessKeepsAGoodExportGood() throws {
        XCTAssertGreaterThanOrEqual(try Self.cases().count, 25)
        let (export, outside) = try copyOfExport("unchanged")
        try Self.apply(["set": [String: Any]()], to: export, outside: outside)
        XCTAssertNoThrow(try Manifest.load(from: export, verifyHashes: true))
    }

    /// A conv state (`cache.conv`) for layers the config does not convolve is refused, naming both.
    func testAConvStateOfLayersThatDoNotConvolveIsRefusedByName() throws {
        let (export, outside) = try copyOfExport("conv")
        try Self.apply(["set": ["cache.conv": ["layers": [0, 2], "channels": 64, "kernel": 3, "width": 32]]],
                       to: export, outside: outside)
        XCTAssertThrowsError(try Manifest.load(from: export, verifyHashes: true)) { error in
            XCTAssertEqual(error as? ManifestError, .inconsistent(
                "cache.conv.layers [0, 2] are not config.conv_layers [], the layers that convolve"))
        }
    }

    func testEveryBadManifestIsRefusedNamingTheProblem() throws {
        for (name, body) in try Self.cases() {
            let (export, outside) = try copyOfExport(name)
            try Self.apply(body, to: export, outside: outside)
            let mentions = try XCTUnwrap(body["mentions"] as? [String], name)
            XCTAssertThrowsError(try Manifest.load(from: export, verifyHashes: true), name) { error in
                guard let error = error as? ManifestError else { return XCTFail("\(name): not a ManifestError: \(error)") }
                for word in mentions {
                    XCTAssertTrue(error.description.contains(word), "\(name): \"\(word)\" not in: \(error.description)")
                }
            }
        }
    }
}
