import Foundation
import XCTest

/// Locates the generated fixtures (`python tests/swift_fixtures.py DIR`).
enum Fixtures {
    static let root = URL(fileURLWithPath: #filePath).deletingLastPathComponent().appendingPathComponent("Fixtures")

    /// The fixture at `relativePath`; throws (failing the test) with the command that makes it when absent.
    static func url(_ relativePath: String) throws -> URL {
        let url = root.appendingPathComponent(relativePath)
        guard FileManager.default.fileExists(atPath: url.path) else {
            throw MissingFixtureError(path: url.path)
        }
        return url
    }
}

/// Missing fixtures are an error, not a skip: CI must generate them before `swift test`.
struct MissingFixtureError: Error, CustomStringConvertible {
    let path: String
    var description: String {
        "missing fixture \(path). Generate the fixtures first: "
            + "python tests/swift_fixtures.py swift_host/Tests/LlamaANETests/Fixtures"
    }
}
