import Foundation

/// Jittered exponential backoff for idempotent requests (GCS retry strategy: 408, 429, 5xx,
/// resets and timeouts). The budget bounds how long a caller can wait before an error surfaces.
public struct RetryPolicy: Sendable {
    public var attempts: Int
    public var firstDelay: Double
    public var maxDelay: Double
    /// Retry a refused connection too (off for the start-up check, where it means "wrong endpoint").
    public var retryUnreachable: Bool

    public init(attempts: Int = 5, firstDelay: Double = 0.1, maxDelay: Double = 4, retryUnreachable: Bool = true) {
        self.attempts = attempts
        self.firstDelay = firstDelay
        self.maxDelay = maxDelay
        self.retryUnreachable = retryUnreachable
    }

    /// One quick try: for start-up checks, where the user is waiting at the prompt.
    public static let startup = RetryPolicy(attempts: 2, firstDelay: 0.2, maxDelay: 0.5, retryUnreachable: false)

    func isRetryable(_ e: StorageError) -> Bool {
        switch e.code {
        case .retryLimitExceeded, .quotaExceeded: return true
        case .unreachable: return retryUnreachable
        case .notFound, .unauthenticated, .unauthorized, .generationChanged, .checksumMismatch,
             .cancelled, .invalidResponse, .invalidArgument:
            return false
        }
    }

    /// Runs `body` until it succeeds, fails for good, or the attempts are used up.
    public func run<T>(_ body: () throws(StorageError) -> T) throws(StorageError) -> T {
        var delay = firstDelay
        var attempt = 1
        while true {
            do {
                return try body()
            } catch {
                guard attempt < attempts, isRetryable(error) else { throw error }
                let jittered = delay * Double.random(in: 0.5...1.0)
                usleep(UInt32(jittered * 1_000_000))
                delay = min(delay * 2, maxDelay)
                attempt += 1
            }
        }
    }
}
