#!/usr/bin/env bash
# Type-checks the Core ML code (Sources/LlamaANE/CoreML, the CLI's Core ML path, the tests' Core ML
# cases) on Linux, against stand-in declarations of the Core ML and CoreVideo APIs it uses. This catches Swift-level
# mistakes (types, optionals, try/await, availability blocks) where `swift build` cannot see the
# code because Core ML is absent; it does not replace building and running on macOS.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
package="$here/../.."
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
swiftc -parse-as-library -emit-module -module-name CoreVideo "$here/CoreVideo.swift" -emit-module-path "$out/CoreVideo.swiftmodule"
swiftc -parse-as-library -emit-module -module-name CoreML -I "$out" "$here/CoreML.swift" -emit-module-path "$out/CoreML.swiftmodule"
swiftc -parse-as-library -emit-module -enable-testing -swift-version 5 -module-name LlamaANE -I "$out" \
    $(find "$package/Sources/LlamaANE" -name '*.swift') -emit-module-path "$out/LlamaANE.swiftmodule"
swiftc -parse-as-library -emit-module -enable-testing -swift-version 5 -module-name llama_ane_swift -I "$out" \
    "$package"/Sources/llama-ane-swift/*.swift -emit-module-path "$out/llama_ane_swift.swiftmodule"
swiftc -typecheck -parse-as-library -swift-version 5 -module-name LlamaANETests -I "$out" "$package"/Tests/LlamaANETests/*.swift
echo "Core ML code type-checks against the stand-in API."
