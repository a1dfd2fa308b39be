/// How the host moves the conv layers' state (`cache.conv`, LFM2) on, as docs/manifest.md defines
/// it: each layer's state is its last `width` values per channel, right-aligned. The tensors are
/// 4-D storage with any strides (an IOSurface-backed array pads its rows): element (l, c, x, j)
/// lies at `l * strides[0] + c * strides[1] + x * strides[2] + j * strides[3]`. Only values are
/// copied, so the element type is the storage's own (fp16 bits or Float).
public enum ConvStateCarry {
    /// A 4-D tensor's storage: its first element, shape and strides (in elements).
    public typealias Tensor<T> = StridedTensor<T>

    /// One move of a conv state: `apply(_:to:from:)` runs it on a target and a source tensor.
    public enum Operation: Equatable, Sendable {
        /// The target state moves on by the source's window values (`afterWindow`).
        case afterWindow(realTokens: Int)
        /// The target branches move on by the source's one value each (`afterBranchStep`).
        case afterBranchStep
        /// The target branches each get a copy of the source state (`copyToBranches`).
        case copyToBranches
    }

    /// Runs `operation` on `target`, reading `source`.
    public static func apply<T>(_ operation: Operation, to target: Tensor<T>, from source: Tensor<T>) throws {
        switch operation {
        case let .afterWindow(n): try afterWindow(target, new: source, realTokens: n)
        case .afterBranchStep: try afterBranchStep(target, new: source)
        case .copyToBranches: try copyToBranches(source, into: target)
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
        for l in 0..<state.shape[0] {
            for c in 0..<state.shape[1] {
                for b in 0..<branches.shape[2] {
                    for j in 0..<state.shape[3] { branches.at(l, c, b, j).pointee = state.at(l, c, 0, j).pointee }
                }
            }
        }
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
