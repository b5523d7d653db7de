import StorageClient
import Synchronization

/// Whether the bucket answers, as the last operation that needed it found out.
///
/// A server that accepts and never answers costs `request_timeout` per operation, and one
/// `cat` of a path makes several in a row (a lookup per component, an attribute refresh, the
/// kernel's readahead and then its own read of the same page). Once an operation has failed
/// for good with an outage (unreachable, or failing after every retry), for `holdSeconds`:
/// what storefs knows (attributes, listings, cached blocks) answers at once without asking,
/// and what it does not know fails at once with that error. The first operation after that
/// asks the bucket again; any success ends the outage. An operation that failed while the
/// bucket answered others (`StorageError.answeredOthers`) is no outage: one unlucky request
/// of a flaky server must not fail every read that starts in the next seconds.
/// docs/security.md, "Time bounds".
public final class BucketHealth: Sendable {
    /// How long an outage is assumed once found (0: never; every operation asks).
    public let holdSeconds: Double

    private struct State: ~Copyable {
        var until = 0.0
        var error: StorageError?
    }

    private let state = Mutex(State())
    /// Whether an outage was noted: every read and download looks, so the common answer
    /// ("no") takes no lock.
    private let noted = Atomic<Bool>(false)

    public init(holdSeconds: Double = 5) { self.holdSeconds = holdSeconds }

    /// The error of the outage in force, or nil when the bucket is to be asked.
    public var outage: StorageError? {
        guard noted.load(ordering: .acquiring) else { return nil }
        return state.withLock { s in s.until > now() ? s.error : nil }
    }

    /// Records what an operation that asked the bucket found.
    func note(_ error: StorageError) {
        guard Filesystem.isOutage(error.code), !error.answeredOthers, holdSeconds > 0 else { return }
        let started = state.withLock { s -> Bool in
            let was = s.until > now()
            s.until = now() + holdSeconds
            s.error = error
            return !was
        }
        noted.store(true, ordering: .releasing)
        if started {
            Log.warn("the bucket does not answer (\(error.message)): known names, attributes, listings and cached bytes are served without asking, the rest fails at once, for \(Int(holdSeconds)) s at a time")
        }
    }

    func noteSuccess() {
        guard noted.load(ordering: .acquiring) else { return }
        noted.store(false, ordering: .releasing)
        let ended = state.withLock { s -> Bool in
            defer { s.until = 0; s.error = nil }
            return s.error != nil
        }
        if ended { Log.info("the bucket answers again") }
    }
}
