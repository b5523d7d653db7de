import Foundation
import Synchronization
import Testing
@testable import StorefsCore

@Suite struct WorkerPoolTests {
    /// Whether `count` jobs that each wait (at most `patience` seconds) until all of them run
    /// did all run at once: only if the pool has that many threads free.
    static func runAtOnce(_ count: Int, on pool: WorkerPool, patience: Double) -> Bool {
        let state = Mutex((running: 0, sawAll: 0))
        let done = DispatchSemaphore(value: 0)
        for _ in 0..<count {
            pool.submit {
                state.withLock { $0.running += 1 }
                let deadline = Date().addingTimeInterval(patience)
                while state.withLock({ $0.running }) < count, Date() < deadline { usleep(1000) }
                state.withLock { if $0.running >= count { $0.sawAll += 1 } }
                done.signal()
            }
        }
        for _ in 0..<count { _ = done.wait(timeout: .now() + patience * Double(count) + 5) }
        return state.withLock { $0.sawAll } == count
    }

    /// The prefetch pool grows with the count of read-ahead parts (`BlockReader.prefetchPool`):
    /// a pool grown from 2 to 6 threads runs 6 blocking jobs at once; growing to fewer threads
    /// than it has changes nothing.
    @Test func aGrownPoolRunsAsManyJobsAtOnceAsItsThreads() {
        let pool = WorkerPool(threads: 2, name: "test-grow")
        defer { pool.shutdown() }
        #expect(!Self.runAtOnce(3, on: pool, patience: 0.5), "3 jobs ran at once on 2 threads")
        pool.grow(to: 6)
        pool.grow(to: 4)
        #expect(Self.runAtOnce(6, on: pool, patience: 10), "6 jobs did not run at once on a pool grown to 6")
    }

    /// Threads start only when jobs come; above the floor they end after `idleSeconds`
    /// without work, and come back for the next burst (issue 49, item 4: pools sized for the
    /// worst burst held all their threads from first use on).
    @Test func threadsStartWithWorkAndTheBurstsEndOnceIdle() {
        let pool = WorkerPool(threads: 2, name: "test-idle", maxThreads: 8, idleSeconds: 0.2)
        defer { pool.shutdown() }
        #expect(pool.threadCount == 0, "a pool with no work yet holds threads")
        #expect(Self.runAtOnce(8, on: pool, patience: 10), "8 jobs did not run at once on a pool of up to 8")
        #expect(pool.threadCount <= 8, "more threads than the pool allows")
        let deadline = Date().addingTimeInterval(10)
        while pool.threadCount > 2, Date() < deadline { usleep(10_000) }
        #expect(pool.threadCount == 2, "idle threads above the floor did not end")
        #expect(Self.runAtOnce(8, on: pool, patience: 10), "the pool did not start threads again")
        #expect(!Self.runAtOnce(9, on: pool, patience: 0.5), "9 jobs ran at once on a pool of up to 8")
    }
}
