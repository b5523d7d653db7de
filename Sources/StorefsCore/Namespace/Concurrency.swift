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

/// A result one thread produces and another waits for, giving up when its caller is interrupted.
final class Awaited<Value>: @unchecked Sendable {
    private let condition = NSCondition()
    private var result: Value?

    func finish(_ r: Value) {
        condition.lock()
        result = r
        condition.broadcast()
        condition.unlock()
    }

    /// nil when `isCancelled` said so first (checked every 50 ms).
    func wait(isCancelled: (@Sendable () -> Bool)? = nil) -> Value? {
        condition.lock()
        defer { condition.unlock() }
        while result == nil {
            if let isCancelled {
                if isCancelled() { return nil }
                _ = condition.wait(until: Date().addingTimeInterval(0.05))
            } else {
                condition.wait()
            }
        }
        return result
    }
}

/// A caller's cancellation check, handed to work that may outlive the call: once the caller
/// has left, the work is cancelled and the caller's check (which may read a FUSE request freed
/// by the caller's reply) is never called again.
final class CallerCancellation: @unchecked Sendable {
    private let lock = NSLock()
    private var left = false
    private let isCancelled: (@Sendable () -> Bool)?

    init(_ isCancelled: (@Sendable () -> Bool)?) { self.isCancelled = isCancelled }

    var check: @Sendable () -> Bool {
        { [self] in
            lock.lock()
            defer { lock.unlock() }
            return left || (isCancelled?() ?? false)
        }
    }

    func leave() {
        lock.lock()
        left = true
        lock.unlock()
    }
}

/// The metadata GET of a lookup, made beside its "is it a directory?" list request.
typealias ProbeResult = Awaited<Result<ObjectMetadata, StorageError>>
