import Foundation
import Synchronization

/// A fixed set of threads that run blocking work (HTTP transfers, disk reads) so that neither
/// FUSE's threads nor Swift's two-thread cooperative pool ever wait on the network.
public final class WorkerPool: Sendable {
    private struct Queue: ~Copyable {
        var jobs: [(@Sendable () -> Void)?] = []
        var head = 0
        var stopping = false
        var running = 0
    }

    private let queue = Mutex(Queue())
    private let wake = DispatchSemaphore(value: 0)
    private let name: String
    /// Threads started so far.
    private let threads = Mutex(0)

    /// Threads start at once: create pools only after daemonizing (fork keeps one thread).
    public init(threads: Int, name: String) {
        self.name = name
        grow(to: threads)
    }

    /// Starts more threads, up to `threads` in all; a pool never shrinks.
    public func grow(to threads: Int) {
        let first = self.threads.withLock { n -> Int in
            defer { n = max(n, threads) }
            return n
        }
        for i in first..<max(first, threads) {
            let t = Thread { [self] in self.run() }
            t.name = "\(name)-\(i)"
            t.stackSize = 1 << 20
            t.start()
        }
    }

    public func submit(_ job: @escaping @Sendable () -> Void) {
        queue.withLock { q in
            q.jobs.append(job)
        }
        wake.signal()
    }

    /// Waits until no job is queued or running, at most `timeout` seconds; false on time-out.
    public func drain(timeout: Double) -> Bool {
        let deadline = Date().addingTimeInterval(timeout)
        while queue.withLock({ $0.head < $0.jobs.count || $0.running > 0 }) {
            if Date() > deadline { return false }
            usleep(2000)
        }
        return true
    }

    /// Lets the threads finish queued work and exit.
    public func shutdown() {
        queue.withLock { $0.stopping = true }
        for _ in 0..<threads.withLock({ $0 }) { wake.signal() }
    }

    private func run() {
        while true {
            wake.wait()
            let job: (@Sendable () -> Void)? = queue.withLock { q in
                guard q.head < q.jobs.count else { return nil }
                let j = q.jobs[q.head]
                q.jobs[q.head] = nil  // release what the job captured (flights hold budget)
                q.head += 1
                q.running += 1
                if q.head > 1024 && q.head * 2 > q.jobs.count {
                    q.jobs.removeFirst(q.head)
                    q.head = 0
                }
                return j
            }
            if let job {
                job()
                queue.withLock { $0.running -= 1 }
            } else if queue.withLock({ $0.stopping }) {
                return
            }
        }
    }
}
