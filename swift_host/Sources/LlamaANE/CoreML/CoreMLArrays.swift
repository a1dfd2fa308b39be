#if canImport(CoreML)
import CoreML
import CoreVideo
import Foundation

/// Preallocated multi-arrays for the pipeline. fp16 tensors are backed by IOSurface pixel buffers
/// (`OneComponent16Half`, width = last dimension), which the Neural Engine reads and writes
/// without a copy; they are passed as inputs and as `MLPredictionOptions.outputBackings`.
enum CoreMLArrays {
    /// An array for `spec` (zeroed): IOSurface-backed for float16, plain memory otherwise.
    static func make(_ spec: Manifest.TensorSpec) throws -> MLMultiArray {
        let shape = spec.shape.map { NSNumber(value: $0) }
        switch spec.dtype {
        case "float16":
            guard let width = spec.shape.last, width > 0 else {
                throw PipelineError.allocationFailed("\(spec.name) with shape \(spec.shape)")
            }
            let height = spec.shape.dropLast().reduce(1, *)
            let attributes: [String: Any] = [
                kCVPixelBufferIOSurfacePropertiesKey as String: [String: Any](),
                kCVPixelBufferMetalCompatibilityKey as String: true,
            ]
            var buffer: CVPixelBuffer?
            let status = CVPixelBufferCreate(kCFAllocatorDefault, width, height, kCVPixelFormatType_OneComponent16Half,
                                             attributes as CFDictionary, &buffer)
            guard status == kCVReturnSuccess, let buffer else {
                throw PipelineError.allocationFailed("an IOSurface of \(width)x\(height) fp16 for \(spec.name) (status \(status))")
            }
            let array = MLMultiArray(pixelBuffer: buffer, shape: shape)
            zero(array)
            return array
        case "float32", "int32":
            let array = try MLMultiArray(shape: shape, dataType: spec.dtype == "int32" ? .int32 : .float32)
            zero(array)
            return array
        default:
            throw PipelineError.allocationFailed("\(spec.name): unsupported dtype \(spec.dtype)")
        }
    }

    /// A view of the first `positions` entries of `array`'s last dimension: the same memory with
    /// `array`'s storage strides (row padding included), so that a context bucket's function reads
    /// and writes the first positions of the whole cache in place. The view keeps `array` alive.
    /// The address taken here stays valid after the access ends: heap storage never moves, and an
    /// IOSurface stays mapped at one address for as long as it exists.
    static func prefixView(_ array: MLMultiArray, positions: Int) throws -> MLMultiArray {
        var shape = array.shape.map(\.intValue)
        guard let last = shape.last, positions > 0, positions <= last else {
            throw PipelineError.allocationFailed("a view of the first \(positions) positions of an array of shape \(shape)")
        }
        shape[shape.count - 1] = positions
        var base: UnsafeMutableRawPointer?
        var strides: [Int] = []
        array.withUnsafeMutableBytes { raw, storageStrides in
            base = raw.baseAddress
            strides = storageStrides
        }
        guard let base else {
            throw PipelineError.allocationFailed("a view of the first \(positions) positions of an array without storage")
        }
        return try MLMultiArray(dataPointer: base, shape: shape.map { NSNumber(value: $0) }, dataType: array.dataType,
                                strides: strides.map { NSNumber(value: $0) },
                                deallocator: { _ in withExtendedLifetime(array) {} })
    }

    /// Sets every byte (padding included) to zero.
    static func zero(_ array: MLMultiArray) {
        array.withUnsafeMutableBytes { raw, _ in
            if let base = raw.baseAddress { memset(base, 0, raw.count) }
        }
    }

    /// Writes `values` into an int32 array along its last dimension.
    static func write(_ values: [Int32], into array: MLMultiArray) {
        array.withUnsafeMutableBufferPointer(ofType: Int32.self) { pointer, strides in
            let stride = strides.last ?? 1
            for (i, v) in values.enumerated() { pointer[i * stride] = v }
        }
    }

    /// Writes `values`, row-major over the array's shape, into a float16 or float32 array through
    /// the storage's strides (an IOSurface-backed array's rows may be padded).
    static func write(_ values: [Float], into array: MLMultiArray) {
        let shape = array.shape.map(\.intValue)
        let isHalf = array.dataType == .float16
        array.withUnsafeMutableBytes { raw, strides in
            for (flat, value) in values.enumerated() {
                var rest = flat, offset = 0
                for d in stride(from: shape.count - 1, through: 0, by: -1) {
                    offset += (rest % shape[d]) * strides[d]
                    rest /= shape[d]
                }
                if isHalf {
                    raw.storeBytes(of: halfBitsFromFloat(value), toByteOffset: offset * 2, as: UInt16.self)
                } else {
                    raw.storeBytes(of: value, toByteOffset: offset * 4, as: Float.self)
                }
            }
        }
    }

    /// Writes a host-made mask (1, 1, S, N) into a float16 or float32 array of that shape, through
    /// the storage's strides: 0 where a row sees a column, `HostMasks.maskValue` where not.
    static func write(_ mask: HostMask, into array: MLMultiArray) throws {
        guard array.shape.map(\.intValue) == mask.shape, array.dataType == .float16 || array.dataType == .float32 else {
            throw PipelineError.allocationFailed("a mask of \(mask.shape) in an array of \(array.shape.map(\.intValue))")
        }
        let isHalf = array.dataType == .float16
        let (seen, hidden) = (halfBitsFromFloat(0), halfBitsFromFloat(HostMasks.maskValue))
        array.withUnsafeMutableBytes { raw, strides in
            for r in 0..<mask.rows {
                let row = r * strides[2], first = r * mask.columns
                for c in 0..<mask.columns {
                    let offset = row + c * strides[3], visible = mask.visible[first + c]
                    if isHalf {
                        raw.storeBytes(of: visible ? seen : hidden, toByteOffset: offset * 2, as: UInt16.self)
                    } else {
                        raw.storeBytes(of: visible ? Float(0) : HostMasks.maskValue, toByteOffset: offset * 4, as: Float.self)
                    }
                }
            }
        }
    }

    /// Moves a carried state on (`StateCarry`): `operation` on `target`, reading `source`, two 4-D
    /// arrays of one float type (fp16 copied as its bits), through their storage's strides.
    static func carry(_ operation: StateCarry.Operation, target: MLMultiArray, source: MLMultiArray) throws {
        guard target.dataType == source.dataType, target.dataType == .float16 || target.dataType == .float32 else {
            throw PipelineError.allocationFailed("a state of \(target.dataType) moved on by values of \(source.dataType)")
        }
        let half = target.dataType == .float16
        let (targetShape, sourceShape) = (target.shape.map(\.intValue), source.shape.map(\.intValue))
        try target.withUnsafeMutableBytes { targetRaw, targetStrides in
            try source.withUnsafeMutableBytes { sourceRaw, sourceStrides in
                guard let t = targetRaw.baseAddress, let s = sourceRaw.baseAddress else {
                    throw PipelineError.allocationFailed("a state without storage")
                }
                if half {
                    try StateCarry.apply(operation,
                                         to: .init(base: t.assumingMemoryBound(to: UInt16.self), shape: targetShape, strides: targetStrides),
                                         from: .init(base: s.assumingMemoryBound(to: UInt16.self), shape: sourceShape, strides: sourceStrides))
                } else {
                    try StateCarry.apply(operation,
                                         to: .init(base: t.assumingMemoryBound(to: Float.self), shape: targetShape, strides: targetStrides),
                                         from: .init(base: s.assumingMemoryBound(to: Float.self), shape: sourceShape, strides: sourceStrides))
                }
            }
        }
    }

    /// Copies rows of `sources` into `target` (`RowGather.copy`) along `axis`: 4-D arrays of one float
    /// type (fp16 copied as its bits), through their storage's strides. An array named by several
    /// sources is accessed once.
    static func gather(into target: MLMultiArray, axis: Int, from sources: [(array: MLMultiArray, rows: Range<Int>)]) throws {
        let type = target.dataType
        guard type == .float16 || type == .float32, sources.allSatisfy({ $0.array.dataType == type }) else {
            throw PipelineError.allocationFailed("rows of \(sources.map { "\($0.array.dataType)" }) gathered into \(type)")
        }
        var arrays: [MLMultiArray] = []
        for source in sources where !arrays.contains(where: { $0 === source.array }) { arrays.append(source.array) }
        func run<T>(_: T.Type) throws {
            // each array's storage, accessed once, nested so that every access is open while copying
            func open(_ k: Int, _ tensors: [StridedTensor<T>]) throws {
                guard k < arrays.count else {
                    let byArray = sources.map { s in tensors[arrays.firstIndex { $0 === s.array } ?? 0] }
                    return try target.withUnsafeMutableBytes { raw, strides in
                        guard let base = raw.baseAddress else { throw PipelineError.allocationFailed("a gathered input without storage") }
                        let t = StridedTensor(base: base.assumingMemoryBound(to: T.self), shape: target.shape.map(\.intValue), strides: strides)
                        try RowGather.copy(into: t, axis: axis, from: zip(byArray, sources).map { ($0, $1.rows) })
                    }
                }
                try arrays[k].withUnsafeMutableBytes { raw, strides in
                    guard let base = raw.baseAddress else { throw PipelineError.allocationFailed("gathered rows without storage") }
                    try open(k + 1, tensors + [StridedTensor(base: base.assumingMemoryBound(to: T.self),
                                                             shape: arrays[k].shape.map(\.intValue), strides: strides)])
                }
            }
            try open(0, [])
        }
        if type == .float16 { try run(UInt16.self) } else { try run(Float.self) }
    }

    /// Appends column `column` of a (1, N, 1, S) array to `out` as Float (fp16 or fp32 storage).
    static func appendColumn(_ array: MLMultiArray, column: Int, to out: inout [Float]) {
        let n = array.shape[1].intValue
        let isHalf = array.dataType == .float16
        // The mutable accessor is the one that reports the storage's strides, which for
        // IOSurface-backed arrays include row padding and may differ from `array.strides`.
        array.withUnsafeMutableBytes { raw, strides in
            let base = column * strides[3]
            if isHalf {
                let p = UnsafeRawBufferPointer(raw).bindMemory(to: UInt16.self)
                for i in 0..<n { out.append(floatFromHalfBits(p[base + i * strides[1]])) }
            } else {
                let p = UnsafeRawBufferPointer(raw).bindMemory(to: Float.self)
                for i in 0..<n { out.append(p[base + i * strides[1]]) }
            }
        }
    }
}
#endif
