// swift-tools-version:5.9
// The Swift package lives in swift_host/; this manifest sits at the repository root so that Xcode
// and SwiftPM can add the package by the repository's git URL.
import PackageDescription

let package = Package(
    name: "LlamaANE",
    platforms: [.macOS(.v13), .iOS(.v16)],
    products: [
        .library(name: "LlamaANE", targets: ["LlamaANE"]),
        .executable(name: "llama-ane-swift", targets: ["llama-ane-swift"]),
    ],
    targets: [
        .target(name: "LlamaANE", path: "swift_host/Sources/LlamaANE"),
        .executableTarget(name: "llama-ane-swift", dependencies: ["LlamaANE"],
                          path: "swift_host/Sources/llama-ane-swift"),
        .testTarget(
            name: "LlamaANETests",
            dependencies: ["LlamaANE", "llama-ane-swift"],
            path: "swift_host/Tests/LlamaANETests",
            exclude: ["Fixtures"]
        ),
    ]
)
