import Foundation
import Locking

/// A global bound on bytes held by downloads in flight (`memory_limit=`). Demand reads wait
/// for room; read-ahead only takes room that is free, so it never starves a reader.
final class MemoryBudget: @unchecked Sendable {
    let limit: Int64
    private var used: Int64 = 0
    private let condition = OrderedCondition(.memoryBudget)

    init(limit: Int64) { self.limit = limit }

    /// Waits for `bytes` of room; false if `isCancelled` turned true first. `makeRoom` runs
    /// (without the lock) whenever there is none: it may let go of memory held elsewhere.
    func acquire(_ bytes: Int64, isCancelled: (@Sendable () -> Bool)?, makeRoom: (() -> Void)? = nil) -> Bool {
        while true {
            condition.lock()
            // A single request larger than the whole budget may run alone.
            if used == 0 || used + bytes <= limit {
                used += bytes
                condition.unlock()
                return true
            }
            condition.unlock()
            if let isCancelled, isCancelled() { return false }
            makeRoom?()
            condition.lock()
            if used > 0 && used + bytes > limit { _ = condition.wait(until: Date().addingTimeInterval(0.05)) }
            condition.unlock()
        }
    }

    func tryAcquire(_ bytes: Int64) -> Bool {
        condition.lock()
        defer { condition.unlock() }
        guard used + bytes <= limit else { return false }
        used += bytes
        return true
    }

    func release(_ bytes: Int64) {
        condition.lock()
        used -= bytes
        condition.broadcast()
        condition.unlock()
    }

    var inUse: Int64 {
        condition.lock()
        defer { condition.unlock() }
        return used
    }
}
