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

/// `Float` to IEEE 754 half-precision bits, rounded to nearest even: what the host writes into
/// fp16 inputs (the verify function's tree mask). Past the half range it gives infinity; below it,
/// subnormals and then zero.
@inlinable
public func halfBitsFromFloat(_ value: Float) -> UInt16 {
    let bits = value.bitPattern
    let sign = UInt16(truncatingIfNeeded: (bits >> 16) & 0x8000)
    let exponent = Int((bits >> 23) & 0xFF)
    let mantissa = bits & 0x7F_FFFF
    if exponent == 0xFF { return sign | 0x7C00 | (mantissa == 0 ? 0 : 0x200) }  // inf or NaN
    let e = exponent - 127 + 15  // the half exponent
    if e >= 0x1F { return sign | 0x7C00 }
    if e <= 0 {
        // Subnormal (or zero): the 24-bit significand shifted down to units of 2^-24.
        if e < -10 { return sign }
        let significand = mantissa | 0x80_0000
        let shift = UInt32(14 - e)
        var half = significand >> shift
        let rest = significand & ((1 << shift) - 1), halfway = UInt32(1) << (shift - 1)
        if rest > halfway || (rest == halfway && half & 1 == 1) { half += 1 }
        return sign | UInt16(half)
    }
    var half = UInt32(e) << 10 | mantissa >> 13
    let rest = mantissa & 0x1FFF
    if rest > 0x1000 || (rest == 0x1000 && half & 1 == 1) { half += 1 }  // a carry rounds up the exponent
    return sign | UInt16(half)
}
