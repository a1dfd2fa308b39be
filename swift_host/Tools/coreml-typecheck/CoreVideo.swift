// Stand-in declarations of the CoreVideo API that Sources/LlamaANE/CoreML uses, for type-checking
// that code on Linux (check.sh). Signatures follow the Apple SDK; nothing here runs.
import Foundation
public final class CVPixelBuffer {}
public typealias CVReturn = Int32
public typealias OSType = UInt32
public typealias CFString = String
public typealias CFDictionary = [String: Any]
public typealias CFAllocator = AnyObject
public let kCFAllocatorDefault: CFAllocator? = nil
public let kCVReturnSuccess: CVReturn = 0
public let kCVPixelFormatType_OneComponent16Half: OSType = 0x4C303068
public let kCVPixelBufferIOSurfacePropertiesKey: CFString = "IOSurfaceProperties"
public let kCVPixelBufferMetalCompatibilityKey: CFString = "MetalCompatibility"
public func CVPixelBufferCreate(_ allocator: CFAllocator?, _ width: Int, _ height: Int, _ pixelFormatType: OSType,
                                _ pixelBufferAttributes: CFDictionary?, _ pixelBufferOut: UnsafeMutablePointer<CVPixelBuffer?>) -> CVReturn { 0 }
