/// IEEE 754 half-precision bits to `Float`. Core ML hands fp16 outputs over as raw 16-bit values;
/// Swift's `Float16` is not available on Intel Macs, so the conversion is done by hand.
@inlinable
public func floatFromHalfBits(_ h: UInt16) -> Float {
    let sign = UInt32(h & 0x8000) << 16
    let exponent = UInt32(h & 0x7C00) >> 10
    let mantissa = UInt32(h & 0x03FF)
    switch exponent {
    case 0:
        // Zero or subnormal: mantissa * 2^-24.
        let magnitude = Float(mantissa) * 5.960_464_5e-8
        return sign == 0 ? magnitude : -magnitude
    case 0x1F:
        return Float(bitPattern: sign | 0x7F80_0000 | (mantissa << 13))  // inf or NaN
    default:
        return Float(bitPattern: sign | ((exponent + 112) << 23) | (mantissa << 13))
    }
}
