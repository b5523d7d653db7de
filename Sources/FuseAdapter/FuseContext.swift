internal import CFuse3
import StorefsCore
import Synchronization

/// Everything a FUSE callback needs, reached through `fuse_req_userdata`.
final class FuseContext: Sendable {
    let fs: Filesystem
    let buffers: BufferPool
    /// Replies still owed from worker threads; the session is destroyed only after they drain.
    let inFlight = Atomic<Int>(0)
    private let pool = Mutex<WorkerPool?>(nil)
    let readWorkers: Int

    init(fs: Filesystem, readWorkers: Int) {
        self.fs = fs
        self.readWorkers = readWorkers
        self.buffers = BufferPool(bufferSize: FuseSession.maxRequestSize, keep: readWorkers * 2)
    }

    /// Threads start only after daemonizing: fork() keeps just the calling thread.
    func startWorkers() {
        pool.withLock { p in
            if p == nil { p = WorkerPool(threads: readWorkers, name: "storefs-read") }
        }
    }

    var workers: WorkerPool {
        pool.withLock { p in
            if p == nil { p = WorkerPool(threads: readWorkers, name: "storefs-read") }
            return p!
        }
    }

    func stopWorkers() { pool.withLock { $0?.shutdown() } }
}

/// A `fuse_req_t` that may cross to a worker thread (libfuse allows replying from any thread).
struct Request: @unchecked Sendable {
    let raw: fuse_req_t
}

/// Reply buffers for reads: allocating ≥128 KiB per request costs 2–3× throughput here
/// (fuse-swift-notes.md pitfall 5), so buffers are recycled.
final class BufferPool: Sendable {
    private struct Box: @unchecked Sendable { let pointer: UnsafeMutableRawPointer }
    private let free = Mutex<[Box]>([])
    let bufferSize: Int
    private let keep: Int

    init(bufferSize: Int, keep: Int) {
        self.bufferSize = bufferSize
        self.keep = keep
    }

    func take() -> UnsafeMutableRawBufferPointer {
        let p = free.withLock { $0.popLast() }?.pointer
            ?? UnsafeMutableRawPointer.allocate(byteCount: bufferSize, alignment: 4096)
        return UnsafeMutableRawBufferPointer(start: p, count: bufferSize)
    }

    func give(_ buffer: UnsafeMutableRawBufferPointer) {
        let box = Box(pointer: buffer.baseAddress!)
        let kept = free.withLock { f -> Bool in
            guard f.count < keep else { return false }
            f.append(box)
            return true
        }
        if !kept { box.pointer.deallocate() }
    }
}

/// A pooled buffer handed from the FUSE thread to the worker that finishes the read.
struct BufferLease: @unchecked Sendable {
    let buffer: UnsafeMutableRawBufferPointer
    init(_ buffer: UnsafeMutableRawBufferPointer) { self.buffer = buffer }
}
