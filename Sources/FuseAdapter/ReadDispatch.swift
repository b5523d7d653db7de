import Glibc
import StorageClient
import StorefsCore

/// The kernel side of one read request, as the read dispatch sees it: a FUSE request
/// (`Request`), or a fake in tests. Exactly one reply is made per request.
protocol ReadRequest: Sendable {
    /// Replies with `bytes`.
    func reply(_ bytes: UnsafeRawBufferPointer)
    /// Replies with an error.
    func reply(errno: Int32)
    /// The caller was interrupted (its INTERRUPT came), or the daemon is ending.
    var isInterrupted: Bool { get }
}

/// Where a read that missed the cache waits for the network.
enum ReadPlacement: Equatable {
    /// On the FUSE thread that received it.
    case here
    /// On a read worker, which replies later.
    case worker
}

/// How the adapter serves a read (docs/architecture.md, "Threads"), one reply per request:
///
/// 1. On the FUSE thread that received it, the core answers from what is here (block cache,
///    landed downloads) with `Network.never`: a hop to another thread costs 12–20 µs, more
///    than a cache hit (docs/fuse-notes.md).
/// 2. A miss is served again with `Network.allowed` where `place` says: near the server
///    (`MissWait.brief`, about a millisecond) on the same thread, since the hop to a read
///    worker and back cost more CPU than the wait; far from it, or with `InlineMisses.limit`
///    FUSE threads serving misses already, on a read worker, so that a server that stalls
///    never holds every FUSE thread.
///
/// The reply goes out from the bytes the core returns (its buffer or a download's, borrowed),
/// then the reply is finished (the cache copy of a download, after the reply).
struct ReadDispatch: Sendable {
    let fs: Filesystem
    let buffers: BufferPool
    let inlineMisses: InlineMisses

    /// Where a miss that will wait `wait` is served; `.here` takes an inline place, which the
    /// caller gives back (`InlineMisses.leave`) once it has replied.
    func place(_ wait: MissWait) -> ReadPlacement {
        wait == .brief && inlineMisses.enter() ? .here : .worker
    }

    /// Serves a read of `size` bytes at `offset` of open file `handle`. `toWorker` hands work
    /// to a read worker (the adapter queues it where the request's INTERRUPT can answer it
    /// while it waits; `skipped` then runs instead of the work).
    func serve<R: ReadRequest>(_ request: R, inode: UInt64, handle: UInt64, offset: Int64, size: Int,
                               toWorker: (_ work: @escaping @Sendable () -> Void, _ skipped: @escaping @Sendable () -> Void) -> Void) {
        let started = monotonicNow()
        let buffer = buffers.take()
        let window = UnsafeMutableRawBufferPointer(rebasing: buffer[0..<min(size, buffers.bufferSize)])
        let wait: MissWait
        do throws(FilesystemError) {
            let answer = try fs.read(handle, at: offset, into: window, network: .never)
            switch consume answer {
            case .reply(let reply):
                respond(request, with: reply, inode: inode, started: started)
                buffers.give(buffer)
                return
            case .miss(let w):
                wait = w
            }
        } catch {
            respond(request, failure: error, inode: inode, started: started)
            buffers.give(buffer)
            return
        }
        let lease = BufferLease(buffer)
        let count = window.count
        let serveMiss: @Sendable () -> Void = { [self] in
            defer { buffers.give(lease.buffer) }
            do throws(FilesystemError) {
                let window = UnsafeMutableRawBufferPointer(rebasing: lease.buffer[0..<count])
                let isCancelled: @Sendable () -> Bool = { request.isInterrupted }
                let answer = try fs.read(handle, at: offset, into: window, network: .allowed(isCancelled: isCancelled))
                switch consume answer {
                case .reply(let reply):
                    respond(request, with: reply, inode: inode, started: started)
                case .miss:
                    preconditionFailure("a read that may wait is always replied")
                }
            } catch {
                respond(request, failure: error, inode: inode, started: started)
            }
        }
        switch place(wait) {
        case .here:
            defer { inlineMisses.leave() }
            serveMiss()
        case .worker:
            toWorker(serveMiss, { [buffers] in buffers.give(lease.buffer) })
        }
    }

    /// Replies with the read's bytes, then finishes it (what follows the reply). Counted before
    /// the reply goes out, so whoever reads the stats after its read returned finds it counted.
    private func respond<R: ReadRequest>(_ request: R, with reply: consuming ReadReply, inode: UInt64, started: Double) {
        OpTrace.record(.read, inode: inode, errno: 0, started: started, bytes: reply.bytes.count)
        request.reply(reply.bytes)
        reply.finish()
    }

    private func respond<R: ReadRequest>(_ request: R, failure: FilesystemError, inode: UInt64, started: Double) {
        let errno = Errno.value(for: failure.code)
        OpTrace.record(.read, inode: inode, errno: errno, started: started)
        request.reply(errno: errno)
    }
}
