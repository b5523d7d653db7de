import Foundation
import Synchronization

/// Threads of our own that run blocking work (HTTP transfers, disk reads) so that neither
/// FUSE's threads nor Swift's two-thread cooperative pool ever wait on the network.
///
/// A pool holds no thread until it has work: a job submitted while no thread of the pool is
/// free starts one, up to `limit` at once (docs/architecture.md, "Threads"); a thread that has
/// had nothing to do for `idleSeconds` ends. So a pool sized for the worst burst (64 stalled
/// lookups each waiting on three requests) costs threads only during that burst, and a mount
/// that has been idle holds none of them (issue 49, item 4: repeated `find` walks left 110
/// threads, all started on first use and never ended).
public final class WorkerPool: Sendable {
    private struct State: ~Copyable {
        var jobs: [(@Sendable () -> Void)?] = []
        var head = 0
        var stopping = false
        /// Jobs running now.
        var running = 0
        /// Threads alive, and of those the ones not running a job (waiting, or about to).
        var threads = 0
        var idle = 0
        /// Threads started so far (their names).
        var started = 0
        /// Most threads at once.
        var limit: Int

        var pending: Int { jobs.count - head }
    }

    /// Guards the queue and the thread counts; a leaf lock (jobs run and threads start outside it).
    private let state: Mutex<State>
    /// One signal per job submitted (and one per thread at shutdown); a wait that times out
    /// lets an idle thread end.
    private let wake = DispatchSemaphore(value: 0)
    private let name: String
    private let idleSeconds: Double

    /// A pool of at most `threads` threads, each ending after `idleSeconds` without work.
    /// Threads start on demand: they are made only after the daemon forked (fork keeps one).
    public init(threads: Int, name: String, idleSeconds: Double = WorkerPool.defaultIdleSeconds) {
        self.name = name
        self.idleSeconds = idleSeconds
        state = Mutex(State(limit: max(1, threads)))
    }

    /// How long an idle thread waits for work before it ends.
    public static let defaultIdleSeconds = 5.0

    /// Allows up to `threads` threads at once; a pool's limit never shrinks.
    public func grow(to threads: Int) {
        state.withLock { $0.limit = max($0.limit, threads) }
    }

    public func submit(_ job: @escaping @Sendable () -> Void) {
        // A job that no free thread will take starts a thread of its own.
        let thread = state.withLock { s -> Int? in
            s.jobs.append(job)
            guard s.pending > s.idle, s.threads < s.limit else { return nil }
            s.threads += 1
            s.idle += 1
            s.started += 1
            return s.started
        }
        wake.signal()
        if let thread { start(thread) }
    }

    /// Threads alive now (tests, docs/architecture.md's bound).
    public var threadCount: Int { state.withLock { $0.threads } }

    /// Waits until no job is queued or running, at most `timeout` seconds; false on time-out.
    public func drain(timeout: Double) -> Bool {
        let deadline = Date().addingTimeInterval(timeout)
        while state.withLock({ $0.pending > 0 || $0.running > 0 }) {
            if Date() > deadline { return false }
            usleep(2000)
        }
        return true
    }

    /// Lets the threads finish queued work and exit.
    public func shutdown() {
        let threads = state.withLock { s -> Int in
            s.stopping = true
            return s.threads
        }
        for _ in 0..<threads { wake.signal() }
    }

    private func start(_ index: Int) {
        let t = Thread { [self] in self.run() }
        t.name = "\(name)-\(index)"
        t.stackSize = 1 << 20
        t.start()
    }

    private enum Next {
        case run(@Sendable () -> Void)
        case wait
        case exit
    }

    private func run() {
        while true {
            let timedOut = wake.wait(timeout: .now() + idleSeconds) == .timedOut
            let next = state.withLock { s -> Next in
                if s.head < s.jobs.count {
                    let job = s.jobs[s.head]!
                    s.jobs[s.head] = nil  // release what the job captured (flights hold budget)
                    s.head += 1
                    s.running += 1
                    s.idle -= 1
                    if s.head > 1024 && s.head * 2 > s.jobs.count {
                        s.jobs.removeFirst(s.head)
                        s.head = 0
                    }
                    return .run(job)
                }
                // Nothing queued: at shutdown, or after `idleSeconds` without work, this thread
                // ends (a job submitted from now on sees one thread fewer, and starts one if
                // no other is free).
                if s.stopping || timedOut {
                    s.threads -= 1
                    s.idle -= 1
                    return .exit
                }
                return .wait
            }
            switch next {
            case .run(let job):
                job()
                state.withLock { s in
                    s.running -= 1
                    s.idle += 1
                }
            case .wait: continue
            case .exit: return
            }
        }
    }
}
