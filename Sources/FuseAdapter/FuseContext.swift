internal import CFuse3
import StorageClient
import StorefsCore
import Synchronization
import Locking

/// Everything a FUSE callback needs, reached through `fuse_req_userdata`.
final class FuseContext: Sendable {
    let fs: Filesystem
    let buffers: BufferPool
    /// Replies still owed from worker threads (and from FUSE threads serving misses); the
    /// session is destroyed only after they drain.
    let inFlight = WaitGroup()
    /// Set once the loop has ended: work still running gives up (as if interrupted) so the
    /// session can be destroyed after it, within a bounded time.
    let stopping = Atomic<Bool>(false)
    /// Read workers (`WorkerPools.reads`): reads that wait for the network.
    let workers: WorkerPool
    /// Lookups, attribute refreshes and listings that need the bucket (`WorkerPools.metadata`):
    /// a stalled server ties up these threads, never FUSE's (so cached reads go on).
    let metadata: WorkerPool
    /// Reads that miss the cache and are served on the FUSE thread that received them.
    let inlineMisses: InlineMisses
    /// How reads are served, and on which thread (`ReadDispatch`).
    let reads: ReadDispatch
    /// Requests waiting for a worker, which an INTERRUPT answers at once.
    let queued = QueuedRequests()
    private let session = OrderedMutex<SessionPointer?>(.fuseSession, nil)

    init(fs: Filesystem, pools: WorkerPools, fuseThreads: Int) {
        self.fs = fs
        workers = pools.reads
        metadata = pools.metadata
        // A buffer for each read worker kept, and as many again for reads on FUSE threads.
        self.buffers = BufferPool(bufferSize: FuseSession.maxRequestSize, keep: 32)
        self.inlineMisses = InlineMisses(limit: max(1, fuseThreads / 2))
        self.reads = ReadDispatch(fs: fs, buffers: buffers, inlineMisses: inlineMisses)
    }

    /// The session whose end `isStopping` watches; nil before it is destroyed (a request served
    /// after that, none should be, then sees `stopping` alone, set once the loop returned).
    func attach(_ se: OpaquePointer?) { session.withLock { $0 = se.map(SessionPointer.init(raw:)) } }

    /// The daemon is ending: the loop has returned (`stopping`), or the session was told to end
    /// (unmount, SIGTERM), which the loop waits out for every request a FUSE thread is serving.
    var isStopping: Bool {
        stopping.load(ordering: .relaxed) || session.withLock { $0.map { fuse_session_exited($0.raw) != 0 } ?? false }
    }

    func stopWorkers() {
        workers.shutdown()
        metadata.shutdown()
    }
}

private struct SessionPointer: @unchecked Sendable {
    let raw: OpaquePointer
}

/// The reads served on FUSE threads (docs/architecture.md, "Threads"): near the server a miss
/// waits about a millisecond, less than a hop to a read worker and back costs. At most `limit`
/// at once, so that a server that stalls holds at most that many of FUSE's threads; the others
/// go on reading interrupts, cache hits and everything else, and further misses go to workers.
final class InlineMisses: Sendable {
    let limit: Int
    private let count = Atomic<Int>(0)

    init(limit: Int) { self.limit = limit }

    /// Takes a place if one is free; `leave` gives it back.
    func enter() -> Bool {
        if count.add(1, ordering: .relaxed).newValue <= limit { return true }
        count.subtract(1, ordering: .relaxed)
        return false
    }

    func leave() { count.subtract(1, ordering: .relaxed) }
}

/// Requests handed to a worker (a read to a read worker, a metadata operation to a metadata
/// worker) and not yet taken by one. Every worker may be waiting on a server that stalls (for
/// up to `request_timeout`), and a request queued behind them would see its INTERRUPT only
/// once a worker took it: so each is registered with libfuse's interrupt callback
/// (`fuse_req_interrupt_func`), which answers it EINTR at once if it is still here, and the
/// worker that takes it later skips it. A handled signal (Ctrl-C in a program that catches it)
/// then ends every request of the interrupted call promptly, whatever the workers are waiting
/// on. Keyed by the request's address: an entry leaves before its request is answered (and
/// freed), so no address is ever seen twice while here.
final class QueuedRequests: Sendable {
    struct Entry: Sendable {
        let op: FuseOp
        let inode: UInt64
        let name: String?
        let started: Double
    }

    /// A leaf lock (nothing is taken or replied under it); libfuse holds the request's own
    /// lock around the interrupt callback that takes it.
    private let waiting = OrderedMutex(.queuedRequests, [Int: Entry]())

    private static func key(_ raw: fuse_req_t) -> Int { Int(bitPattern: raw) }

    func add(_ r: Request, _ entry: Entry) { waiting.withLock { $0[Self.key(r.raw)] = entry } }

    /// A worker takes the request: false if its INTERRUPT answered it already.
    func take(_ r: Request) -> Bool { waiting.withLock { $0.removeValue(forKey: Self.key(r.raw)) != nil } }

    /// Its INTERRUPT came: the entry if the request is still waiting (the caller answers it).
    func interrupted(_ raw: fuse_req_t) -> Entry? { waiting.withLock { $0.removeValue(forKey: Self.key(raw)) } }
}

/// A `fuse_req_t` that may cross to a worker thread (libfuse allows replying from any thread).
struct Request: @unchecked Sendable {
    let raw: fuse_req_t
}

/// A FUSE read request, as `ReadDispatch` serves it.
struct FuseReadRequest: ReadRequest, @unchecked Sendable {
    let raw: fuse_req_t
    let ctx: FuseContext

    func reply(_ bytes: UnsafeRawBufferPointer) {
        _ = fuse_reply_buf(raw, bytes.baseAddress?.assumingMemoryBound(to: CChar.self), bytes.count)
    }

    func reply(errno: Int32) { _ = fuse_reply_err(raw, errno) }

    var isInterrupted: Bool { fuse_req_interrupted(raw) != 0 || ctx.isStopping }
}

/// A copy of a request's `fuse_file_info` (libfuse's own lives only during the callback).
struct FileInfo: @unchecked Sendable {
    var info: fuse_file_info
}

/// Reply buffers for reads: allocating ≥128 KiB per request costs 2–3× throughput here
/// (docs/fuse-notes.md, item 2), so buffers are recycled.
final class BufferPool: Sendable {
    private struct Box: @unchecked Sendable { let pointer: UnsafeMutableRawPointer }
    private struct Free: ~Copyable {
        var buffers: [Box] = []
        var lastUse = 0.0
    }
    private let free = OrderedMutex(.replyBuffers, Free())
    let bufferSize: Int
    private let keep: Int

    init(bufferSize: Int, keep: Int) {
        self.bufferSize = bufferSize
        self.keep = keep
        // Idle buffers go back to the system after a load (MemoryReturn).
        MemoryReturn.register { [weak self] idle in self?.releaseIfIdle(for: idle) ?? false }
    }

    func take() -> UnsafeMutableRawBufferPointer {
        let p = free.withLock { f in
            f.lastUse = monotonicNow()
            return f.buffers.popLast()
        }?.pointer ?? UnsafeMutableRawPointer.allocate(byteCount: bufferSize, alignment: 4096)
        return UnsafeMutableRawBufferPointer(start: p, count: bufferSize)
    }

    func give(_ buffer: UnsafeMutableRawBufferPointer) {
        let box = Box(pointer: buffer.baseAddress!)
        let kept = free.withLock { f -> Bool in
            f.lastUse = monotonicNow()
            guard f.buffers.count < keep else { return false }
            f.buffers.append(box)
            return true
        }
        if !kept { box.pointer.deallocate() }
    }

    private func releaseIfIdle(for idle: Double) -> Bool {
        let released = free.withLock { f -> [Box] in
            guard monotonicNow() - f.lastUse >= idle else { return [] }
            defer { f.buffers.removeAll() }
            return f.buffers
        }
        for box in released { box.pointer.deallocate() }
        return !released.isEmpty
    }
}

/// A pooled buffer handed from the FUSE thread to the worker that finishes the read.
struct BufferLease: @unchecked Sendable {
    let buffer: UnsafeMutableRawBufferPointer
    init(_ buffer: UnsafeMutableRawBufferPointer) { self.buffer = buffer }
}
