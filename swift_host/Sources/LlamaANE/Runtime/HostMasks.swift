/// One mask the host makes for a window (`HostMasks`): `rows` queries (the window's rows) over
/// `columns` keys (the cache columns the function reads, then the window's own rows), additive where
/// a function reads it: 0 where a row sees a column, `HostMasks.maskValue` where not.
public struct HostMask: Equatable, Sendable {
    public let rows: Int
    public let columns: Int
    /// Row-major: whether row r sees column c, at `r * columns + c`.
    public let visible: [Bool]

    public init(rows: Int, columns: Int, visible: [Bool]) {
        precondition(visible.count == rows * columns, "a mask of \(rows) x \(columns) needs \(rows * columns) values")
        self.rows = rows
        self.columns = columns
        self.visible = visible
    }

    /// Whether row `row` sees column `column`.
    public func sees(row: Int, column: Int) -> Bool { visible[row * columns + column] }

    /// The tensor's shape: (1, 1, rows, columns).
    public var shape: [Int] { [1, 1, rows, columns] }

    /// The additive values, row-major: 0 where a row sees a column, `HostMasks.maskValue` where not.
    public var additive: [Float] { visible.map { $0 ? 0 : HostMasks.maskValue } }

    /// Row `row` as one character per column, "1" where it sees the column (as tests/swift_fixtures.py
    /// records the masks Python's host made).
    public func row(_ row: Int) -> String {
        String(visible[row * columns ..< (row + 1) * columns].map { $0 ? "1" : "0" })
    }
}

/// The attention masks of an export whose prefill window decodes (`Manifest.prefillDecodes`,
/// format_version 4): its embeddings output none, so the host makes the masks its chunks read,
/// exactly as Python's `llama_ane/runtime/masks.py` (`HostMasks`) does.
///
/// A window of S rows reads T cache columns (its function's context bucket), then its own S columns:
/// "mask" (1, 1, S, T + S), and where the sliding window is shorter than the context its twin
/// "sliding_mask", which also hides the keys `sliding_window` or more positions before each row
/// (over the ring's R slots where the sliding layers keep one: (1, 1, S, R + S)).
///
/// Two layouts of the cache:
/// * a sequence (`windowMasks`): column j holds position j, the first `position` are written; the
///   window's rows sit at position, position + 1, ... and see the written columns and the rows
///   before them (a ring's slot j holds `heldPositions(position, ring)[j]`);
/// * a cascade step through the window (`branchMasks`): the shared prefix in its first P columns,
///   then each step's G branch tokens side by side (step i's token of branch slot b in column
///   P + i*G + b); row b sees the prefix, its own branch's tokens and itself, nothing of the other
///   branches; the rows from G on (padding) see only themselves.
public struct HostMasks: Equatable, Sendable {
    /// The additive value of a hidden key (Python's `MASK_VALUE`): large but finite, since -inf turns
    /// a fully masked fp16 row into NaN.
    public static let maskValue: Float = -1.0e4

    /// The sliding layers' window where the export needs their own masks (the window shorter than
    /// the context), nil where it does not: then there is no "sliding_mask".
    public let slidingWindow: Int?
    /// The sliding layers' ring slots (`cache.sliding.length`), 0 where there is no ring.
    public let ring: Int

    public init(slidingWindow: Int?, ring: Int) {
        self.slidingWindow = slidingWindow
        self.ring = ring
    }

    /// The masks of `manifest`'s windows: a sliding window where the config's is shorter than the
    /// context and some layers slide (Python's `LlamaConfig.windowed`), over its ring where it has one.
    public init(manifest: Manifest) {
        let config = manifest.config
        let windowed = !config.slidingLayers.isEmpty && (config.slidingWindow ?? Int.max) < manifest.contextLength
        self.init(slidingWindow: windowed ? config.slidingWindow : nil, ring: manifest.cache.ringLength)
    }

    /// The position each of `ring` slots holds with `position` tokens written (slot p mod R holds the
    /// latest such p below `position`), negative where the slot was never written.
    public static func heldPositions(_ position: Int, ring: Int) -> [Int] {
        (0..<ring).map { slot in position - 1 - (position + ring - 1 - slot) % ring }
    }

    /// {"mask"[, "sliding_mask"]} of a sequence window of `s` rows at `position` over `t` cache columns.
    public func windowMasks(position: Int, rows s: Int, cacheColumns t: Int) -> [String: HostMask] {
        var out = [TensorNames.mask: Self.joined(rows: s, cache: t) { _, c in c < position } window: { r, k in k <= r }]
        if let window = slidingWindow {
            let held = ring > 0 ? Self.heldPositions(position, ring: ring) : (0..<t).map { $0 < position ? $0 : -1 }
            out[TensorNames.slidingMask] = Self.joined(rows: s, cache: held.count) { r, c in
                held[c] >= 0 && position + r - held[c] < window
            } window: { r, k in k <= r && r - k < window }
        }
        return out
    }

    /// {"mask"[, "sliding_mask"]} of a cascade step through the window: rows 0..<`width` the group's
    /// branches (G = `width`), each at position prefix + seen[b] and seeing its own tokens, those of
    /// the last seen[b] of the `steps` steps written so far (a branch that took its slot after the
    /// group began has written only the last ones); the rows from G on see only themselves. `s` rows
    /// over `t` cache columns. There is no ring: the cascade runs in the window only where the cache
    /// is one (`Manifest.windowCascade`).
    public func branchMasks(prefix: Int, width: Int, seen: [Int], steps: Int, rows s: Int,
                            cacheColumns t: Int) -> [String: HostMask] {
        precondition(width > 0 && width <= s && seen.count == width, "a step of \(width) branches in \(s) rows, \(seen.count) seen")
        // the branch each column belongs to and the step that wrote it
        let lane = (0..<t).map { $0 >= prefix ? ($0 - prefix) % width : -1 }
        let step = (0..<t).map { $0 >= prefix ? ($0 - prefix) / width : -1 }
        let seenRows = (0..<s).map { $0 < width ? min(seen[$0], steps) : 0 }
        func keep(_ r: Int, _ c: Int) -> Bool {
            r < width && (c < prefix || (lane[c] == r && step[c] >= steps - seenRows[r] && step[c] < steps))
        }
        var out = [TensorNames.mask: Self.joined(rows: s, cache: t, keep) { r, k in r == k }]
        if let window = slidingWindow {
            // each column's position as row r sees it: its branch's tokens count from the step it began
            func held(_ r: Int, _ c: Int) -> Int { c < prefix ? c : prefix + step[c] - (steps - seenRows[r]) }
            out[TensorNames.slidingMask] = Self.joined(rows: s, cache: t) { r, c in
                keep(r, c) && prefix + seenRows[r] - held(r, c) < window
            } window: { r, k in r == k }
        }
        return out
    }

    /// A mask of `rows` rows over `cache` cache columns (`cacheVisible(row, column)`) then the window's
    /// own rows (`windowVisible(row, key row)`).
    private static func joined(rows: Int, cache: Int, _ cacheVisible: (Int, Int) -> Bool,
                               window windowVisible: (Int, Int) -> Bool) -> HostMask {
        var visible: [Bool] = []
        visible.reserveCapacity(rows * (cache + rows))
        for r in 0..<rows {
            for c in 0..<cache { visible.append(cacheVisible(r, c)) }
            for k in 0..<rows { visible.append(windowVisible(r, k)) }
        }
        return HostMask(rows: rows, columns: cache + rows, visible: visible)
    }
}

/// One window of an export whose prefill window decodes (`Manifest.prefillDecodes`), as the host
/// feeds it: the embeddings' `input_ids` and each row's `positions`, the masks the chunks read
/// (`HostMasks`), and with state caches the `position` the chunks write the window's K/V at (with
/// input caches the cache update writes them there).
public struct HostWindow: Equatable, Sendable {
    /// input_ids (S): the window's tokens, padded with 0.
    public var tokens: [Int32]
    /// positions (S): each row's position (RoPE).
    public var positions: [Int32]
    /// The first cache column the window's K/V are written to.
    public var position: Int
    /// The real rows: the tokens of a sequence window, or the branches of a cascade step.
    public var count: Int
    /// The masks by name ("mask", "sliding_mask").
    public var masks: [String: HostMask]

    public init(tokens: [Int32], positions: [Int32], position: Int, count: Int, masks: [String: HostMask]) {
        self.tokens = tokens
        self.positions = positions
        self.position = position
        self.count = count
        self.masks = masks
    }

    /// A sequence window: `window`'s tokens padded to `prefillLength` (a decode window of one token
    /// runs as such a window), rows at window.position, window.position + 1, ..., written there,
    /// with the masks over `bucket` cache columns.
    public static func sequence(_ window: TokenWindow, prefillLength: Int, bucket: Int, masks: HostMasks) -> HostWindow {
        let s = max(prefillLength, window.tokens.count)
        let tokens = window.tokens + Array(repeating: 0, count: s - window.tokens.count)
        return HostWindow(tokens: tokens, positions: (0..<s).map { Int32(window.position + $0) }, position: window.position,
                          count: window.count, masks: masks.windowMasks(position: window.position, rows: s, cacheColumns: bucket))
    }

    /// A cascade step through the window: the group's G = `tokens.count` branches as its first rows,
    /// branch b at position prefix + seen[b] after `steps` steps of the group, written side by side
    /// from column prefix + steps * G; the padding rows at position `prefix`, as Python's host puts them.
    public static func branches(tokens: [Int32], seen: [Int], steps: Int, prefix: Int, prefillLength: Int, bucket: Int,
                                masks: HostMasks) -> HostWindow {
        let g = tokens.count
        precondition(g > 0 && g <= prefillLength && seen.count == g, "\(g) branches in a window of \(prefillLength)")
        return HostWindow(tokens: tokens + Array(repeating: 0, count: prefillLength - g),
                          positions: (0..<prefillLength).map { Int32(prefix + ($0 < g ? seen[$0] : 0)) },
                          position: branchBase(prefix: prefix, group: g, steps: steps), count: g,
                          masks: masks.branchMasks(prefix: prefix, width: g, seen: seen, steps: steps, rows: prefillLength,
                                                   cacheColumns: bucket))
    }

    /// Where a cascade step of a group of `group` branches writes its K/V after `steps` steps: the
    /// columns from prefix + steps * group on.
    public static func branchBase(prefix: Int, group: Int, steps: Int) -> Int { prefix + steps * group }
}
