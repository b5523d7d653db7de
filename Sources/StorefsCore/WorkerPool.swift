import Foundation
import Synchronization
import Locking

/// Threads that run blocking work (HTTP transfers, disk reads) so that neither FUSE's threads
/// nor Swift's two-thread cooperative pool ever wait on the network.
///
/// No thread starts before the first job: a pool may be made before the daemon forks (fork
/// keeps only the calling thread), and one never used costs nothing. From then on it keeps
/// `threads` threads, and starts more, up to `maxThreads`, while jobs wait and no thread is
/// free: a job never waits behind jobs stalled on a server (a stalled download holds its
/// thread) as long as the ceiling allows. Threads above `threads` leave after `idleSeconds`
/// without a job, so a burst (a `find` of a large tree) leaves no threads behind
/// (docs/architecture.md, "Threads and locks").
public final class WorkerPool: Sendable {
    private struct State: ~Copyable {
        var jobs: [(@Sendable () -> Void)?] = []
        var head = 0
        var stopping = false
        /// Threads alive, and how many of them wait for a job.
        var threads = 0
        var idle = 0
        /// Jobs handed to a waiting thread and not yet taken: a thread woken for each.
        var wakeups = 0
        /// The floor: threads kept once started.
        var floor: Int
        /// The most threads at once (`grow` raises it).
        var limit: Int
        var waiting: Int { jobs.count - head }
    }

    /// The jobs, the threads and the stopping flag. A leaf lock: jobs run, and threads start,
    /// outside it.
    private let state: OrderedMutex<State>
    private let wake = OrderedCondition(.workerPoolWake)
    /// Jobs submitted and not yet finished (`drain` waits for none).
    private let pending = WaitGroup()
    private let name: String
    private let idleSeconds: Double
    /// Threads started so far, over the pool's life (tests).
    private let started = Atomic<Int>(0)

    /// A pool of `threads` threads (started at the first job), growing to `maxThreads` (at
    /// least `threads`) while jobs wait with every thread busy; threads above `threads` leave
    /// after `idleSeconds` idle.
    public init(threads: Int, name: String, maxThreads: Int? = nil, idleSeconds: Double = 5) {
        self.name = name
        self.idleSeconds = idleSeconds
        state = OrderedMutex(.workerPoolState, State(floor: max(1, threads), limit: max(1, threads, maxThreads ?? threads)))
    }

    /// Raises the most threads the pool may run at once to `threads`; it never lowers it.
    /// Threads above the floor still start only while jobs wait, and leave once idle.
    public func grow(to threads: Int) {
        state.withLock { $0.limit = max($0.limit, threads) }
    }

    /// The most threads the pool may run at once now.
    public var maxThreads: Int { state.withLock { $0.limit } }

    public func submit(_ job: @escaping @Sendable () -> Void) {
        pending.enter()
        let start = state.withLock { s -> Int in
            s.jobs.append(job)
            if s.threads == 0 {
                // The first job: the floor's threads start now.
                s.threads = s.floor
                return s.floor
            }
            if s.idle > s.wakeups {
                s.wakeups += 1
                return 0
            }
            guard s.threads < s.limit else { return 0 }
            s.threads += 1
            return 1
        }
        wake.lock()
        wake.signal()
        wake.unlock()
        for _ in 0..<start { spawn() }
    }

    /// Threads alive now (tests, metrics).
    public var threadCount: Int { state.withLock { $0.threads } }

    /// Threads ever started (tests).
    var threadsStarted: Int { started.load(ordering: .relaxed) }

    /// Jobs queued and not yet taken by a thread (tests).
    var queued: Int { state.withLock { $0.waiting } }

    /// Waits until no job is queued or running, at most `timeout` seconds; false on time-out.
    public func drain(timeout: Double) -> Bool {
        pending.wait(timeout: timeout)
    }

    /// Lets the threads finish queued work and exit.
    public func shutdown() {
        state.withLock { $0.stopping = true }
        wake.lock()
        wake.broadcast()
        wake.unlock()
    }

    private func spawn() {
        let t = Thread { [self] in self.run() }
        t.name = "\(name)-\(started.add(1, ordering: .relaxed).newValue - 1)"
        t.stackSize = 1 << 20
        t.start()
    }

    /// What a thread does next: a job, wait, or leave.
    private enum Next {
        case run(@Sendable () -> Void)
        case wait(until: Date?)
        case leave
    }

    private func next(idleSince: inout Date?) -> Next {
        state.withLock { s -> Next in
            if s.head < s.jobs.count {
                let j = s.jobs[s.head]!
                s.jobs[s.head] = nil  // release what the job captured (flights hold budget)
                s.head += 1
                if s.head > 1024 && s.head * 2 > s.jobs.count {
                    s.jobs.removeFirst(s.head)
                    s.head = 0
                }
                idleSince = nil
                return .run(j)
            }
            if s.stopping {
                s.threads -= 1
                return .leave
            }
            let now = Date()
            if s.threads > s.floor, let since = idleSince, now.timeIntervalSince(since) >= idleSeconds {
                s.threads -= 1
                return .leave
            }
            if idleSince == nil { idleSince = now }
            s.idle += 1
            return .wait(until: s.threads > s.floor ? idleSince!.addingTimeInterval(idleSeconds) : nil)
        }
    }

    private func run() {
        var idleSince: Date?
        while true {
            switch next(idleSince: &idleSince) {
            case .run(let job):
                job()
                pending.leave()
            case .leave:
                return
            case .wait(let until):
                wake.lock()
                // Woken by a submit (a wake-up counted for this thread), by shutdown, or by
                // the idle deadline; a job submitted between `next` and here already counted
                // a wake-up, so the check below keeps it from being missed.
                let woken = state.withLock { s -> Bool in
                    if s.wakeups > 0 || s.stopping || s.head < s.jobs.count { return true }
                    return false
                }
                if !woken {
                    if let until { _ = wake.wait(until: until) } else { wake.wait() }
                }
                wake.unlock()
                state.withLock { s in
                    s.idle -= 1
                    if s.wakeups > 0 { s.wakeups -= 1 }
                }
            }
        }
    }
}
