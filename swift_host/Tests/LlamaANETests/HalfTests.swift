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
}
