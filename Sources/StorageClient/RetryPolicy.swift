import Foundation

/// Jittered exponential backoff for idempotent requests (GCS retry strategy: 408, 429, 5xx,
/// resets and timeouts), inside a time budget.
///
/// `budget` bounds one operation with all its tries (docs/security.md, "Time bounds"): no
/// try starts, and no wait sleeps, past it; each try is given the time that is left as its
/// own deadline. A server's `Retry-After` is honoured within the budget. Waits end early when
/// the caller is cancelled (an interrupted reader).
public struct RetryPolicy: Sendable {
    public var attempts: Int
    public var firstDelay: Double
    public var maxDelay: Double
    /// Retry a refused connection too (off for the start-up check, where it means "wrong endpoint").
    public var retryUnreachable: Bool
    /// Seconds one operation may take, all tries and waits included (`request_timeout=`).
    public var budget: Double

    public init(attempts: Int = 5, firstDelay: Double = 0.1, maxDelay: Double = 4, retryUnreachable: Bool = true,
                budget: Double = 60) {
        self.attempts = attempts
        self.firstDelay = firstDelay
        self.maxDelay = maxDelay
        self.retryUnreachable = retryUnreachable
        self.budget = budget
    }

    /// One quick try: for start-up checks, where the user is waiting at the prompt.
    public static let startup = RetryPolicy(attempts: 2, firstDelay: 0.2, maxDelay: 0.5, retryUnreachable: false, budget: 30)

    /// The longest `Retry-After` waited for; a longer one fails the try at once.
    static let maxRetryAfter = 30.0

    func isRetryable(_ e: StorageError) -> Bool {
        switch e.code {
        case .retryLimitExceeded, .quotaExceeded: return true
        case .unreachable: return retryUnreachable
        case .notFound, .unauthenticated, .unauthorized, .generationChanged, .checksumMismatch,
             .cancelled, .invalidResponse, .invalidArgument, .tlsFailure:
            return false
        }
    }

    /// One try of an operation: when it must end (monotonic seconds, `monotonicNow()`), and
    /// which try it is (1 for the first; logs and metrics show it).
    public struct Try: Sendable {
        public let deadline: Double
        public let number: Int
    }

    /// Runs `body(try)` until it succeeds, fails for good, or attempts or budget run out.
    ///
    /// `answered` counts the store's answers that say it serves requests. When it moves while
    /// this operation fails, the bucket is up and this request is the unlucky one (a flaky
    /// server or path): it gets up to twice `attempts`, still inside the budget, and the error
    /// it may end with says so (`answeredOthers`: no outage is assumed from it). A lone
    /// operation against a bucket that answers nothing fails after `attempts` as before.
    /// (At 10% of requests failing, 5 tries all fail once in 100,000 operations; 10, once in
    /// 10^10.)
    public func run<T>(isCancelled: (@Sendable () -> Bool)? = nil, answered: AnswerCount? = nil,
                       _ body: (_ try: Try) throws(StorageError) -> T) throws(StorageError) -> T {
        let deadline = monotonicNow() + budget
        let answersBefore = answered?.value
        var delay = firstDelay
        var attempt = 1
        while true {
            do {
                return try body(Try(deadline: deadline, number: attempt))
            } catch {
                // The caller was interrupted meanwhile: whatever the try ended with (a timeout, a
                // reset as the transfer was cut), the operation ends as cancelled, which says
                // nothing about the bucket (no outage, docs/security.md, "Time bounds").
                if error.code != .cancelled, let isCancelled, isCancelled() {
                    throw StorageError(.cancelled, "interrupted: \(error.message)")
                }
                var error = error
                error.answeredOthers = answersBefore != nil && answered?.value != answersBefore
                let limit = error.answeredOthers ? 2 * attempts : attempts
                guard attempt < limit, isRetryable(error) else { throw error }
                var wait = delay * Double.random(in: 0.5...1.0)
                if let asked = error.retryAfter {
                    guard asked <= Self.maxRetryAfter else { throw error }
                    wait = max(wait, asked)
                }
                guard monotonicNow() + wait < deadline else { throw error }
                if !Self.sleep(wait, isCancelled: isCancelled) {
                    throw StorageError(.cancelled, "interrupted while waiting to retry: \(error.message)")
                }
                StorageTelemetry.onRetry?(error)
                delay = min(delay * 2, maxDelay)
                attempt += 1
            }
        }
    }

    /// Sleeps `seconds` in short slices; false as soon as `isCancelled` says so.
    static func sleep(_ seconds: Double, isCancelled: (@Sendable () -> Bool)?) -> Bool {
        let end = monotonicNow() + seconds
        while true {
            if let isCancelled, isCancelled() { return false }
            let left = end - monotonicNow()
            if left <= 0 { return true }
            usleep(UInt32(min(left, 0.05) * 1_000_000))
        }
    }
}

/// Seconds on the monotonic clock (deadlines; never the wall clock, which can jump).
public func monotonicNow() -> Double {
    var ts = timespec()
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return Double(ts.tv_sec) + Double(ts.tv_nsec) / 1e9
}
