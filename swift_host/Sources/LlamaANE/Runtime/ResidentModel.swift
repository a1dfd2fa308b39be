/// Resident memory of a set of loaded functions: what a runtime keeps wired for them, modelled
/// from published measurements on other machines, not measured here. Python's `Runtime`,
/// `RUNTIMES` and `resident()` (`contract/resident.py`), with the same figures and arithmetic.
///
/// * Core ML (`.mlpackage`, multifunction or not): each function loaded for the Neural Engine was
///   measured to wire its own copy of its package's weights, even within one multifunction package
///   (Anemll Forge, FEEDBACK_ANE_MULTIFUNCTION_MEMORY.md, measured on an M6 with macOS 27: four
///   functions over a 537 MB program wired +0.54, +1.00, +1.55 and +1.75 GB as each loaded). So the
///   modelled first function of a package wires 1.0-1.9x its weights, and each further one
///   0.37-1.02x.
/// * Core AI (`.aimodel`): its entry points share one copy (the same source: 0.93x its weights).
///
/// Functions are counted per package file (a single-function package is its own copy). `bytes`
/// takes the middle of each range, `lowBytes` and `highBytes` its ends; `weightCopyBytes` is one
/// modelled copy of every package's weights (each package's first function, mid), so
/// `bytes / weightCopyBytes` counts the copies the loaded functions hold.
public struct ResidentModel: Equatable, Sendable {
    /// Which end of the measured ranges to take: their low end, their middle or their high end.
    public enum Estimate: Sendable, CaseIterable { case low, mid, high }

    /// A measured range of multiples of a package's weights.
    public struct Multiple: Equatable, Sendable {
        public let low: Double
        public let high: Double

        public init(_ low: Double, _ high: Double) {
            self.low = low
            self.high = high
        }

        public func pick(_ estimate: Estimate) -> Double {
            switch estimate {
            case .low: return low
            case .mid: return (low + high) / 2
            case .high: return high
            }
        }
    }

    /// How a runtime wires a package's weights for the functions it loads: the first function's
    /// copy and each further function's, as multiples of the package's weight bytes.
    public struct Runtime: Equatable, Sendable {
        public let name: String
        public let first: Multiple
        public let further: Multiple
        /// Where the figures come from.
        public let source: String

        /// Multiples of a package's weights wired with `functions` of its functions loaded (modelled).
        public func factor(_ functions: Int, _ estimate: Estimate = .mid) -> Double {
            guard functions > 0 else { return 0 }
            return first.pick(estimate) + Double(functions - 1) * further.pick(estimate)
        }

        /// Core ML: the first function of a package 1.0-1.9x its weights, each further one 0.37-1.02x.
        public static let coreML = Runtime(name: "Core ML", first: Multiple(1.0, 1.9), further: Multiple(0.37, 1.02),
                                           source: ResidentModel.forge)
        /// Core AI: one copy for all of a package's entry points, 0.93x its weights.
        public static let coreAI = Runtime(name: "Core AI", first: Multiple(0.93, 0.93), further: Multiple(0, 0),
                                           source: ResidentModel.forge)
    }

    /// One package's share: the functions of it held (their names in the package, sorted), its
    /// weight bytes and what it wires (modelled, mid).
    public struct Package: Equatable, Sendable {
        public let functions: [String]
        public let weightBytes: Int
        public let residentBytes: Int
    }

    /// The source of the figures.
    public static let forge = "Anemll Forge, FEEDBACK_ANE_MULTIFUNCTION_MEMORY.md (Anemll/anemll-forge, Sept 2026), "
        + "measured on an M6 with macOS 27"
    /// What the figures are.
    public static let modelled = "modelled from published measurements on other machines (Core ML: each function loaded "
        + "for the Neural Engine wires its own copy of its package's weights; Core AI: entry points share one), "
        + "not measured here"

    /// The runtime an export's packages load in: Core AI for a `--target coreai` export (its
    /// `deployment_target`), else Core ML.
    public static func runtime(of manifest: Manifest) -> Runtime {
        manifest.deploymentTarget == "coreai" ? .coreAI : .coreML
    }

    public let runtime: Runtime
    /// Modelled resident bytes (the middle of each range).
    public let bytes: Int
    /// The same at the low and the high ends of the ranges.
    public let lowBytes: Int
    public let highBytes: Int
    /// One modelled copy of the weights of every package held (each package's first function, mid).
    public let weightCopyBytes: Int
    /// The functions held.
    public let functions: Int
    /// By package file, what it wires.
    public let packages: [String: Package]

    /// What holding `loaded` keeps wired on `runtime`, modelled.
    public init(runtime: Runtime, holding loaded: [PlannedFunction]) {
        var order: [String] = []
        var byFile: [String: (weights: Int, names: Set<String>)] = [:]
        for f in loaded {
            if byFile[f.file] == nil {
                order.append(f.file)
                byFile[f.file] = (f.weightBytes, [])
            }
            byFile[f.file]?.names.insert(f.functionName)
        }
        var total: [Estimate: Double] = [.low: 0, .mid: 0, .high: 0]
        var copy = 0.0
        var packages: [String: Package] = [:]
        for file in order {
            guard let (weights, names) = byFile[file] else { continue }
            for estimate in Estimate.allCases {
                total[estimate, default: 0] += Double(weights) * runtime.factor(names.count, estimate)
            }
            copy += Double(weights) * runtime.factor(1)
            packages[file] = Package(functions: names.sorted(), weightBytes: weights,
                                     residentBytes: Self.round(Double(weights) * runtime.factor(names.count)))
        }
        self.runtime = runtime
        bytes = Self.round(total[.mid] ?? 0)
        lowBytes = Self.round(total[.low] ?? 0)
        highBytes = Self.round(total[.high] ?? 0)
        weightCopyBytes = Self.round(copy)
        functions = loaded.count
        self.packages = packages
    }

    /// What holding `loaded` keeps wired on `manifest`'s runtime, modelled.
    public init(manifest: Manifest, holding loaded: [PlannedFunction]) {
        self.init(runtime: Self.runtime(of: manifest), holding: loaded)
    }

    /// Resident bytes over one copy of the weights.
    public var copies: Double { weightCopyBytes > 0 ? Double(bytes) / Double(weightCopyBytes) : 0 }

    /// Python's `round`: to the nearest integer, halves to even.
    private static func round(_ value: Double) -> Int { Int(value.rounded(.toNearestOrEven)) }
}
