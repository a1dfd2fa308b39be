/// What a verify window costs, in plain (one-token) decode steps, by its number of nodes n (the
/// root included): what `SpeculativeDecoder` sizes estimated trees by. It may learn from the
/// seconds that plain steps and verify windows take.
public protocol StepCostModel: Sendable {
    /// Records a plain step of `seconds`.
    mutating func plain(seconds: Double)
    /// Records a verify window of `nodes` tree nodes (the root included) that took `seconds`.
    mutating func verify(nodes: Int, seconds: Double)
    /// The cost of a verify window of `nodes` >= 2 tree nodes, in plain steps.
    func cost(nodes: Int) -> Double
}

/// Step costs measured as generation runs, as Python's `StepCosts`: the seconds of plain steps (a
/// moving average), and the seconds of recent verify windows, each divided by the plain step's
/// seconds at the time. Two estimates are kept of those window costs: a straight line over n
/// (least squares, older windows weighing less, with two pseudo-windows of `prior` weighing
/// `priorWeight` each, so that a line exists from the first window on), and the average cost of
/// the windows of each size (older ones weighing less). A window's cost is its size's average
/// shrunk towards the line, so a size never measured costs what the line says, and costs that
/// jump with n (a kernel reading the weights once for up to a few columns) are learnt.
public struct MeasuredStepCosts: StepCostModel, Equatable {
    /// A window of n nodes costs intercept + slope (n - 2) plain steps before measuring.
    public static let prior = (intercept: 1.1, slope: 0.1)
    public static let priorWeight = 0.25
    /// The weight of a window measured one verify step earlier.
    public static let memory = 0.95
    /// The weight of the previous average of plain steps.
    public static let plainMemory = 0.8
    /// The weight of a window of the same size measured one window of that size earlier.
    public static let sizeMemory = 0.9
    /// Pseudo-windows of the line's cost in each size's average.
    public static let sizeWeight = 0.5

    /// The moving average of plain steps' seconds; nil before the first.
    public private(set) var plainSeconds: Double?
    /// Weighted sums of 1, x, y, x², xy over the verify windows; x = n - 2, y = cost in plain steps.
    private var sums = [Double](repeating: 0, count: 5)
    /// By window size n: the weighted count of windows measured and the weighted sum of their costs.
    private var sizes: [Int: (count: Double, total: Double)] = [:]

    public init() {}

    public mutating func plain(seconds: Double) {
        plainSeconds = plainSeconds.map { Self.plainMemory * $0 + (1 - Self.plainMemory) * seconds } ?? seconds
    }

    /// Ignored until a plain step has been measured (the cost is in plain steps).
    public mutating func verify(nodes: Int, seconds: Double) {
        guard let plain = plainSeconds, plain != 0 else { return }
        let x = Double(nodes) - 2, y = seconds / plain
        sums = zip(sums, [1, x, y, x * x, x * y]).map { Self.memory * $0 + $1 }
        let (count, total) = sizes[nodes] ?? (0, 0)
        sizes[nodes] = (Self.sizeMemory * count + 1, Self.sizeMemory * total + y)
    }

    /// The fitted line: the cost of a 2-node window and the cost of each further node, in plain
    /// steps (the slope is never negative).
    public var line: (intercept: Double, slope: Double) {
        let (a, b) = Self.prior
        let pseudo = [0.0, 8.0].map { x in [1, x, a + b * x, x * x, x * (a + b * x)] }
        let prior = (0..<5).map { Self.priorWeight * (pseudo[0][$0] + pseudo[1][$0]) }
        let s = (0..<5).map { sums[$0] + prior[$0] }
        let (w, sx, sy, sxx, sxy) = (s[0], s[1], s[2], s[3], s[4])
        let slope = max(0, (w * sxy - sx * sy) / (w * sxx - sx * sx))
        return ((sy - slope * sx) / w, slope)
    }

    /// The average cost of the windows of `nodes` measured, with `sizeWeight` pseudo-windows of
    /// the line's cost.
    public func cost(nodes: Int) -> Double {
        let (intercept, slope) = line
        let (count, total) = sizes[nodes] ?? (0, 0)
        return (total + Self.sizeWeight * (intercept + slope * Double(nodes - 2))) / (count + Self.sizeWeight)
    }

    public static func == (a: MeasuredStepCosts, b: MeasuredStepCosts) -> Bool {
        a.plainSeconds == b.plainSeconds && a.sums == b.sums
            && a.sizes.count == b.sizes.count
            && a.sizes.allSatisfy { n, s in b.sizes[n].map { $0.count == s.count && $0.total == s.total } ?? false }
    }
}

/// Costs that do not depend on measurements: a window of n nodes costs intercept + slope (n - 2)
/// plain steps (tests, and machines whose costs are known).
public struct FixedStepCosts: StepCostModel, Equatable {
    public let intercept: Double
    public let slope: Double

    /// A 2-node window costs `intercept` > 0 plain steps and each further node `slope` >= 0.
    public init(intercept: Double, slope: Double) {
        precondition(intercept > 0 && slope >= 0, "a window costs more than nothing and no less with more nodes, got \(intercept) + \(slope) (n - 2)")
        self.intercept = intercept
        self.slope = slope
    }

    public mutating func plain(seconds: Double) {}
    public mutating func verify(nodes: Int, seconds: Double) {}
    public func cost(nodes: Int) -> Double { intercept + slope * Double(nodes - 2) }
}
