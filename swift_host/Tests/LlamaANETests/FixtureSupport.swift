import Foundation
import XCTest

/// Locates the fixtures: committed files that `python tests/swift_fixtures.py DIR` generated.
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

/// Missing fixtures are an error, not a skip: they are part of the package's sources.
struct MissingFixtureError: Error, CustomStringConvertible {
    let path: String
    var description: String {
        "missing fixture \(path). The fixtures are committed with the package: restore them from version control, "
            + "or regenerate them with python tests/swift_fixtures.py swift_host/Tests/LlamaANETests/Fixtures"
    }
}
