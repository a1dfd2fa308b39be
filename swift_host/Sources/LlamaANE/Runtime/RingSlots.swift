/// Where the sliding layers' ring buffer (`cache.sliding`) keeps a position: position p in slot
/// p mod R, so the ring holds the last R positions whatever the context length.
public enum RingSlots {
    /// The ring slots of cache positions `positions` (a verify window's `slots`), -1 (a token
    /// dropped: a rejected draft, padding) staying -1; all -1 without a ring (`ring` 0).
    public static func of(_ positions: [Int32], ring: Int) -> [Int32] {
        positions.map { $0 >= 0 && ring > 0 ? $0 % Int32(ring) : -1 }
    }
}
