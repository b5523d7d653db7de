import StorageClient
import Synchronization
import Locking

/// Whether the bucket answers, as the last operation that needed it found out.
///
/// A server that accepts and never answers costs `request_timeout` per operation, and one
/// `cat` of a path makes several in a row (a lookup per component, an attribute refresh, the
/// kernel's readahead and then its own read of the same page). Once an operation has failed
/// for good with an outage (unreachable, or failing after every retry), an outage is assumed
/// for `holdSeconds` after the last such failure: what storefs knows (attributes, listings,
/// cached blocks) answers at once without asking, and of the operations that need the bucket
/// one at a time still asks (half-open: `admit` hands out one `Probe`), the others failing
/// at once with the outage's error. The first success ends the outage, so an operation
/// issued once the server is back asks it (at worst after the one probe under way). An
/// operation that failed while the bucket answered others (`StorageError.answeredOthers`) is
/// no outage: one unlucky request of a flaky server must not fail every read that starts in
/// the next seconds; neither is a cancelled one (an interrupted caller, an unmount): it says
/// nothing about the bucket. docs/security.md, "Time bounds".
public final class BucketHealth: Sendable {
    /// How long an outage is assumed once found (0: never; every operation asks).
    public let holdSeconds: Double

    private struct State: ~Copyable {
        var until = 0.0
        var error: StorageError?
        /// A probe is out (`admit`): the one operation asking during the outage.
        var probing = false
    }

    /// A leaf lock: nothing else is taken under it, and no I/O.
    private let state = OrderedMutex(.bucketHealth, State())
    /// Whether an outage was noted: every read and download looks, so the common answer
    /// ("no") takes no lock.
    private let noted = Atomic<Bool>(false)

    public init(holdSeconds: Double = 5) { self.holdSeconds = holdSeconds }

    /// The error of the outage assumed now, or nil when none is.
    public var outage: StorageError? {
        guard noted.load(ordering: .acquiring) else { return nil }
        return state.withLock { s in s.until > now() ? s.error : nil }
    }

    /// The one operation asking the bucket during an outage. Ended by `end()` once the
    /// operation has noted what it found (or, at the latest, when it is let go), so the next
    /// operation may ask.
    final class Probe: Sendable {
        private let health: BucketHealth
        private let ended = Atomic<Bool>(false)

        init(_ health: BucketHealth) { self.health = health }

        func end() {
            guard !ended.exchange(true, ordering: .acquiringAndReleasing) else { return }
            health.state.withLock { $0.probing = false }
        }

        deinit { end() }
    }

    /// Whether an operation that needs the bucket may ask it now: nil when no outage is
    /// assumed (ask); a `Probe` when one is and no other operation is asking (ask, then
    /// `end` it); throws the outage's error when another operation is asking already.
    func admit() throws(StorageError) -> Probe? {
        guard noted.load(ordering: .acquiring) else { return nil }
        let refused = state.withLock { s -> StorageError?? in
            guard s.until > now(), let error = s.error else { return .some(nil) }
            if s.probing { return .some(error) }
            s.probing = true
            return .none
        }
        switch refused {
        case .some(nil): return nil
        case .some(let error?): throw error
        case .none: return Probe(self)
        }
    }

    /// What `admit` would say, without taking the probe: the outage's error when an operation
    /// could not ask now. For threads that never wait on the network (FUSE's): they fail at
    /// once rather than hand the operation to a worker that would fail too.
    var refusal: StorageError? {
        guard noted.load(ordering: .acquiring) else { return nil }
        return state.withLock { s in s.until > now() && s.probing ? s.error : nil }
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
            Log.warn("the bucket does not answer (\(error.message)): known names, attributes, listings and cached bytes are served without asking, one operation at a time asks, the rest fails at once, until one succeeds or \(Int(holdSeconds)) s pass without a failure")
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
