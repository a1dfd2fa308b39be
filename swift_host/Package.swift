// swift-tools-version:5.9
import PackageDescription

let package = Package(
    name: "LlamaANE",
    platforms: [.macOS(.v13), .iOS(.v16)],
    products: [
        .library(name: "LlamaANE", targets: ["LlamaANE"]),
        .executable(name: "llama-ane-swift", targets: ["llama-ane-swift"]),
    ],
    targets: [
        .target(name: "LlamaANE"),
        .executableTarget(name: "llama-ane-swift", dependencies: ["LlamaANE"]),
        .testTarget(
            name: "LlamaANETests",
            dependencies: ["LlamaANE", "llama-ane-swift"],
            exclude: ["Fixtures"]
        ),
    ]
)
