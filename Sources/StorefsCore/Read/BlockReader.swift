import Foundation
import StorageClient
import Synchronization

/// The read path below a file handle: block cache → single-flight ranged downloads → store.
///
/// A read of `[offset, offset+n)` walks its blocks. Cached blocks are copied out after their
/// CRC32C check (`readCached` does only this, on the FUSE thread, and reports a miss). A
/// missing block is taken from a download already in flight, or a new download of the run of
/// missing blocks is made on the calling thread. Sequential streams also schedule read-ahead
/// downloads of `partSize` on the prefetch threads, up to `parallel` at once, within the
/// memory budget. Each prefetch thread writes its part's cache copy before its next download,
/// or, with `cache_writes=keep_up`, leaves it to the `CacheWriter` so a slow disk cannot hold
/// the downloads back. Every download is pinned to the generation seen at open.
public final class BlockReader: Sendable {
    public struct Config: Sendable {
        public var blockSize: Int
        public var readAhead: Int64
        public var parallel: Int
        public var partSize: Int64
        public var memoryLimit: Int64
        /// With `cache_writes=keep_up`: read-ahead bytes that may wait in memory for their cache
        /// write. Default: two parts (at most a quarter of `memoryLimit`); it absorbs bursts, the
        /// patience rule in `execute` decides the rest, and each waiting part is a resident buffer.
        public var writeBacklog: Int64
        public var cacheWrites: CacheWrites
        /// Parts in flight and their size follow the link (`TransferPlan`), `parallel` being
        /// the most parts and `readAhead` the widest window; otherwise `parallel` parts of
        /// `partSize` at most, always (`parallel=` given).
        public var adaptive: Bool
        /// The first read-ahead window of a sequential reader: it grows fourfold with each read, so
        /// a short read of a large file fetches little (`head -c`), a long one soon a lot.
        public var initialWindow: Int64 = 2 << 20

        public init(blockSize: Int = 16 << 10, readAhead: Int64 = 64 << 20, parallel: Int = 4,
                    partSize: Int64 = 8 << 20, memoryLimit: Int64 = 256 << 20, writeBacklog: Int64? = nil,
                    cacheWrites: CacheWrites = .all, adaptive: Bool = false) {
            self.adaptive = adaptive
            self.blockSize = blockSize
            self.readAhead = readAhead
            self.parallel = parallel
            self.partSize = partSize
            self.memoryLimit = memoryLimit
            self.writeBacklog = writeBacklog ?? min(2 * partSize, memoryLimit / 4)
            self.cacheWrites = cacheWrites
        }
    }

    public let config: Config
    let store: ObjectStore
    let cache: BlockCache?
    /// Part of the cache key: the same bucket name at two endpoints is two buckets.
    let endpoint: String
    let budget: MemoryBudget
    /// How many read-ahead parts run at once, and how large they are.
    let transfers: TransferController
    let buffers: FlightBufferPool
    let requestBuffers: FlightBufferPool
    let writer: CacheWriter
    /// Whether the bucket answers (shared with the Filesystem): during an outage a read of
    /// bytes that are not cached fails at once instead of waiting `request_timeout` again.
    public let health: BucketHealth
    private let slowWritesNoted = Atomic<Bool>(false)
    /// Set at unmount (`finishPendingWork`): read-ahead under way ends as if interrupted, so
    /// no download retries on past the mount (its transfer within about a second, its
    /// retry waits at once); finished downloads still get their cache copy.
    private let stopping = Atomic<Bool>(false)
    /// The downloads in flight (or finished and not yet read), per object generation.
    private let tables = Mutex([ObjectKey: (table: FlightTable, streams: Int)]())
    private let pool = Mutex<WorkerPool?>(nil)
    /// Threads that open connections ahead of need (`openConnectionsAhead`), and how many
    /// openings are queued and not yet under way.
    private let connectPool = Mutex<WorkerPool?>(nil)
    private let connectionsQueued = Mutex(0)
    /// First bytes asked for beside lookups, for the first read of the file to take.
    let firstBytes = FirstBytesTable()

    struct ObjectKey: Hashable {
        var object: ByteName
        var generation: Int64
    }

    public convenience init(store: ObjectStore, cache: BlockCache?, endpoint: String, config: Config,
                            health: BucketHealth = BucketHealth()) {
        self.init(store: store, cache: cache, endpoint: endpoint, config: config,
                  writer: CacheWriter(maxBacklog: config.writeBacklog), health: health)
    }

    init(store: ObjectStore, cache: BlockCache?, endpoint: String, config: Config, writer: CacheWriter,
         health: BucketHealth = BucketHealth()) {
        self.health = health
        self.store = store
        self.cache = cache
        self.endpoint = endpoint
        self.config = config
        self.writer = writer
        budget = MemoryBudget(limit: config.memoryLimit)
        // Parts in flight may hold three quarters of the budget: the rest is for parts waiting
        // for their cache write and for demand downloads, so that the daemon's peak RSS stays
        // within memory_limit plus its base (docs/architecture.md, "Adaptive transfers").
        let maxPartSize = config.adaptive ? max(config.partSize, 32 << 20) : config.partSize
        transfers = TransferController(limits: .init(
            startParts: config.adaptive ? min(16, config.parallel) : config.parallel, minParts: min(2, config.parallel),
            maxParts: config.parallel,
            startPartSize: config.adaptive ? min(config.partSize, TransferPlan.Limits.adaptiveStartPartSize) : config.partSize,
            maxPartSize: maxPartSize,
            memoryLimit: config.adaptive ? config.memoryLimit / 4 * 3 : config.memoryLimit,
            fixedParts: config.adaptive ? nil : config.parallel), fastestAnswer: { [store] in store.fastestFirstByte })
        // Regions as large as the largest part: a grown part never takes a mapping of its own
        // beside the recycled ones (only the pages a part touches become resident).
        let part = Int(max(maxPartSize, Int64(config.blockSize)))
        let request = FuseLimits.maxRequest + config.blockSize
        // Readers' own misses: one a read worker (16) or a prefetch thread running a reader's
        // part at a time, all counted (in use or free), so the bound must hold them all or a
        // busy mount unmaps and faults in a region on every miss. It is carved out of
        // memory_limit, not added to it: with a bound of its own beside the parts' (the whole
        // limit), 8 readers through `wan` peaked at 320–328 MiB, over 64 MiB + memory_limit.
        let requestKeep = min(32 * request, Int(config.memoryLimit) / 8)
        requestBuffers = FlightBufferPool(regionSize: request, keepBytes: requestKeep)
        // Parts downloading plus parts waiting for their cache write: recycled, not re-mapped,
        // up to the rest of what memory_limit allows resident.
        buffers = FlightBufferPool(regionSize: max(part, request), keepBytes: Int(config.memoryLimit) - requestKeep)
    }

    /// Read-ahead parts take part-sized regions; demand downloads (at most one FUSE request
    /// plus a block) take small ones. One pool for both let a 16 KiB miss hold a recycled,
    /// fully resident 8 MiB region, so memory was no longer bounded by `memory_limit`.
    private func newFlight(first: Int, last: Int, start: Int64, length: Int, readAhead: Bool = false) -> Flight {
        let pool = length <= requestBuffers.regionSize ? requestBuffers : buffers
        return Flight(firstBlock: first, blockCount: last - first + 1, start: start, length: length, isReadAhead: readAhead,
                      budget: budget, pool: pool)
    }

    /// Prefetch threads start on first use, after the daemon has forked. A thread writes its
    /// part's cache copy before its next download, and the part's slot is free meanwhile. Twice
    /// `nearMaxParts` (the most that run near the server): there the threads bound the parts
    /// that wait in memory for their cache write (docs/architecture.md, "Threads": 16 threads
    /// rather than 32 took one cold reader on loopback from a median of 115 to 84 MiB of peak
    /// RSS, at the same speed). A count of parts past that (far links only) has `nearMaxParts`
    /// threads more than parts, for their writes.
    private var prefetchPool: WorkerPool {
        let near = transfers.limits.nearMaxParts, parts = transfers.parts
        let threads = !config.adaptive ? config.parallel : parts > 2 * near ? parts + near : 2 * near
        return pool.withLock { p in
            if let p { p.grow(to: max(1, threads)) } else { p = WorkerPool(threads: max(1, threads), name: "storefs-prefetch") }
            return p!
        }
    }

    /// Waits for read-ahead and cache writes under way (unmount): what was read before an
    /// unmount is in the cache after it.
    public func finishPendingWork(timeout: Double) {
        stopping.store(true, ordering: .relaxed)
        let pool = pool.withLock { $0 }
        // Downloads first: each one may queue a cache write.
        if let pool, !pool.drain(timeout: timeout) {
            Log.warn("unmount: read-ahead and cache writes still running after \(Int(timeout))s; leaving them")
        } else if !writer.drain(timeout: timeout) {
            Log.warn("unmount: cache writes still running after \(Int(timeout))s; leaving them")
        }
    }

    /// Per-open-file state: the generation's cache entry, its flights and the sequential detector.
    final class Stream: Sendable {
        let meta: ObjectMetadata
        let cached: CachedObject?
        let flights: FlightTable
        let detector: Mutex<Prefetcher>
        /// The object's `servedWrongEpoch` when this file was opened.
        let openedEpoch: Int
        /// A warm connection set aside for the download of a read that missed, before that
        /// read let read-ahead go (`readCached`): taken by the read's own download on a worker.
        let parkedClaim = Mutex<ConnectionClaim?>(nil)

        init(meta: ObjectMetadata, cached: CachedObject?, flights: FlightTable, detector: Prefetcher) {
            self.meta = meta
            self.cached = cached
            self.flights = flights
            self.detector = Mutex(detector)
            openedEpoch = cached?.servedWrongEpoch ?? 0
        }

        /// Bytes this open file may have served were found wrong since it was opened.
        var hasServedWrong: Bool { (cached?.servedWrongEpoch ?? 0) != openedEpoch }

        /// The object ever had wrong bytes served: the kernel's page cache of it is not kept.
        var everServedWrong: Bool { openedEpoch != 0 }
    }

    func openStream(_ meta: ObjectMetadata) -> Stream {
        let cached = meta.size > 0 ? cache?.acquire(endpoint: endpoint, meta: meta) : nil
        let minWindow = min(config.partSize, config.readAhead, config.initialWindow)
        let key = ObjectKey(object: ByteName(meta.name), generation: meta.generation)
        let table = tables.withLock { t -> FlightTable in
            let entry = t[key] ?? (FlightTable(), 0)
            t[key] = (entry.table, entry.streams + 1)
            return entry.table
        }
        return Stream(meta: meta, cached: cached, flights: table,
                      detector: Prefetcher(minWindow: minWindow, maxWindow: config.readAhead))
    }

    func closeStream(_ stream: Stream) {
        let key = ObjectKey(object: ByteName(stream.meta.name), generation: stream.meta.generation)
        let last = tables.withLock { t -> Bool in
            guard let entry = t[key] else { return false }
            t[key] = (entry.table, entry.streams - 1)
            return entry.streams <= 1
        }
        // Read-ahead nobody will read goes. Downloads still running stay findable until they
        // end, so a file opened again meanwhile shares them instead of fetching again.
        if last {
            stream.flights.dropFinished()
            retireIfIdle(stream)
        }
        if let c = stream.cached { cache?.release(c) }
    }

    /// Whether a file still has the object open (its read-ahead may yet be read).
    private func isOpen(_ stream: Stream) -> Bool {
        let key = ObjectKey(object: ByteName(stream.meta.name), generation: stream.meta.generation)
        return tables.withLock { t in t[key].map { $0.streams > 0 && $0.table === stream.flights } ?? false }
    }

    /// Forgets an object's flight table once no file has it open and no download is left in it.
    private func retireIfIdle(_ stream: Stream) {
        let key = ObjectKey(object: ByteName(stream.meta.name), generation: stream.meta.generation)
        tables.withLock { t in
            if let entry = t[key], entry.streams <= 0, entry.table === stream.flights, entry.table.isEmpty {
                t.removeValue(forKey: key)
            }
        }
    }

    private var blockSize: Int { config.blockSize }

    private func blockLength(_ meta: ObjectMetadata, _ block: Int) -> Int {
        Int(min(Int64(blockSize), meta.size - Int64(block) * Int64(blockSize)))
    }

    /// Notes the read for read-ahead and serves it if every block is cached; false on a miss.
    /// Never touches the network: safe on a FUSE thread. A read that lies wholly inside one
    /// finished download is handed to `send` straight from the download's buffer (the reply
    /// then copies it once, into the kernel) and `sent` is set; otherwise it is copied into `dst`.
    func readCached(_ stream: Stream, at offset: Int64, into dst: UnsafeMutableRawBufferPointer,
                    send: ((UnsafeRawBufferPointer) -> Void)?, sent: inout Bool) -> Bool {
        let parked = parkConnectionIfMissing(stream, at: offset)
        observe(stream, offset: offset, count: dst.count)
        let served = readCachedAfterObserving(stream, at: offset, into: dst, send: send, sent: &sent)
        if served && parked { stream.parkedClaim.withLock { $0 = nil } }  // landed meanwhile: not needed
        return served
    }

    private func readCachedAfterObserving(_ stream: Stream, at offset: Int64, into dst: UnsafeMutableRawBufferPointer,
                                          send: ((UnsafeRawBufferPointer) -> Void)?, sent: inout Bool) -> Bool {
        // Taken before anything is copied: while a completing download is checked, the cache
        // may hold its bytes unchecked, and the check may yet find that bytes served were wrong.
        let epoch = stream.cached?.checkEpoch ?? 0
        if stream.hasServedWrong || stream.cached?.isChecking == true { return false }  // `read` decides
        var pos = offset
        let end = offset + Int64(dst.count)
        if let send, let flight = stream.flights.flight(for: Int(pos / Int64(blockSize))), flight.start <= pos, end <= flight.end,
           case .success? = flight.finished {
            // A finished download's buffer never changes (a completing download is checked
            // before it finishes), so what holds for a copy holds here.
            let at = Int(pos - flight.start)
            send(UnsafeRawBufferPointer(rebasing: flight.buffer[at..<(at + dst.count)]))
            sent = true
            if end == flight.end, flight.markConsumed() { stream.flights.forget(flight) }
            return true
        }
        while pos < end {
            // A sequential reader usually arrives just after its read-ahead landed: it copies
            // from the download's buffer (no disk read, no second CRC pass).
            if let flight = stream.flights.flight(for: Int(pos / Int64(blockSize))), case .success? = flight.finished {
                pos += copy(from: flight, stream, at: pos, upTo: end, into: dst, dstOffset: offset)
                continue
            }
            guard let cached = stream.cached else { return false }
            let n = cached.cachedBytes(from: pos, upTo: end)
            guard n > 0, cached.read(at: pos, into: slice(dst, Int(pos - offset), n)) else { return false }
            pos += Int64(n)
        }
        // A check began while this copied, or found wrong bytes served: `read` waits for its verdict.
        if let cached = stream.cached, cached.checkEpoch != epoch || cached.isChecking || stream.hasServedWrong { return false }
        return true
    }

    /// On a far link a reader that will wait for its own download keeps the warm connection
    /// for it: the read-ahead this read lets go is queued first and would take it, leaving the
    /// reader a new connection's set-up (60 ms through `wan`) before its first byte
    /// (docs/architecture.md, "Adaptive transfers"). Near the server a connection costs
    /// nothing worth the lock.
    @discardableResult
    private func parkConnectionIfMissing(_ stream: Stream, at offset: Int64) -> Bool {
        let block = Int(offset / Int64(blockSize))
        guard transfers.seemsFar, stream.flights.flight(for: block) == nil, stream.cached?.isCached(block) != true,
              let claim = store.claimIdleConnection() else { return false }
        stream.parkedClaim.withLock { $0 = claim }  // one that was parked and not taken goes back
        return true
    }

    /// `readCached` that always copies into `dst`.
    func readCached(_ stream: Stream, at offset: Int64, into dst: UnsafeMutableRawBufferPointer) -> Bool {
        var sent = false
        return readCached(stream, at: offset, into: dst, send: nil, sent: &sent)
    }

    private func slice(_ dst: UnsafeMutableRawBufferPointer, _ at: Int, _ count: Int) -> UnsafeMutableRawBufferPointer {
        UnsafeMutableRawBufferPointer(rebasing: dst[at..<(at + count)])
    }

    /// Copies what a finished flight holds from `pos` on (up to `end`); returns the bytes copied.
    /// The flight is let go once a reader has copied up to its end and the disk copy is made.
    private func copy(from flight: Flight, _ stream: Stream, at pos: Int64, upTo end: Int64,
                      into dst: UnsafeMutableRawBufferPointer, dstOffset: Int64) -> Int64 {
        let flightEnd = flight.end
        let n = Int(min(end, flightEnd) - pos)
        let at = Int(pos - flight.start)
        slice(dst, Int(pos - dstOffset), n).copyMemory(from: UnsafeRawBufferPointer(rebasing: flight.buffer[at..<(at + n)]))
        if pos + Int64(n) == flightEnd, flight.markConsumed() { stream.flights.forget(flight) }
        return Int64(n)
    }

    /// Lets go of finished read-ahead nobody has read yet whose cache copy is made or skipped
    /// (memory budget pressure): only that frees memory (`FlightTable.dropStored`).
    private func dropStored() {
        for table in tables.withLock({ $0.values.map(\.table) }) { table.dropStored() }
    }

    /// Serves the read, downloading what is missing. `observed` is true when `readCached`
    /// already recorded this read for read-ahead. With `send`, a read that lies wholly inside
    /// one download is handed to it from the download's buffer (as `readCached` does) once
    /// every check below has passed, and `sent` is set; otherwise it is copied into `dst`.
    func read(_ stream: Stream, at offset: Int64, into dst: UnsafeMutableRawBufferPointer, observed: Bool,
              isCancelled: (@Sendable () -> Bool)?, afterReply: AfterReply? = nil) throws(StorageError) {
        var sent = false
        try read(stream, at: offset, into: dst, observed: observed, isCancelled: isCancelled, afterReply: afterReply,
                 send: nil, sent: &sent)
    }

    func read(_ stream: Stream, at offset: Int64, into dst: UnsafeMutableRawBufferPointer, observed: Bool,
              isCancelled: (@Sendable () -> Bool)?, afterReply: AfterReply?,
              send: ((UnsafeRawBufferPointer) -> Void)?, sent: inout Bool) throws(StorageError) {
        if !observed {
            parkConnectionIfMissing(stream, at: offset)
            observe(stream, offset: offset, count: dst.count)
        }
        // This read's own download, if it makes one, goes out on the connection parked for it.
        let claim = stream.parkedClaim.withLock { c -> ConnectionClaim? in
            defer { c = nil }
            return c
        }
        try ConnectionClaim.run(claim) { () throws(StorageError) in
            try readChecked(stream, at: offset, into: dst, isCancelled: isCancelled, afterReply: afterReply,
                            send: send, sent: &sent)
        }
    }

    private func readChecked(_ stream: Stream, at offset: Int64, into dst: UnsafeMutableRawBufferPointer,
                             isCancelled: (@Sendable () -> Bool)?, afterReply: AfterReply?,
                             send: ((UnsafeRawBufferPointer) -> Void)?, sent: inout Bool) throws(StorageError) {
        // The download that holds the whole read, when `send` may reply from its buffer: held
        // here, its buffer lives until the reply is made (a finished download's never changes).
        var whole: Flight?
        func reply() {
            guard let send, let flight = whole else { return }
            let at = Int(offset - flight.start)
            send(UnsafeRawBufferPointer(rebasing: flight.buffer[at..<(at + dst.count)]))
            sent = true
        }
        while true {
            let epoch = stream.cached?.checkEpoch ?? 0
            let checking = stream.cached?.isChecking ?? false
            if stream.hasServedWrong { throw servedWrongError(stream) }
            whole = nil
            let fromCache = try readOnce(stream, at: offset, into: dst, isCancelled: isCancelled, afterReply: afterReply,
                                         handOver: send != nil, whole: &whole)
            guard let cached = stream.cached else { return reply() }
            // No reply goes out while a check of the object is under way that began before this
            // read ended: it may find that bytes served earlier (or copied here) were wrong.
            if checking || cached.isChecking || cached.checkEpoch != epoch {
                while cached.isChecking {
                    if let isCancelled, isCancelled() { throw StorageError(.cancelled, "read interrupted") }
                    Thread.sleep(forTimeInterval: 0.0005)
                }
                if stream.hasServedWrong { throw servedWrongError(stream) }
                // Bytes from the cache may have been the checked download's, stored before its
                // check (and not counted as served): read them again, now checked.
                if fromCache { continue }
            }
            if stream.hasServedWrong { throw servedWrongError(stream) }
            return reply()
        }
    }

    private func servedWrongError(_ stream: Stream) -> StorageError {
        StorageError(.checksumMismatch,
                     "gs://\(stream.meta.bucket)/\(stream.meta.name): bytes read through this open file did not match its crc32c (open it again)")
    }

    /// One pass of `read`; true if any bytes came from the block cache. With `handOver`, a read
    /// that lies wholly inside one successful download is not copied: `whole` is set to it.
    private func readOnce(_ stream: Stream, at offset: Int64, into dst: UnsafeMutableRawBufferPointer,
                          isCancelled: (@Sendable () -> Bool)?, afterReply: AfterReply?,
                          handOver: Bool, whole: inout Flight?) throws(StorageError) -> Bool {
        var fromCache = false
        var pos = offset
        let end = offset + Int64(dst.count)
        // Where the cache was looked at again after a miss: once per position, so a block that
        // is indexed but cannot be read (its file closed, a failed disk read) is downloaded.
        var lookedAgain: Int64 = -1
        while pos < end {
            if let cached = stream.cached {
                let n = cached.cachedBytes(from: pos, upTo: end)
                if n > 0, cached.read(at: pos, into: slice(dst, Int(pos - offset), n)) {
                    pos += Int64(n)
                    fromCache = true
                    continue
                }
            }
            let block = Int(pos / Int64(blockSize))
            let lastBlock = Int((end - 1) / Int64(blockSize))
            guard let flight = try flightFor(stream, block: block, through: lastBlock, mayFindCached: lookedAgain != pos,
                                             isCancelled: isCancelled) else {
                lookedAgain = pos  // its cache copy was made since the look above: read it from there
                continue
            }
            // Ours to run: a demand download we made, or read-ahead still queued (claimed here
            // rather than waited for behind other files' downloads on the prefetch threads).
            let mine = flight.claim()
            // The reader waits for the link: the read-ahead did not keep ahead of it.
            if flight.finished == nil { transfers.noteReaderWaited() }
            if mine {
                execute(flight, stream, isCancelled: isCancelled ?? { false }, afterReply: afterReply)
            }
            guard let outcome = flight.wait(isCancelled: isCancelled) else {
                throw StorageError(.cancelled, "read interrupted")
            }
            switch outcome {
            case .success:
                if handOver, pos == offset, end <= flight.end {
                    // The reply is made from the download's buffer (a worker's copy into the
                    // reply buffer was ~5% of the daemon's CPU with 8 readers on loopback).
                    whole = flight
                    if end == flight.end, flight.markConsumed() { stream.flights.forget(flight) }
                    return fromCache
                }
                pos += copy(from: flight, stream, at: pos, upTo: end, into: dst, dstOffset: offset)
            case .failure(let error):
                // Someone else's download was cancelled: make our own on the next turn.
                if error.code == .cancelled && !mine { continue }
                throw error
            }
        }
        return fromCache
    }

    private func observe(_ stream: Stream, offset: Int64, count: Int) {
        // A reader's window covers its share of the parts that may run at once, and a little
        // more: alone, all of them; beside other readers that want read-ahead, an equal share
        // (the gate shares the slots so, `PartQueue`), so that N readers together hold about
        // the parts in flight plus two each, not N times all of them.
        let (parts, part, near, readers, nextParts) = transfers.current(for: ObjectIdentifier(stream))
        let share = config.adaptive ? max(1, parts / readers) : parts
        let limit = config.adaptive ? Int64(share + 2) * part : config.readAhead
        let (ahead, isStream, warm) = stream.detector.withLock {
            ($0.observe(offset: offset, count: count, size: stream.meta.size, limit: limit, granularity: part), $0.hasEvidence,
             stream.cached == nil ? nil : $0.warm(reach: Self.warmReach, size: stream.meta.size))
        }
        if let warm { self.warm(stream, warm) }
        guard let ahead else { return }
        // Only for a stream (a short read's first window needs no more connections) with bytes
        // to download (a cached file read on a far mount needs none).
        if config.adaptive, !near, isStream, transfers.seemsFar,
           Int64(stream.cached?.cachedBytes(from: ahead.lowerBound, upTo: ahead.upperBound) ?? 0) < Int64(ahead.count) {
            openConnectionsAhead(stream, from: ahead.lowerBound, parts: nextParts, part: part)
        }
        if let stopped = schedule(stream, ahead) {
            // Out of memory budget: the rest of the window is tried again on the next read.
            stream.detector.withLock { $0.unscheduled(from: stopped) }
        }
    }

    /// Whether the cache holds any bytes of that generation of `name`.
    func hasCachedBytes(of name: String, generation: Int64, size: Int64) -> Bool {
        (cache?.cachedBytes(endpoint: endpoint, bucket: store.bucket, name: name, generation: generation, size: size) ?? 0) > 0
    }

    /// Asks for the first bytes of `name` (whatever its generation) on a thread `submit` gives,
    /// for a lookup that needs a round trip anyway (docs/architecture.md, "Lookups in one round
    /// trip"): the file's first read then waits for this answer instead of asking again.
    public func fetchFirstBytes(of name: String, submit: (@escaping @Sendable () -> Void) -> Void) {
        guard let entry = firstBytes.begin(name) else { return }
        submit { [store] in
            var bytes = [UInt8](repeating: 0, count: FirstBytesTable.length)
            let start = try? bytes.withUnsafeMutableBytes { (b) throws(StorageError) -> ObjectStart? in
                try store.readStart(name, into: b, isCancelled: nil)
            }
            entry.finish(start.flatMap { $0 }.map { FirstBytesTable.Landed(generation: $0.generation, size: $0.size,
                                                                            bytes: Array(bytes.prefix($0.count))) })
        }
    }

    /// On a far link a new connection's set-up (TCP and TLS: a round trip or more each) is
    /// paid before a part needs it: once a reader reads on, connections are opened up to the
    /// parts that may run at once after the count's next step up (no more than the rest of the
    /// file needs), each with a one-byte request, while the reader's window is still small
    /// (docs/architecture.md, "Adaptive transfers"). Open connections stay in the pool for
    /// every file after.
    private func openConnectionsAhead(_ stream: Stream, from offset: Int64, parts: Int, part: Int64) {
        let want = Int(min(Int64(parts), (stream.meta.size - offset + part - 1) / max(1, part)))
        guard want >= 2, let have = store.connectionCount else { return }
        let missing = connectionsQueued.withLock { queued -> Int in
            let missing = want - have - queued
            if missing > 0 { queued += missing }
            return missing
        }
        guard missing > 0 else { return }
        let pool = connectPool.withLock { p in
            if p == nil { p = WorkerPool(threads: 16, name: "storefs-connect") }
            return p!
        }
        let meta = stream.meta
        for _ in 0..<missing {
            pool.submit { [self] in
                connectionsQueued.withLock { $0 -= 1 }  // from here on `connectionCount` has it
                store.openConnection(forReading: meta.name, generation: meta.generation)
            }
        }
    }

    /// The flight that will bring `block`: an existing one, or a new demand download of the
    /// run of missing blocks from `block` through at most `lastBlock`. Nil (only when
    /// `mayFindCached`) if `block` turned out to be cached: the caller reads it from there.
    private func flightFor(_ stream: Stream, block: Int, through lastBlock: Int, mayFindCached: Bool,
                           isCancelled: (@Sendable () -> Bool)?) throws(StorageError) -> Flight? {
        let meta = stream.meta
        if let existing = stream.flights.flight(for: block) { return existing }
        if let failed = stream.flights.recentFailure(covering: block) { throw failed }
        // The caller missed the cache before it looked here: a download whose cache copy ended
        // in between has left the table (a flight leaves it only once its bytes are cached or
        // will never be). Looking at the cache after the table closes that gap; misses only.
        func landed() -> Bool { mayFindCached && stream.cached?.isCached(block) == true }
        if landed() { return nil }
        if let outage = health.outage { throw outage }
        var last = block
        var lastBlock = lastBlock
        // The file's first read, its first bytes asked beside its lookup: it takes all of them.
        if block == 0, firstBytes.contains(meta.name) {
            lastBlock = max(lastBlock, Int((min(Int64(FirstBytesTable.length), meta.size) - 1) / Int64(blockSize)))
        }
        while last < lastBlock, stream.flights.flight(for: last + 1) == nil, !(stream.cached?.isCached(last + 1) ?? false) {
            last += 1
        }
        let start = Int64(block) * Int64(blockSize)
        let length = Int(min(meta.size, Int64(last + 1) * Int64(blockSize)) - start)
        // Finished read-ahead nobody has read yet gives way to a reader once its cache copy is
        // made (with the cache off at once: it could hold the whole budget, even this file's).
        guard budget.acquire(Int64(length), isCancelled: isCancelled, makeRoom: { self.dropStored() }) else {
            throw StorageError(.cancelled, "read interrupted while waiting for memory")
        }
        // Waiting for room, the reader may have let the block's cache copy land.
        if landed() {
            budget.release(Int64(length))
            return nil
        }
        let flight = newFlight(first: block, last: last, start: start, length: length)
        if let raced = stream.flights.register(flight, orExistingFor: block) { return raced }
        return flight
    }

    /// How far ahead of a sequential reader its cached blocks are asked from the cache file.
    static let warmReach: Int64 = 4 << 20

    /// Has the kernel read the cached blocks in `range` that no download holds in memory from
    /// the cache file, on a prefetch thread (`Prefetcher.warm`): a sequential reader of cached
    /// bytes then finds them in the page cache. Blocks still in memory are read from there.
    private func warm(_ stream: Stream, _ range: Range<Int64>) {
        guard let c = stream.cached else { return }
        let first = Int(range.lowerBound / Int64(blockSize))
        let last = Int((range.upperBound - 1) / Int64(blockSize))
        let cachedMask = c.cachedMask(first...last)
        let comingMask = stream.flights.coveredMask(first...last)
        var b = first
        while b <= last {
            guard cachedMask[b - first], !comingMask[b - first] else {
                b += 1
                continue
            }
            var end = b
            while end < last, cachedMask[end + 1 - first], !comingMask[end + 1 - first] { end += 1 }
            let blocks = b...end
            c.open()
            prefetchPool.submit { [self] in
                c.willNeed(blocks: blocks)
                self.cache?.release(c)
            }
            b = end + 1
        }
    }

    /// Schedules read-ahead downloads for the bytes in `range`, in parts, skipping blocks that
    /// are cached or already coming; stops where the memory budget is used up and returns where
    /// it stopped (nil when all of it is scheduled). Called on FUSE threads by many readers at
    /// once: it looks at the cache index and the flight table once each, not once per block.
    private func schedule(_ stream: Stream, _ range: Range<Int64>) -> Int64? {
        let meta = stream.meta
        let first = Int(range.lowerBound / Int64(blockSize))
        let last = Int((range.upperBound - 1) / Int64(blockSize))
        let perPart = max(1, Int(transfers.partSize / Int64(blockSize)))
        // The flight table first, then the cache: a flight leaves the table only once its bytes
        // are cached (or will never be), so a block found in neither is really missing. The
        // other order could miss a part whose cache copy ended in between and fetch it again.
        let comingMask = stream.flights.coveredMask(first...last)
        let cachedMask = stream.cached?.cachedMask(first...last) ?? [Bool](repeating: false, count: last - first + 1)
        func taken(_ b: Int) -> Bool { cachedMask[b - first] || comingMask[b - first] }
        var b = first
        while b <= last {
            if taken(b) {
                b += 1
                continue
            }
            var end = b
            while end < last, end - b + 1 < perPart, !taken(end + 1) { end += 1 }
            let start = Int64(b) * Int64(blockSize)
            let length = Int(min(meta.size, Int64(end + 1) * Int64(blockSize)) - start)
            if !budget.tryAcquire(Int64(length)) {
                dropStored()
                guard budget.tryAcquire(Int64(length)) else { return start }
            }
            let flight = newFlight(first: b, last: end, start: start, length: length, readAhead: true)
            if stream.flights.registerIfFree(flight) {
                // Read-ahead outlives the read that asked for it: keep the cache file open.
                stream.cached?.open()
                let reader = ObjectIdentifier(stream)
                transfers.enqueue(for: reader, on: prefetchPool) { [self] in
                    let t0 = now()
                    if flight.claim() {
                        // The slot is given back once the bytes are here, before the cache copy:
                        // the next part's download may start while this thread writes, and a
                        // part's measured time is the link's alone (its cache write counted too).
                        self.execute(flight, stream, isCancelled: nil) { outcome in
                            switch outcome {
                            case .success:
                                self.transfers.release(for: reader, bytes: Int64(flight.length), seconds: now() - t0,
                                                       firstByte: StorageTelemetry.lastFirstByte)
                            case .failure(let e):
                                self.transfers.release(for: reader, bytes: 0, seconds: 0, firstByte: 0, failed: true,
                                                       refused: e.code == .quotaExceeded || e.httpStatus == 503)
                            }
                        }
                    } else {
                        // A reader took it over while it waited for a slot.
                        self.transfers.release(for: reader, bytes: 0, seconds: 0, firstByte: 0, failed: true)
                    }
                    if let c = stream.cached { self.cache?.release(c) }
                    self.retireIfIdle(stream)
                }
            }
            b = end + 1
        }
        return nil
    }

    /// Downloads a flight's bytes, stores them in the cache, then wakes its waiters.
    /// `isCancelled` is the interrupted-check of the reader that made a demand download (nil for
    /// read-ahead); other waiters of a cancelled download make their own. `downloaded` hears
    /// how the download itself ended, before anything is stored.
    private func execute(_ flight: Flight, _ stream: Stream, isCancelled: (@Sendable () -> Bool)?,
                         afterReply: AfterReply? = nil, downloaded: ((Result<Void, StorageError>) -> Void)? = nil) {
        let meta = stream.meta
        let t0 = now()
        var asked = true
        do throws(StorageError) {
            // A file's first read takes the first bytes its lookup asked for, if they are of
            // this generation; the rest (if any) is downloaded.
            var have = 0
            if isCancelled != nil, flight.start == 0, !firstBytes.isEmpty,
               let first = firstBytes.take(meta.name, generation: meta.generation, size: meta.size, wait: 2, isCancelled: isCancelled) {
                have = min(first.count, flight.length)
                let buffer = flight.beginDownload()
                first.withUnsafeBytes { buffer.baseAddress!.copyMemory(from: $0.baseAddress!, byteCount: have) }
            }
            if have < flight.length {
                // The buffer is taken when the first byte arrives: a part waiting for a far
                // server's answer holds budget, not memory (docs/architecture.md, "Adaptive
                // transfers", Buffers taken at the first byte).
                let from = have
                let target = RangeBuffer(count: flight.length - from) {
                    UnsafeMutableRawBufferPointer(rebasing: flight.beginDownload()[from...])
                }
                // Read-ahead has no reader to interrupt it: it ends at unmount.
                try store.read(meta.name, generation: meta.generation, offset: flight.start + Int64(have), into: target,
                               isCancelled: isCancelled ?? { [self] in stopping.load(ordering: .relaxed) })
            } else {
                asked = false
            }
            downloaded?(.success(()))
        } catch {
            downloaded?(.failure(error))
            health.note(error)
            // A reader was given this error: the kernel asks again for the page at once, and
            // that read gets the same answer rather than all of its tries anew.
            if isCancelled != nil, error.code != .cancelled { stream.flights.noteFailure(flight, error) }
            stream.flights.forget(flight)  // the next reader tries afresh
            flight.finish(.failure(error))
            return
        }
        health.noteSuccess()
        // The mount's first download to land says whether the server is near, before its bytes
        // are stored (what is kept in memory depends on it).
        if asked { transfers.noteFirstByte(StorageTelemetry.lastFirstByte) }
        // Which download completes the object is decided under the object's check lock, one
        // download at a time, and a download that does not complete it finishes (may be read)
        // and is listed as unstored under that lock too: the next one to decide counts it, so
        // two downloads can never each leave the completion to the other's cache copy, made
        // after its bytes were served (docs/integrity.md). The one that completes it stores the
        // unstored ones and is checked end to end, still under the lock, before anyone may read
        // its bytes; `beginCheck` makes readers of the cache meanwhile wait for the verdict.
        if let cached = stream.cached {
            let checked = stream.flights.deciding { () -> Bool in
                guard cached.awaitsCheck else {
                    flight.finish(.success(()))
                    return false
                }
                let others = stream.flights.unstored(except: flight)
                guard cached.wouldComplete([flight.firstBlock...flight.lastBlock] + others.map { $0.firstBlock...$0.lastBlock }) else {
                    flight.finish(.success(()))
                    stream.flights.noteUnstored(flight)
                    return false
                }
                // Checked from memory first: the CRC32Cs of its bytes and of the others' with
                // the index's. When they match it finishes and is stored like any download,
                // after its readers have it, and the others' copies are left to their own
                // threads: no reader waits for a disk write (docs/integrity.md). The index
                // is checked again once the copies are made.
                let pending = ([flight] + others).map { (first: $0.firstBlock, bytes: UnsafeRawBufferPointer($0.buffer)) }
                if cached.matchesBeforeStoring(pending) == true {
                    flight.finish(.success(()))
                    stream.flights.noteUnstored(flight)
                    return false
                }
                cached.beginCheck()
                for other in others { cached.store(first: other.firstBlock, UnsafeRawBufferPointer(other.buffer)) }
                let outcome = completeAndCheck(flight, stream, cached, isCancelled: isCancelled)
                cached.endCheck()
                if case .failure = outcome { stream.flights.forget(flight) }
                flight.finish(outcome)
                if case .success = outcome, cached.cachedBytes(from: flight.start, upTo: flight.end) == flight.length {
                    stream.flights.forget(flight)  // readers take the bytes from the cache
                } else if flight.markStored() {
                    stream.flights.forget(flight)  // its cache copy is made: memory may let it go
                }
                return true
            }
            if checked { return }
        } else {
            flight.finish(.success(()))
        }
        // Waiters copy from the buffer at once; the disk copy is made afterwards (the buffer
        // lives as long as this call holds the flight). The flight stays registered until a
        // reader has copied its last block, or memory runs short.
        Log.trace("op=fetch object=\(meta.name) offset=\(flight.start) bytes=\(flight.length) get_us=\(Int((now() - t0) * 1e6))")
        if isCancelled != nil {
            // A reader made this download and is waiting to reply: the cache copy is written
            // after that reply, by the same thread when it can wait (a hand-off to another
            // thread costs a wake-up here), else on a prefetch thread.
            // It keeps the cache file open: the reader may close its file before this runs.
            stream.cached?.open()
            let store: @Sendable () -> Void = { [self] in
                self.storeToCache(flight, stream)
                if let c = stream.cached { self.cache?.release(c) }
                self.retireIfIdle(stream)
            }
            if let afterReply { afterReply.add(store) } else { prefetchPool.submit(store) }
        } else if config.cacheWrites == .keepUp, let cached = stream.cached {
            // Read-ahead, keep_up: the writer thread makes the cache copy, and this thread is
            // free for the next download. When the writer is behind, this thread waits for room
            // as long as 2 × `parallel` downloads like this one take (a disk at an eighth of the
            // network's speed still gets every part, the downloads slowed to its pace); after
            // that the part goes uncached. Measured (1 GiB, sleeps added to the cache writes to
            // mimic a 128 MB/s disk): reads at 125 MB/s with `all`, ~540 MB/s with this, 24% cached.
            cached.open()
            let patience = (now() - t0) * Double(2 * max(1, config.parallel))
            let queued = writer.submit(bytes: Int64(flight.length), patience: patience) { [self] in
                self.storeToCache(flight, stream)
                self.cache?.release(cached)
                self.retireIfIdle(stream)
            }
            if !queued {
                cache?.release(cached)
                stream.flights.stored(flight)  // never cached: nothing to count on
                if flight.markStored() { stream.flights.forget(flight) }
            }
        } else {
            // Read-ahead, all (the default): this thread writes the copy before its next
            // download, so reads go no faster than the disk writes.
            let downloaded = now()
            storeToCache(flight, stream)
            noteSlowCacheWrite(download: downloaded - t0, write: now() - downloaded)
        }
    }

    /// Says once per mount when cache writes, not downloads, set the pace of read-ahead.
    private func noteSlowCacheWrite(download: Double, write: Double) {
        guard cache != nil, write > 0.05, write > 2 * download, !slowWritesNoted.exchange(true, ordering: .relaxed) else { return }
        Log.warn("writing read-ahead to the cache took \(Int(write * 1000)) ms against \(Int(download * 1000)) ms to download it: "
                 + "the disk under cache_dir sets the read speed; -o cache_writes=keep_up keeps reads at the network's speed")
    }

    /// Stores a download that completes the object and checks the object end to end. On a
    /// mismatch every cached block is dropped, finished downloads of the object are let go (they
    /// may hold the bad bytes) and the whole object is fetched again; the flight then holds the
    /// bytes of that second download. It fails (EIO) when the second download does not match
    /// either, and when it shows that a block outside this flight, which readers may already
    /// have been given, was wrong: never silently wrong bytes (docs/integrity.md).
    private func completeAndCheck(_ flight: Flight, _ stream: Stream, _ cached: CachedObject,
                                  isCancelled: (@Sendable () -> Bool)?) -> Result<Void, StorageError> {
        guard case .mismatch(let previous) = cached.storeAndCheck(first: flight.firstBlock, UnsafeRawBufferPointer(flight.buffer)) else {
            return .success(())
        }
        stream.flights.dropFinished()
        let meta = stream.meta
        let part = Int64(max(config.partSize, Int64(blockSize)))
        let scratch = UnsafeMutableRawBufferPointer.allocate(byteCount: Int(min(part, meta.size)), alignment: 4096)
        defer { scratch.deallocate() }
        var last = CachedObject.Completion.incomplete
        var servedWrong: [Int] = []
        var notedWrong = false
        var offset: Int64 = 0
        while offset < meta.size {
            let length = Int(min(part, meta.size - offset))
            let window = UnsafeMutableRawBufferPointer(rebasing: scratch[0..<length])
            do throws(StorageError) {
                try store.read(meta.name, generation: meta.generation, offset: offset, into: window, isCancelled: isCancelled)
            } catch {
                // The object did not match and nothing tells which bytes served were right.
                cached.noteServedWrong()
                return .failure(error)
            }
            // Which blocks differ from what was cached (and so perhaps served) before?
            let firstBlock = Int(offset / Int64(blockSize))
            var at = 0
            while at < length {
                let n = min(blockSize, length - at)
                let b = firstBlock + at / blockSize
                let crc = Checksum.crc32c(UnsafeRawBufferPointer(rebasing: window[at..<(at + n)]))
                if b < previous.count, crc != previous[b], !(flight.firstBlock...flight.lastBlock).contains(b) { servedWrong.append(b) }
                at += n
            }
            // Open files learn it before the right bytes are cached: a reader that finds them
            // there (the FUSE thread's cache hits) must not finish a read of which earlier
            // parts were wrong.
            if !servedWrong.isEmpty && !notedWrong {
                cached.noteServedWrong()
                notedWrong = true
            }
            // The flight's own bytes come from this download now.
            let from = max(offset, flight.start), to = min(offset + Int64(length), flight.end)
            if from < to {
                UnsafeMutableRawBufferPointer(rebasing: flight.buffer[Int(from - flight.start)..<Int(to - flight.start)])
                    .copyMemory(from: UnsafeRawBufferPointer(rebasing: window[Int(from - offset)..<Int(to - offset)]))
            }
            last = cached.storeAndCheck(first: firstBlock, UnsafeRawBufferPointer(window))
            offset += Int64(length)
        }
        let object = "gs://\(meta.bucket)/\(meta.name) generation \(meta.generation)"
        if case .mismatch = last {
            // Nothing can tell which earlier bytes were right: every open file of it fails on.
            cached.noteServedWrong()
            return .failure(StorageError(.checksumMismatch, "\(object) does not match its crc32c, downloaded twice"))
        }
        if !servedWrong.isEmpty {
            Log.error("op=verify object=\(meta.name) gen=\(meta.generation) crc32c mismatch: \(servedWrong.count) block(s) from offset \(Int64(servedWrong[0]) * Int64(blockSize)) were wrong when first downloaded and may have been read; this read fails so the reader knows, the object is now cached right")
            return .failure(StorageError(.checksumMismatch, "\(object): bytes read earlier did not match its crc32c"))
        }
        Log.info("op=verify object=\(meta.name) gen=\(meta.generation) fetched again after a crc32c mismatch: \(last == .verified ? "now matches" : "could not be checked again (cache full)")")
        return .success(())
    }

    /// Writes the flight's cache copy. A reader's own miss is let go once its bytes are cached
    /// (its reader has them; readers after it take them from the cache). Read-ahead stays
    /// until its reader has copied it to its end, the file is closed by all, or memory runs
    /// short (`dropStored`): the reader then copies from memory, or replies from it, not from
    /// the cache file with a CRC check of every block, a copy and a checksum pass per byte.
    /// Near the server the daemon's CPU sets the pace; far from it too, on a machine that is
    /// busy (docs/architecture.md, "Adaptive transfers": Kept in memory). A reader's window
    /// bounds what it keeps, and parts in flight take memory from kept parts first.
    private func storeToCache(_ flight: Flight, _ stream: Stream) {
        if let cached = stream.cached {
            // The disk write outside the object's check lock, the check under it: never beside
            // a completing download's check (which could then find only dropped blocks).
            cached.store(first: flight.firstBlock, UnsafeRawBufferPointer(flight.buffer), ahead: flight.isReadAhead)
            stream.flights.stored(flight)
            if case .mismatch = stream.flights.deciding({ cached.checkIfComplete() }) {
                // Completed by a write made after its bytes were served (a cache copy written
                // after the reply): nothing of it stays, readers fetch again, and the next read
                // fails once so that a reader of the wrong bytes hears of it.
                stream.flights.forget(flight)
                stream.flights.dropFinished()
                cached.noteServedWrong()
                return
            }
            if !flight.isReadAhead, cached.cachedBytes(from: flight.start, upTo: flight.end) == flight.length {
                stream.flights.forget(flight)
                return
            }
        }
        // Closed by all meanwhile: nobody will read it (the close let go of finished flights).
        if flight.markStored() || !isOpen(stream) { stream.flights.forget(flight) }
    }
}

/// Work a reader's thread does once it has replied (see `Filesystem.read`).
public final class AfterReply: @unchecked Sendable {
    private var work: [@Sendable () -> Void] = []

    public init() {}

    func add(_ job: @escaping @Sendable () -> Void) { work.append(job) }

    /// Runs what was collected; the thread that made the reads calls it, once.
    public func run() {
        for job in work { job() }
        work.removeAll()
    }
}

/// The flights of one object generation. A flight covers a run of blocks; a block's flight is
/// the latest registered one that covers it.
final class FlightTable: Sendable {
    private struct Entries: ~Copyable {
        /// Each registered flight once, oldest first. They are few (the parts in flight and the
        /// finished ones not read yet), while their blocks are many (16 KiB blocks: an 8 MiB
        /// part is 512), so a lookup walks the flights: a table by block cost a hash and a probe
        /// per block of every read-ahead window, on every read (4% of the daemon's CPU).
        var flights: [Flight] = []

        func covering(_ block: Int) -> Flight? {
            flights.last { $0.firstBlock <= block && block <= $0.lastBlock }
        }

        func overlaps(_ blocks: ClosedRange<Int>) -> Bool {
            flights.contains { $0.firstBlock <= blocks.upperBound && blocks.lowerBound <= $0.lastBlock }
        }

        mutating func add(_ flight: Flight) { flights.append(flight) }

        mutating func remove(_ flight: Flight) { flights.removeAll { $0 === flight } }
    }

    private let entries = Mutex(Entries())
    /// Downloads that finished without completing their object, until their cache copy is
    /// made: kept apart from `entries`, which lets finished flights go (memory, close).
    private let pendingStores = Mutex<[Flight]>([])
    /// Taken to decide which download completes the object and while it is checked, and for
    /// the check after a later cache copy (`BlockReader.execute`, `storeToCache`).
    private let checkLock = NSLock()

    func deciding<T>(_ body: () -> T) -> T {
        checkLock.lock()
        defer { checkLock.unlock() }
        return body()
    }

    func flight(for block: Int) -> Flight? { entries.withLock { $0.covering(block) } }

    /// Registers `flight` unless `block` already has one (returned instead).
    func register(_ flight: Flight, orExistingFor block: Int) -> Flight? {
        entries.withLock { e in
            if let raced = e.covering(block) { return raced }
            e.add(flight)
            return nil
        }
    }

    /// Registers `flight` if none of its blocks has a flight yet.
    func registerIfFree(_ flight: Flight) -> Bool {
        entries.withLock { e in
            if e.overlaps(flight.firstBlock...flight.lastBlock) { return false }
            e.add(flight)
            return true
        }
    }

    /// For each block of `blocks`: does a flight bring it?
    func coveredMask(_ blocks: ClosedRange<Int>) -> [Bool] {
        var mask = [Bool](repeating: false, count: blocks.count)
        entries.withLock { e in
            for f in e.flights where f.firstBlock <= blocks.upperBound && blocks.lowerBound <= f.lastBlock {
                for b in max(f.firstBlock, blocks.lowerBound)...min(f.lastBlock, blocks.upperBound) {
                    mask[b - blocks.lowerBound] = true
                }
            }
        }
        return mask
    }

    func forget(_ flight: Flight) {
        entries.withLock { $0.remove(flight) }
    }

    var isEmpty: Bool { entries.withLock { $0.flights.isEmpty } && pendingStores.withLock { $0.isEmpty } }

    /// How long a reader's failed download answers new reads of its blocks with its error.
    /// The kernel reads a page again, synchronously, when a read of it failed: without this
    /// that second read made all its tries anew (up to `request_timeout` more) while the
    /// bucket answered other requests, so a `read` took twice the bound (test_faults.py,
    /// trickling media). A read a second later tries afresh.
    static let failureMemory = 1.0
    private let lastFailure = Mutex<(blocks: ClosedRange<Int>, error: StorageError, at: Double)?>(nil)

    func noteFailure(_ flight: Flight, _ error: StorageError) {
        lastFailure.withLock { $0 = (flight.firstBlock...flight.lastBlock, error, now()) }
    }

    func recentFailure(covering block: Int) -> StorageError? {
        lastFailure.withLock { f in
            guard let last = f, last.blocks.contains(block), now() - last.at < Self.failureMemory else { return nil }
            return last.error
        }
    }

    /// Downloads other than `flight` that finished with their bytes and whose cache copy is
    /// not made yet (the buffer is in memory until it is).
    func unstored(except flight: Flight) -> [Flight] { pendingStores.withLock { $0.filter { $0 !== flight } } }

    func noteUnstored(_ flight: Flight) { pendingStores.withLock { $0.append(flight) } }

    /// Its cache copy is made (or will never be).
    func stored(_ flight: Flight) { pendingStores.withLock { $0.removeAll { $0 === flight } } }

    /// Lets go of every finished flight (the object was found wrong, or closed by all).
    func dropFinished() {
        entries.withLock { e in
            for flight in e.flights where flight.finished != nil { e.remove(flight) }
        }
    }

    /// Lets go of the finished flights whose cache copy is made or skipped (memory runs short).
    /// One that waits for its cache write stays: the thread that writes it holds it (and its
    /// budget) until the write ends, when it leaves by itself if its bytes are cached. Letting
    /// it go freed nothing and left its bytes neither here nor in the cache yet, so the
    /// reader right behind fetched them again (test_link.py, a loaded 2-core machine).
    func dropStored() {
        entries.withLock { e in
            for flight in e.flights where flight.isFinishedAndStored { e.remove(flight) }
        }
    }
}

/// The kernel's largest FUSE request here (max_pages 256): the most one read asks for.
public enum FuseLimits {
    public static let maxRequest = 1 << 20
}
