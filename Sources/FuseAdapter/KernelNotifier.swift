internal import CFuse3
import Glibc
import StorefsCore
import Synchronization
import Locking

/// Tells the kernel to drop a directory entry it caches (after an object was replaced or
/// deleted, docs/architecture.md "Overwrites"), from a thread of its own: libfuse forbids
/// notifying from inside a request on the same directory (the kernel holds its lock), so the
/// request that learnt the news only queues it here.
final class KernelNotifier: Sendable {
    private struct Session: @unchecked Sendable { let raw: OpaquePointer }
    /// nil once the session is going away: queued notices are then dropped.
    private let session: OrderedMutex<Session?>
    /// Its one thread (`WorkerPools.notify`).
    private let queue: WorkerPool

    init(_ se: OpaquePointer, queue: WorkerPool) {
        session = OrderedMutex(.notifierSession, Session(raw: se))
        self.queue = queue
    }

    func invalidateEntry(parent: UInt64, name: String) {
        queue.submit { [self] in
            session.withLock { s in
                guard let s else { return }
                let rc = name.withCString { fuse_lowlevel_notify_inval_entry(s.raw, fuse_ino_t(parent), $0, name.utf8.count) }
                if rc != 0 && rc != -ENOENT {
                    Log.debug("op=notify parent=\(parent) name=\(Log.escaped(name)) rc=\(rc)")
                }
            }
        }
    }

    /// Waits for a notice in progress, then drops the rest.
    func stop() {
        session.withLock { $0 = nil }
        queue.shutdown()
    }
}
