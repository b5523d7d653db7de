import Foundation
import Locking

/// A count of work under way that a thread can wait to see reach zero (replies owed at
/// shutdown, jobs of a pool being drained): woken when it does, never polled.
public final class WaitGroup: @unchecked Sendable {
    /// Guards `count`. A leaf lock: nothing else is taken under it.
    private let condition = OrderedCondition(.waitGroup)
    private var count = 0

    public init() {}

    /// One more piece of work under way.
    public func enter() {
        condition.lock()
        count += 1
        condition.unlock()
    }

    /// A piece of work ended; the last one wakes the waiters.
    public func leave() {
        condition.lock()
        count -= 1
        precondition(count >= 0, "WaitGroup left more often than entered")
        if count == 0 { condition.broadcast() }
        condition.unlock()
    }

    /// Work under way now.
    public var current: Int {
        condition.lock()
        defer { condition.unlock() }
        return count
    }

    /// Waits until no work is under way, at most `timeout` seconds; false on time-out.
    public func wait(timeout: Double) -> Bool {
        let deadline = Date().addingTimeInterval(timeout)
        condition.lock()
        defer { condition.unlock() }
        while count > 0 {
            if !condition.wait(until: deadline) { return count == 0 }
        }
        return true
    }
}
