import XCTest
@testable import LlamaANE

final class HalfTests: XCTestCase {
    func testKnownBitPatterns() {
        XCTAssertEqual(floatFromHalfBits(0x0000), 0)
        XCTAssertEqual(floatFromHalfBits(0x8000).sign, .minus)
        XCTAssertEqual(floatFromHalfBits(0x3C00), 1)
        XCTAssertEqual(floatFromHalfBits(0xC000), -2)
        XCTAssertEqual(floatFromHalfBits(0x3555), 0.333_251_95, accuracy: 1e-8)
        XCTAssertEqual(floatFromHalfBits(0x7BFF), 65504)
        XCTAssertEqual(floatFromHalfBits(0x0001), 5.960_464_5e-8, accuracy: 1e-12)  // smallest subnormal
        XCTAssertEqual(floatFromHalfBits(0x03FF), 6.097_555_2e-5, accuracy: 1e-10)  // largest subnormal
        XCTAssertEqual(floatFromHalfBits(0x7C00), .infinity)
        XCTAssertEqual(floatFromHalfBits(0xFC00), -.infinity)
        XCTAssertTrue(floatFromHalfBits(0x7E00).isNaN)
        XCTAssertEqual(floatFromHalfBits(0xF0E2), -10000, accuracy: 4)  // the mask value -1e4 in fp16
    }

    func testFloatToHalfRoundsToNearestEven() {
        XCTAssertEqual(halfBitsFromFloat(0), 0x0000)
        XCTAssertEqual(halfBitsFromFloat(-0.0), 0x8000)
        XCTAssertEqual(halfBitsFromFloat(1), 0x3C00)
        XCTAssertEqual(halfBitsFromFloat(-2), 0xC000)
        XCTAssertEqual(halfBitsFromFloat(DraftTree.hidden), 0xF0E2)  // the tree mask's -1e4
        XCTAssertEqual(halfBitsFromFloat(65504), 0x7BFF)
        XCTAssertEqual(halfBitsFromFloat(65520), 0x7C00, "rounds up past the largest half")
        XCTAssertEqual(halfBitsFromFloat(1e6), 0x7C00)
        XCTAssertEqual(halfBitsFromFloat(-.infinity), 0xFC00)
        XCTAssertTrue(floatFromHalfBits(halfBitsFromFloat(.nan)).isNaN)
        XCTAssertEqual(halfBitsFromFloat(5.960_464_5e-8), 0x0001)  // smallest subnormal
        XCTAssertEqual(halfBitsFromFloat(1e-9), 0x0000)
        XCTAssertEqual(halfBitsFromFloat(1 + 1.0 / 2048), 0x3C00, "a tie rounds to the even mantissa")
        XCTAssertEqual(halfBitsFromFloat(1 + 3.0 / 2048), 0x3C02, "a tie rounds to the even mantissa")
        // Every half value survives the round trip.
        for bits in UInt16(0)...UInt16(0x7BFF) {
            XCTAssertEqual(halfBitsFromFloat(floatFromHalfBits(bits)), bits)
            XCTAssertEqual(halfBitsFromFloat(floatFromHalfBits(bits | 0x8000)), bits | 0x8000)
        }
    }
}
