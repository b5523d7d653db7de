import Foundation
import Synchronization
import Testing
@testable import Locking

/// The debug-build check of the one lock order (docs/architecture.md, "Threads and locks").
/// One suite, serialized: the recorder is process-wide.
@Suite(.serialized) struct LockOrderTests {
    final class Recorder: @unchecked Sendable {
        let seen = Mutex<[String]>([])
        func install() { LockOrder.onInversion = { m in self.seen.withLock { $0.append(m) } } }
        var messages: [String] { seen.withLock { $0 } }
    }

    let outer = LockLevel(1, "test.outer")
    let inner = LockLevel(2, "test.inner")

    @Test func theCheckIsOnInDebugBuilds() {
        #if DEBUG
        #expect(LockOrder.isChecking)
        #endif
    }

    @Test func locksTakenInOrderPassAndAreLetGo() {
        let r = Recorder()
        r.install()
        defer { LockOrder.onInversion = nil }
        let a = OrderedMutex(outer, 0), b = OrderedLock(inner)
        a.withLock { _ in b.withLock { #expect(LockOrder.heldLevels.map(\.rank) == [1, 2]) } }
        #expect(LockOrder.heldLevels.isEmpty)
        #expect(r.messages.isEmpty)
    }

    @Test func anInversionIsReportedWithBothLocksNamed() {
        guard LockOrder.isChecking else { return }
        let r = Recorder()
        r.install()
        defer { LockOrder.onInversion = nil }
        let a = OrderedMutex(outer, 0), b = OrderedCondition(inner)
        b.lock()
        a.withLock { _ in }
        b.unlock()
        #expect(r.messages.count == 1)
        #expect(r.messages.first?.contains("taking test.outer (1) while holding test.inner (2)") == true)
    }

    @Test func twoLocksOfOneLevelAreNeverHeldTogether() {
        guard LockOrder.isChecking else { return }
        let r = Recorder()
        r.install()
        defer { LockOrder.onInversion = nil }
        let a = OrderedLock(inner), b = OrderedLock(inner)
        a.withLock { b.withLock {} }
        #expect(r.messages.count == 1)
    }

    @Test func aLockTakenWithoutWaitingIsNotCheckedButWhatIsTakenUnderItIs() {
        guard LockOrder.isChecking else { return }
        let r = Recorder()
        r.install()
        defer { LockOrder.onInversion = nil }
        let a = OrderedLock(outer), b = OrderedLock(inner)
        b.lock()
        #expect(a.try())
        a.unlock()
        b.unlock()
        #expect(r.messages.isEmpty)
        #expect(b.try())
        a.withLock {}
        b.unlock()
        #expect(r.messages.count == 1)
    }

    @Test func eachThreadHasItsOwnLocks() {
        let a = OrderedLock(inner)
        a.lock()
        let other = Thread { #expect(LockOrder.heldLevels.isEmpty) }
        other.start()
        while !other.isFinished { usleep(1000) }
        a.unlock()
    }
}
