// Stand-in declarations of the Core ML API that Sources/LlamaANE/CoreML uses, for type-checking
// that code on Linux (check.sh). Signatures follow the Apple SDK; nothing here runs.
import Foundation
@_exported import CoreVideo
public enum MLComputeUnits: Int { case cpuOnly, cpuAndGPU, all, cpuAndNeuralEngine }
public enum MLMultiArrayDataType: Int { case double, float64, float32, float, float16, int32 }
public protocol MLShapedArrayScalar {}
extension Int32: MLShapedArrayScalar {}
extension Float: MLShapedArrayScalar {}
public protocol MLFeatureProvider {}
public final class MLFeatureValue { public init(multiArray: MLMultiArray) {} }
public final class MLDictionaryFeatureProvider: MLFeatureProvider { public init(dictionary: [String: Any]) throws {} }
public final class MLPredictionOptions { public init() {}; public var outputBackings: [String: Any] = [:] }
public final class MLModelConfiguration {
    public init() {}
    public var computeUnits: MLComputeUnits = .all
    @available(macOS 15.0, iOS 18.0, *) public var functionName: String? { get { nil } set {} }
}
@available(macOS 15.0, iOS 18.0, *)
public final class MLState {
    public func withMultiArray<R>(for stateName: String, _ body: (MLMultiArray) throws -> R) rethrows -> R { fatalError() }
}
public final class MLModel {
    @available(macOS 15.0, iOS 18.0, *) public func makeState() -> MLState { MLState() }
    @available(macOS 15.0, iOS 18.0, *)
    public func prediction(from input: MLFeatureProvider, using state: MLState,
                           options: MLPredictionOptions) async throws -> MLFeatureProvider { input }
    public class func compileModel(at modelURL: URL) async throws -> URL { modelURL }
    public class func load(contentsOf url: URL, configuration: MLModelConfiguration) async throws -> MLModel { MLModel() }
    public func prediction(from input: MLFeatureProvider, options: MLPredictionOptions) throws -> MLFeatureProvider { input }
    @available(macOS 14.0, iOS 17.0, *)
    public func prediction(from input: MLFeatureProvider, options: MLPredictionOptions) async throws -> MLFeatureProvider { input }
}
public final class MLMultiArray {
    public init(shape: [NSNumber], dataType: MLMultiArrayDataType) throws { self.shape = shape; strides = shape; self.dataType = dataType }
    public init(pixelBuffer: CVPixelBuffer, shape: [NSNumber]) { self.shape = shape; strides = shape; dataType = .float16 }
    public init(dataPointer: UnsafeMutableRawPointer, shape: [NSNumber], dataType: MLMultiArrayDataType, strides: [NSNumber],
                deallocator: ((UnsafeMutableRawPointer) -> Void)? = nil) throws {
        self.shape = shape; self.strides = strides; self.dataType = dataType
    }
    public let shape: [NSNumber]
    public let strides: [NSNumber]
    public let dataType: MLMultiArrayDataType
    public func withUnsafeBytes<R>(_ body: (UnsafeRawBufferPointer) throws -> R) rethrows -> R { fatalError() }
    public func withUnsafeMutableBytes<R>(_ body: (UnsafeMutableRawBufferPointer, [Int]) throws -> R) rethrows -> R { fatalError() }
    public func withUnsafeMutableBufferPointer<S: MLShapedArrayScalar, R>(ofType type: S.Type,
        _ body: (UnsafeMutableBufferPointer<S>, [Int]) throws -> R) rethrows -> R { fatalError() }
}
