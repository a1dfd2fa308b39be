/// What speculative decoding decides by, as Python's `StepTimes`: the seconds of a plain
/// (one-token) step and of a verify step (drafting included; the window is the export's W wide
/// whatever the tree), and one rule (`worthVerifying`).
public protocol StepTimeModel: Sendable {
    /// Records a plain step of `seconds`.
    mutating func plain(seconds: Double)
    /// Records a verify step of `seconds`.
    mutating func verify(seconds: Double)
    /// Seconds of a plain step; nil before the first.
    var plainSeconds: Double? { get }
    /// Seconds of a verify step; nil before the first.
    var verifySeconds: Double? { get }
}

extension StepTimeModel {
    /// Whether a verify step expected to give `expected` tokens beats plain decoding: expected
    /// tokens per second of a verify step above 1 token per second of a plain step. Before a plain
    /// step is measured, never; before a verify step is, whenever something is expected of the tree
    /// (that step measures one).
    public func worthVerifying(expected: Double) -> Bool {
        guard let plain = plainSeconds else { return false }
        guard let window = verifySeconds else { return expected > 1 }
        return expected * plain > window
    }
}

/// The two running means of the steps measured as generation runs.
public struct MeasuredStepTimes: StepTimeModel, Equatable {
    private var plainSteps = 0, plainTotal = 0.0
    private var verifySteps = 0, verifyTotal = 0.0

    public init() {}

    public mutating func plain(seconds: Double) {
        plainSteps += 1
        plainTotal += seconds
    }

    public mutating func verify(seconds: Double) {
        verifySteps += 1
        verifyTotal += seconds
    }

    public var plainSeconds: Double? { plainSteps > 0 ? plainTotal / Double(plainSteps) : nil }
    public var verifySeconds: Double? { verifySteps > 0 ? verifyTotal / Double(verifySteps) : nil }
}

/// Times that do not depend on measurements (tests, and devices whose times are known).
public struct FixedStepTimes: StepTimeModel, Equatable {
    public let plainSeconds: Double?
    public let verifySeconds: Double?

    public init(plain: Double, verify: Double) {
        plainSeconds = plain
        verifySeconds = verify
    }

    public mutating func plain(seconds: Double) {}
    public mutating func verify(seconds: Double) {}
}
