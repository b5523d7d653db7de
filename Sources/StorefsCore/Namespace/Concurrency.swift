import Locking
import Foundation
import Glibc
import StorageClient

func now() -> Double {
    var ts = timespec()
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return Double(ts.tv_sec) + Double(ts.tv_nsec) / 1e9
}

/// Whether a metadata operation may ask the bucket. FUSE threads pass `.never` first, so
/// that anything the daemon already knows is answered without a thread hop and no FUSE thread
/// ever waits on the network; what needs the bucket throws `.wouldBlock` and is asked again
/// from a metadata worker with `.allowed(isCancelled:)` (the FUSE request's interrupt flag).
public enum Network: Sendable {
    case never
    case allowed(isCancelled: (@Sendable () -> Bool)?)

    public static let allowed = Network.allowed(isCancelled: nil)
}

/// A caller's cancellation check, handed to work that may outlive the call: once the caller
/// has left, the work is cancelled and the caller's check (which may read a FUSE request freed
/// by the caller's reply) is never called again.
final class CallerCancellation: @unchecked Sendable {
    private let lock = OrderedLock(.callerCancellation)
    private var left = false
    private var detached = false
    private let isCancelled: (@Sendable () -> Bool)?

    init(_ isCancelled: (@Sendable () -> Bool)?) { self.isCancelled = isCancelled }

    var check: @Sendable () -> Bool {
        { [self] in
            lock.lock()
            defer { lock.unlock() }
            if detached { return false }
            return left || (isCancelled?() ?? false)
        }
    }

    /// The caller has its answer from elsewhere: the work runs to its end (within its own time
    /// bounds), neither cancelled nor asking the caller's check again. Aborting a request
    /// mid-answer would close its connection, which the next request wants warm.
    func detach() {
        lock.lock()
        detached = true
        lock.unlock()
    }

    func leave() {
        lock.lock()
        left = true
        lock.unlock()
    }
}

/// What a lookup that asks the bucket waits for: its probe's two requests ("is it a
/// directory?", "what is the object?") and, beside them, its directory's first listing page.
/// Each landing wakes the waiter, which decides whether it has an answer yet
/// (docs/architecture.md, "Lookups in one round trip").
final class LookupRace: @unchecked Sendable {
    private let condition = OrderedCondition(.lookupRace)
    private var metadata: Result<ObjectMetadata, StorageError>?
    private var hasChildren: Result<Bool, StorageError>?
    private var events = 0

    func finish(metadata r: Result<ObjectMetadata, StorageError>) { land { $0.metadata = r } }
    func finish(hasChildren r: Result<Bool, StorageError>) { land { $0.hasChildren = r } }

    /// A listing page of the directory was stored.
    func pageLanded() { land { _ in } }

    private func land(_ change: (LookupRace) -> Void) {
        condition.lock()
        change(self)
        events += 1
        condition.broadcast()
        condition.unlock()
    }

    /// Waits until `decide` gives an answer, asking it again after each landing (without the
    /// lock held); nil when `isCancelled` said so first (checked every 50 ms).
    func wait<T>(isCancelled: (@Sendable () -> Bool)?,
                 decide: (Result<ObjectMetadata, StorageError>?, Result<Bool, StorageError>?) -> T?) -> T? {
        while true {
            condition.lock()
            let (m, h, seen) = (metadata, hasChildren, events)
            condition.unlock()
            if let answer = decide(m, h) { return answer }
            if let isCancelled, isCancelled() { return nil }
            condition.lock()
            if events == seen { _ = condition.wait(until: Date().addingTimeInterval(0.05)) }
            condition.unlock()
        }
    }
}
