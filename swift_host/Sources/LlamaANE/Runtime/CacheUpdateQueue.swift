/// Runs each chunk's cache update in the background, as the Python runtime does, and makes sure a
/// chunk's update has finished before that chunk runs again (it reads the cache the update writes).
///
/// Updates of different chunks overlap with each other and with the next chunks' compute.
public actor CacheUpdateQueue {
    private var pending: [Int: Task<Void, Error>] = [:]

    public init() {}

    /// Starts the update of chunk `index` after any earlier update of the same chunk.
    public func submit(_ index: Int, _ work: @escaping @Sendable () async throws -> Void) {
        let previous = pending[index]
        pending[index] = Task {
            try await previous?.value
            try await work()
        }
    }

    /// Waits for the pending update of chunk `index`, rethrowing its error.
    public func wait(_ index: Int) async throws {
        guard let task = pending[index] else { return }
        let result = await task.result
        if pending[index] == task { pending[index] = nil }
        try result.get()
    }

    /// Waits for every pending update.
    public func waitAll() async throws {
        for index in pending.keys.sorted() { try await wait(index) }
    }
}
