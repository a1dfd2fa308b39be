import Foundation

/// Runs async jobs one after another, in the order they were submitted: a job starts once the one
/// before it has ended (returned, thrown, or stopped after being cancelled).
///
/// A `Generator` and a `Conversation` keep their cache and their turns this way, so that a new
/// generation never overlaps the last model call of one that was just cancelled.
final class SerialJobs: @unchecked Sendable {
    private let lock = NSLock()
    private var last: Task<Void, Never>?

    /// Runs `job` after every job submitted before it and returns its result; cancelling the caller
    /// cancels the job (which still starts only after the previous one has ended).
    func run<T: Sendable>(_ job: @escaping @Sendable () async throws -> T) async throws -> T {
        let task = enqueue(job)
        return try await withTaskCancellationHandler { try await task.value } onCancel: { task.cancel() }
    }

    /// Starts a task that waits for the last job, then runs `job`; it becomes the last job.
    private func enqueue<T: Sendable>(_ job: @escaping @Sendable () async throws -> T) -> Task<T, Error> {
        lock.lock(); defer { lock.unlock() }
        let previous = last
        let task = Task<T, Error> {
            await previous?.value
            return try await job()
        }
        last = Task { _ = await task.result }
        return task
    }
}
