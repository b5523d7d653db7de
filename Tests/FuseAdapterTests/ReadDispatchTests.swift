import Foundation
import Glibc
import StorageClient
import StorefsCore
import StorefsTestSupport
import Synchronization
import Testing
@testable import FuseAdapter

/// A read request that records its reply and the thread it came from, as the kernel would see it.
final class RecordedRead: ReadRequest, @unchecked Sendable {
    struct Reply {
        var bytes: [UInt8]?
        var errno: Int32?
        var thread: pthread_t
        /// Cached bytes of the object when the reply went out (`whenReplied`).
        var seen: Int64?
    }

    private let lock = NSLock()
    private var replies: [Reply] = []
    private let interrupted = Atomic<Bool>(false)
    /// Asked at the reply, on the replying thread.
    var whenReplied: (@Sendable () -> Int64)?

    func reply(_ bytes: UnsafeRawBufferPointer) {
        let seen = whenReplied?()
        lock.lock()
        replies.append(Reply(bytes: Array(bytes), errno: nil, thread: pthread_self(), seen: seen))
        lock.unlock()
    }

    func reply(errno: Int32) {
        lock.lock()
        replies.append(Reply(bytes: nil, errno: errno, thread: pthread_self(), seen: nil))
        lock.unlock()
    }

    var isInterrupted: Bool { interrupted.load(ordering: .relaxed) }

    func interrupt() { interrupted.store(true, ordering: .relaxed) }

    var all: [Reply] {
        lock.lock()
        defer { lock.unlock() }
        return replies
    }

    /// Waits for the first reply (a worker's comes later).
    func waitForReply(timeout: Double = 10) -> Reply? {
        let end = Date().addingTimeInterval(timeout)
        while Date() < end {
            if let first = all.first { return first }
            usleep(1000)
        }
        return nil
    }
}

/// How the adapter serves reads (`ReadDispatch`; docs/architecture.md, "Threads"): hits and
/// near misses on the FUSE thread that received them, far misses and misses past the inline
/// bound on a read worker, one reply per request, the cache copy after the reply.
@Suite struct ReadDispatchTests {
    let store = MemoryStore()
    // Larger than `BlockReader.defaultWholeObjectLimit`: misses are fetched in ranges, so each read
    // below that is not the first is a miss of its own.
    let bytes = pattern(Int(BlockReader.defaultWholeObjectLimit) + (2 << 20), seed: 5)

    /// A filesystem over `store` with a block cache, and an open handle of `f`.
    func mount(cache: Bool = true) throws -> (Filesystem, UInt64, BlockCache?) {
        store.put("f", bytes)
        let blockCache = cache ? try BlockCache(directory: temporaryDirectory(), capacity: 64 << 20, blockSize: 16 << 10) : nil
        let reader = BlockReader(store: store, cache: blockCache, endpoint: "e",
                                 config: .init(blockSize: 16 << 10, readAhead: 0, partSize: 1 << 20, memoryLimit: 32 << 20))
        let fs = Filesystem(store: store, reference: StorageReference(bucket: "b"), config: .init(), reader: reader)
        let f = try fs.lookup(parent: Filesystem.rootInode, name: "f")
        return (fs, try fs.open(f.inode, flags: O_RDONLY).handle, blockCache)
    }

    func dispatch(_ fs: Filesystem, inlineLimit: Int = 4) -> ReadDispatch {
        ReadDispatch(fs: fs, buffers: BufferPool(bufferSize: 1 << 20, keep: 2), inlineMisses: InlineMisses(limit: inlineLimit))
    }

    /// A worker pool that records what it was handed.
    final class Workers: @unchecked Sendable {
        let pool = WorkerPool(threads: 2, name: "test-read")
        let handed = Atomic<Int>(0)

        func hand(_ work: @escaping @Sendable () -> Void, _ skipped: @escaping @Sendable () -> Void) {
            handed.add(1, ordering: .relaxed)
            pool.submit(work)
        }
    }

    @Test func aCacheHitIsRepliedOnTheThreadThatReceivedIt() throws {
        let (fs, handle, _) = try mount()
        let d = dispatch(fs)
        let workers = Workers()
        let first = RecordedRead()
        d.serve(first, inode: 2, handle: handle, offset: 0, size: 65_536, toWorker: workers.hand)
        #expect(first.waitForReply()?.bytes == Array(bytes[0..<65_536]))
        let hit = RecordedRead()
        d.serve(hit, inode: 2, handle: handle, offset: 0, size: 65_536, toWorker: workers.hand)
        let replies = hit.all
        #expect(replies.count == 1, "answered before serve returned, once")
        #expect(replies.first.map { pthread_equal($0.thread, pthread_self()) != 0 } == true)
        #expect(replies.first?.bytes == Array(bytes[0..<65_536]))
        #expect(workers.handed.load(ordering: .relaxed) == 1, "only the first read, a miss, went to a worker")
    }

    @Test func aMissFarFromTheServerIsServedByAWorker() throws {
        store.reportFirstByte(0.030)
        let (fs, handle, _) = try mount()
        let d = dispatch(fs)
        let workers = Workers()
        for offset in [Int64(0), 100_000, 200_000] {
            let r = RecordedRead()
            d.serve(r, inode: 2, handle: handle, offset: offset, size: 50_000, toWorker: workers.hand)
            let reply = try #require(r.waitForReply())
            #expect(reply.bytes == Array(bytes[Int(offset)..<Int(offset) + 50_000]))
            #expect(pthread_equal(reply.thread, pthread_self()) == 0, "replied from a worker")
            usleep(20_000)
            #expect(r.all.count == 1)
        }
        #expect(workers.handed.load(ordering: .relaxed) == 3)
    }

    @Test func aMissNearTheServerIsServedOnTheThreadThatReceivedIt() throws {
        store.reportFirstByte(0.0002)
        let (fs, handle, _) = try mount()
        let d = dispatch(fs)
        let workers = Workers()
        // The first download finds the server near; until then nothing says it is.
        let first = RecordedRead()
        d.serve(first, inode: 2, handle: handle, offset: 0, size: 50_000, toWorker: workers.hand)
        _ = first.waitForReply()
        let near = RecordedRead()
        d.serve(near, inode: 2, handle: handle, offset: 200_000, size: 50_000, toWorker: workers.hand)
        let replies = near.all
        #expect(replies.count == 1, "replied before serve returned")
        #expect(replies.first.map { pthread_equal($0.thread, pthread_self()) != 0 } == true)
        #expect(replies.first?.bytes == Array(bytes[200_000..<250_000]))
        #expect(workers.handed.load(ordering: .relaxed) == 1)
    }

    @Test func pastTheInlineBoundANearMissGoesToAWorker() throws {
        store.reportFirstByte(0.0002)
        let (fs, handle, _) = try mount()
        let d = dispatch(fs, inlineLimit: 1)
        let workers = Workers()
        let first = RecordedRead()
        d.serve(first, inode: 2, handle: handle, offset: 0, size: 50_000, toWorker: workers.hand)
        _ = first.waitForReply()
        #expect(d.place(.brief) == .here, "the one inline place")
        #expect(d.place(.brief) == .worker, "taken: the next near miss goes to a worker")
        #expect(d.place(.long) == .worker)
        let r = RecordedRead()
        d.serve(r, inode: 2, handle: handle, offset: 200_000, size: 50_000, toWorker: workers.hand)
        let reply = try #require(r.waitForReply())
        #expect(pthread_equal(reply.thread, pthread_self()) == 0)
        #expect(reply.bytes == Array(bytes[200_000..<250_000]))
        d.inlineMisses.leave()
        #expect(d.place(.brief) == .here, "given back, the place is taken again")
        d.inlineMisses.leave()
    }

    /// A read's own download is replied from its buffer, and its cache copy is written once the
    /// reply is out, on the same thread: the reader never waits for the disk.
    @Test func theCacheCopyOfAReadsDownloadIsWrittenAfterItsReply() throws {
        store.reportFirstByte(0.0002)
        let (fs, handle, cache) = try mount()
        let d = dispatch(fs)
        let workers = Workers()
        let meta = try store.metadata(of: "f")
        let cached: @Sendable () -> Int64 = {
            cache?.cachedBytes(endpoint: "e", bucket: "b", name: "f", generation: meta.generation, size: meta.size) ?? -1
        }
        let r = RecordedRead()
        r.whenReplied = cached
        d.serve(r, inode: 2, handle: handle, offset: 0, size: 65_536, toWorker: workers.hand)
        let reply = try #require(r.waitForReply())
        #expect(reply.bytes == Array(bytes[0..<65_536]))
        #expect(reply.seen == 0, "nothing cached when the reply went out")
        let deadline = Date().addingTimeInterval(10)
        while cached() < 65_536, Date() < deadline { usleep(1000) }
        #expect(cached() == 65_536, "cached once the reply was finished")
    }

    @Test func aFailedReadIsRepliedItsErrnoOnce() throws {
        let (fs, handle, _) = try mount(cache: false)
        store.remove("f")
        let d = dispatch(fs)
        let workers = Workers()
        let r = RecordedRead()
        d.serve(r, inode: 2, handle: handle, offset: 0, size: 4096, toWorker: workers.hand)
        let reply = try #require(r.waitForReply())
        #expect(reply.errno == Errno.value(for: .storage(.generationChanged)) && reply.bytes == nil)
        usleep(20_000)
        #expect(r.all.count == 1)
    }

    @Test func anInterruptedMissIsRepliedEINTR() throws {
        store.reportFirstByte(0.030)
        store.delayReads(5)
        let (fs, handle, _) = try mount(cache: false)
        let d = dispatch(fs)
        let workers = Workers()
        let r = RecordedRead()
        let t0 = Date()
        d.serve(r, inode: 2, handle: handle, offset: 0, size: 4096, toWorker: workers.hand)
        usleep(100_000)
        r.interrupt()
        let reply = try #require(r.waitForReply())
        #expect(reply.errno == EINTR)
        #expect(Date().timeIntervalSince(t0) < 2, "the interrupt ended the wait, not the download")
    }

    @Test func aReadAtTheEndOfTheFileRepliesNoBytes() throws {
        let (fs, handle, _) = try mount()
        let d = dispatch(fs)
        let workers = Workers()
        let r = RecordedRead()
        d.serve(r, inode: 2, handle: handle, offset: Int64(bytes.count), size: 4096, toWorker: workers.hand)
        #expect(r.all.map(\.bytes) == [[]])
        #expect(workers.handed.load(ordering: .relaxed) == 0)
    }
}
