/// A state the host carries beside the K/V caches for layers that keep none (docs/manifest.md):
/// the conv layers' (`cache.conv`: LFM2's, and Qwen3.5's linear-attention layers') and the
/// linear-attention layers' recurrent state (`cache.delta`, Qwen3.5). Each has the same roles: the
/// chunk's state, what the chunk returns to move it on, and the cascade branches' own states.
public enum CarriedState: String, CaseIterable, Sendable {
    case conv
    case delta

    /// The chunk's state (conv_state, delta_state): an input the host moves on, or a Core ML state.
    var stateName: String { self == .conv ? TensorNames.convState : TensorNames.deltaState }
    /// What the chunk returns for the host (conv_new: a window's values; delta_new: the state after it).
    var newName: String { self == .conv ? TensorNames.convNew : TensorNames.deltaNew }
    /// The cascade branches' own states (conv_branches, delta_branches).
    var branchesName: String { self == .conv ? TensorNames.convBranches : TensorNames.deltaBranches }

    /// How the state moves on after a window of `n` real tokens: a conv state by the window's first
    /// n values; a recurrent state becomes the one the chunk returns (padding has not moved it).
    func afterWindow(realTokens n: Int) -> StateCarry.Operation { self == .conv ? .afterWindow(realTokens: n) : .replace }
    /// How the branches' states move on after a cascade step: a conv state by each branch's value, a
    /// recurrent state becomes the ones the chunk returns.
    var afterBranchStep: StateCarry.Operation { self == .conv ? .afterBranchStep : .replace }
    /// How the branches get the prefix's state: a conv state along its branch axis (L, C, B, W), a
    /// recurrent state as layer-major rows (L*B, C, 1, W).
    var copyToBranches: StateCarry.Operation { self == .conv ? .copyToBranches : .copyToBranchRows }
}

/// How the host moves a carried state on (`CarriedState`), as docs/manifest.md defines it: a conv
/// layer's state is its last `width` values per channel, right-aligned; a recurrent state is taken
/// whole from the chunk. The tensors are 4-D storage with any strides (an IOSurface-backed array
/// pads its rows): element (l, c, x, j) lies at `l * strides[0] + c * strides[1] + x * strides[2] +
/// j * strides[3]`. Only values are copied, so the element type is the storage's own (fp16 bits or
/// Float).
public enum StateCarry {
    /// A 4-D tensor's storage: its first element, shape and strides (in elements).
    public typealias Tensor<T> = StridedTensor<T>

    /// One move of a state: `apply(_:to:from:)` runs it on a target and a source tensor.
    public enum Operation: Equatable, Sendable {
        /// The target conv state moves on by the source's window values (`afterWindow`).
        case afterWindow(realTokens: Int)
        /// The target conv branches move on by the source's one value each (`afterBranchStep`).
        case afterBranchStep
        /// The target conv branches each get a copy of the source state (`copyToBranches`).
        case copyToBranches
        /// The target becomes the source, of the same shape (`replace`): a recurrent state after a
        /// window, or the branches' after a step.
        case replace
        /// The target's rows l*B..<(l+1)*B each get a copy of the source's row l (`copyToBranchRows`).
        case copyToBranchRows
    }

    /// Runs `operation` on `target`, reading `source`.
    public static func apply<T>(_ operation: Operation, to target: Tensor<T>, from source: Tensor<T>) throws {
        switch operation {
        case let .afterWindow(n): try afterWindow(target, new: source, realTokens: n)
        case .afterBranchStep: try afterBranchStep(target, new: source)
        case .copyToBranches: try copyToBranches(source, into: target)
        case .replace: try replace(target, with: source)
        case .copyToBranchRows: try copyToBranchRows(source, into: target)
        }
    }

    /// `state` becomes `new`, element by element (the two of one shape).
    public static func replace<T>(_ state: Tensor<T>, with new: Tensor<T>) throws {
        guard state.shape.count == 4, state.strides.count == 4, new.strides.count == 4, new.shape == state.shape else {
            throw ManifestError.inconsistent("a state of shape \(new.shape) cannot replace one of shape \(state.shape)")
        }
        copyRows(state, from: new) { ($0, $1) }
    }

    /// Each row l*B + b of `branches` (L*B, C, X, W) gets a copy of row l of `state` (L, C, X, W):
    /// every branch starts from the prefix's state, layer-major as the cascade reads it.
    public static func copyToBranchRows<T>(_ state: Tensor<T>, into branches: Tensor<T>) throws {
        guard state.shape.count == 4, branches.shape.count == 4, state.strides.count == 4, branches.strides.count == 4,
              state.shape[0] > 0, branches.shape[0] % state.shape[0] == 0, state.shape[1...] == branches.shape[1...] else {
            throw ManifestError.inconsistent("delta_branches of shape \(branches.shape) cannot hold copies of a delta_state of "
                + "shape \(state.shape) per branch")
        }
        let width = branches.shape[0] / state.shape[0]
        copyRows(branches, from: state) { ($0 / width, $1) }
    }

    /// `target[r, c, x, j] = source[r', c, x', j]` for every element of `target`, (r', x') being
    /// `sourceRow(r, x)`.
    private static func copyRows<T>(_ target: Tensor<T>, from source: Tensor<T>, sourceRow: (Int, Int) -> (Int, Int)) {
        for r in 0..<target.shape[0] {
            for c in 0..<target.shape[1] {
                for x in 0..<target.shape[2] {
                    let (sr, sx) = sourceRow(r, x)
                    let (to, from) = (target.at(r, c, x, 0), source.at(sr, c, sx, 0))
                    for j in 0..<target.shape[3] { to[j * target.strides[3]] = from[j * source.strides[3]] }
                }
            }
        }
    }

    /// `state` (L, C, 1, W) becomes the last W values of [state, the window's first n values]:
    /// `new` (L, C, 1, S) holds the window's values, of which the first `n` are real tokens (a
    /// padded window's padding is not part of the state).
    public static func afterWindow<T>(_ state: Tensor<T>, new: Tensor<T>, realTokens n: Int) throws {
        try check(state, new, columns: n, of: "conv_new", against: "conv_state")
        guard n >= 1 else { throw ManifestError.inconsistent("a window of \(n) real tokens carries no conv state") }
        for l in 0..<state.shape[0] {
            for c in 0..<state.shape[1] {
                shift(state.at(l, c, 0, 0), stride: state.strides[3], width: state.shape[3], by: n,
                      from: new.at(l, c, 0, 0), stride: new.strides[3])
            }
        }
    }

    /// Each branch b of `branches` (L, C, B, W) moves on by one value, its own: `new[l, c, 0, b]`
    /// (`new` (L, C, 1, B), a cascade step's conv_new).
    public static func afterBranchStep<T>(_ branches: Tensor<T>, new: Tensor<T>) throws {
        try check(branches, new, columns: branches.shape[2], of: "conv_new", against: "conv_branches")
        for l in 0..<branches.shape[0] {
            for c in 0..<branches.shape[1] {
                for b in 0..<branches.shape[2] {
                    shift(branches.at(l, c, b, 0), stride: branches.strides[3], width: branches.shape[3], by: 1,
                          from: new.at(l, c, 0, b), stride: 0)
                }
            }
        }
    }

    /// Every branch of `branches` (L, C, B, W) gets a copy of the prefix's `state` (L, C, 1, W).
    public static func copyToBranches<T>(_ state: Tensor<T>, into branches: Tensor<T>) throws {
        guard state.shape.count == 4, branches.shape.count == 4, state.shape[2] == 1,
              [state.shape[0], state.shape[1], state.shape[3]] == [branches.shape[0], branches.shape[1], branches.shape[3]] else {
            throw ManifestError.inconsistent("conv_branches of shape \(branches.shape) cannot hold copies of a conv_state of "
                + "shape \(state.shape)")
        }
        copyRows(branches, from: state) { l, _ in (l, 0) }
    }

    /// `new` holds the layers and channels of `state`, one row of values per layer and channel, and
    /// at least `columns` of them.
    private static func check<T>(_ state: Tensor<T>, _ new: Tensor<T>, columns: Int, of name: String,
                                 against stateName: String) throws {
        guard state.shape.count == 4, new.shape.count == 4, state.strides.count == 4, new.strides.count == 4,
              new.shape[0] == state.shape[0], new.shape[1] == state.shape[1], new.shape[2] == 1, columns <= new.shape[3] else {
            throw ManifestError.inconsistent("\(name) of shape \(new.shape) does not give \(columns) values for each row of "
                + "\(stateName) of shape \(state.shape)")
        }
    }

    /// `row[j] = [row, values][j + n]` for j in 0..<width, ascending: each read lies at or past the
    /// element written, so the row moves on in place.
    private static func shift<T>(_ row: UnsafeMutablePointer<T>, stride: Int, width: Int, by n: Int,
                                 from values: UnsafeMutablePointer<T>, stride valueStride: Int) {
        for j in 0..<width {
            let k = j + n
            row[j * stride] = k < width ? row[k * stride] : values[(k - width) * valueStride]
        }
    }
}
