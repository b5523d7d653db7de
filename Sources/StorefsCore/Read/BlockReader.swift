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
/// memory budget. Every download is pinned to the generation seen at open.
public final class BlockReader: Sendable {
    public struct Config: Sendable {
        public var blockSize: Int
        public var readAhead: Int64
        public var parallel: Int
        public var partSize: Int64
        public var memoryLimit: Int64

        public init(blockSize: Int = 64 << 10, readAhead: Int64 = 64 << 20, parallel: Int = 4,
                    partSize: Int64 = 8 << 20, memoryLimit: Int64 = 256 << 20) {
            self.blockSize = blockSize
            self.readAhead = readAhead
            self.parallel = parallel
            self.partSize = partSize
            self.memoryLimit = memoryLimit
        }
    }

    public let config: Config
    let store: ObjectStore
    let cache: BlockCache?
    /// Part of the cache key: the same bucket name at two endpoints is two buckets.
    let endpoint: String
    let budget: MemoryBudget
    let buffers: FlightBufferPool
    private let flights = Mutex([FlightKey: Flight]())
    private let pool = Mutex<WorkerPool?>(nil)

    struct FlightKey: Hashable {
        var object: String
        var generation: Int64
        var block: Int
    }

    public init(store: ObjectStore, cache: BlockCache?, endpoint: String, config: Config) {
        self.store = store
        self.cache = cache
        self.endpoint = endpoint
        self.config = config
        budget = MemoryBudget(limit: config.memoryLimit)
        let part = Int(max(config.partSize, Int64(config.blockSize)))
        buffers = FlightBufferPool(regionSize: max(part, FuseLimits.maxRequest + config.blockSize),
                                   keep: max(2, min(config.parallel * 2, Int(config.memoryLimit) / part)))
    }

    /// Prefetch threads start on first use, after the daemon has forked.
    private var prefetchPool: WorkerPool {
        pool.withLock { p in
            if p == nil { p = WorkerPool(threads: max(1, config.parallel), name: "storefs-prefetch") }
            return p!
        }
    }

    /// Waits for read-ahead and cache writes under way (unmount): what was read before an
    /// unmount is in the cache after it.
    public func finishPendingWork(timeout: Double) {
        let pool = pool.withLock { $0 }
        if let pool, !pool.drain(timeout: timeout) {
            Log.warn("unmount: read-ahead and cache writes still running after \(Int(timeout))s; leaving them")
        }
    }

    /// Per-open-file state: the generation's cache entry and the sequential detector.
    final class Stream: Sendable {
        let meta: ObjectMetadata
        let cached: CachedObject?
        let detector: Mutex<Prefetcher>

        init(meta: ObjectMetadata, cached: CachedObject?, detector: Prefetcher) {
            self.meta = meta
            self.cached = cached
            self.detector = Mutex(detector)
        }
    }

    func openStream(_ meta: ObjectMetadata) -> Stream {
        let cached = meta.size > 0 ? cache?.acquire(endpoint: endpoint, meta: meta) : nil
        let minWindow = min(config.partSize, config.readAhead)
        return Stream(meta: meta, cached: cached, detector: Prefetcher(minWindow: minWindow, maxWindow: config.readAhead))
    }

    func closeStream(_ stream: Stream) {
        dropFinished(of: stream.meta)
        if let c = stream.cached { cache?.release(c) }
    }

    private var blockSize: Int { config.blockSize }

    private func blockLength(_ meta: ObjectMetadata, _ block: Int) -> Int {
        Int(min(Int64(blockSize), meta.size - Int64(block) * Int64(blockSize)))
    }

    /// Notes the read for read-ahead and serves it if every block is cached; false on a miss.
    /// Never touches the network: safe on a FUSE thread.
    func readCached(_ stream: Stream, at offset: Int64, into dst: UnsafeMutableRawBufferPointer) -> Bool {
        observe(stream, offset: offset, count: dst.count)
        var pos = offset
        let end = offset + Int64(dst.count)
        while pos < end {
            let block = Int(pos / Int64(blockSize))
            let inBlock = Int(pos - Int64(block) * Int64(blockSize))
            let take = Int(min(end - pos, Int64(blockLength(stream.meta, block) - inBlock)))
            let out = UnsafeMutableRawBufferPointer(rebasing: dst[Int(pos - offset)..<(Int(pos - offset) + take)])
            if copyFromFinishedFlight(stream, block: block, inBlock: inBlock, into: out) {
                pos += Int64(take)
                continue
            }
            guard let cached = stream.cached, cached.read(block: block, from: inBlock, into: out) else { return false }
            pos += Int64(take)
        }
        return true
    }

    /// A sequential reader usually arrives just after its read-ahead landed: it copies from the
    /// download's buffer (no disk read, no second CRC pass). The download is let go once its
    /// last block has been read.
    private func copyFromFinishedFlight(_ stream: Stream, block: Int, inBlock: Int, into out: UnsafeMutableRawBufferPointer) -> Bool {
        let key = FlightKey(object: stream.meta.name, generation: stream.meta.generation, block: block)
        guard let flight = flights.withLock({ $0[key] }), case .success? = flight.finished else { return false }
        let at = (block - flight.firstBlock) * blockSize + inBlock
        out.copyMemory(from: UnsafeRawBufferPointer(rebasing: flight.buffer[at..<(at + out.count)]))
        if block == flight.lastBlock && inBlock + out.count == blockLength(stream.meta, block), flight.markConsumed() {
            forget(flight, stream.meta)
        }
        return true
    }

    private func forget(_ flight: Flight, _ meta: ObjectMetadata) {
        flights.withLock { f in
            for k in flight.firstBlock...flight.lastBlock {
                let key = FlightKey(object: meta.name, generation: meta.generation, block: k)
                if f[key] === flight { f.removeValue(forKey: key) }
            }
        }
    }

    /// Lets go of finished read-ahead nobody has read yet (memory budget pressure, close).
    private func dropFinished(of meta: ObjectMetadata? = nil) {
        flights.withLock { f in
            for (key, flight) in f where flight.finished != nil && (meta == nil || (key.object == meta!.name && key.generation == meta!.generation)) {
                f.removeValue(forKey: key)
            }
        }
    }

    /// Serves the read, downloading what is missing. `observed` is true when `readCached`
    /// already recorded this read for read-ahead.
    func read(_ stream: Stream, at offset: Int64, into dst: UnsafeMutableRawBufferPointer, observed: Bool,
              isCancelled: (@Sendable () -> Bool)?) throws(StorageError) {
        if !observed { observe(stream, offset: offset, count: dst.count) }
        let meta = stream.meta
        var pos = offset
        let end = offset + Int64(dst.count)
        while pos < end {
            let block = Int(pos / Int64(blockSize))
            let inBlock = Int(pos - Int64(block) * Int64(blockSize))
            let take = Int(min(end - pos, Int64(blockLength(meta, block) - inBlock)))
            let out = UnsafeMutableRawBufferPointer(rebasing: dst[Int(pos - offset)..<(Int(pos - offset) + take)])
            if let cached = stream.cached, cached.read(block: block, from: inBlock, into: out) {
                pos += Int64(take)
                continue
            }
            let lastBlock = Int((end - 1) / Int64(blockSize))
            let (flight, mine) = try flightFor(stream, block: block, through: lastBlock, isCancelled: isCancelled)
            if mine { execute(flight, stream, isCancelled: isCancelled ?? { false }) }
            guard let outcome = flight.wait(isCancelled: isCancelled) else {
                throw StorageError(.cancelled, "read interrupted")
            }
            switch outcome {
            case .success:
                let at = (block - flight.firstBlock) * blockSize + inBlock
                out.copyMemory(from: UnsafeRawBufferPointer(rebasing: flight.buffer[at..<(at + take)]))
                if block == flight.lastBlock, flight.markConsumed() { forget(flight, meta) }
                pos += Int64(take)
            case .failure(let error):
                // Someone else's download was cancelled: make our own on the next turn.
                if error.code == .cancelled && !mine { continue }
                throw error
            }
        }
    }

    private func observe(_ stream: Stream, offset: Int64, count: Int) {
        let ahead = stream.detector.withLock { $0.observe(offset: offset, count: count, size: stream.meta.size) }
        if let ahead { schedule(stream, ahead) }
    }

    /// The flight that will bring `block`: an existing one, or a new demand download of the
    /// run of missing blocks from `block` through at most `lastBlock`.
    private func flightFor(_ stream: Stream, block: Int, through lastBlock: Int,
                           isCancelled: (@Sendable () -> Bool)?) throws(StorageError) -> (Flight, Bool) {
        let meta = stream.meta
        let key = FlightKey(object: meta.name, generation: meta.generation, block: block)
        if let existing = flights.withLock({ $0[key] }) { return (existing, false) }
        var last = block
        while last < lastBlock, !(stream.cached?.isCached(last + 1) ?? false),
              flights.withLock({ $0[FlightKey(object: meta.name, generation: meta.generation, block: last + 1)] }) == nil {
            last += 1
        }
        let start = Int64(block) * Int64(blockSize)
        let length = Int(min(meta.size, Int64(last + 1) * Int64(blockSize)) - start)
        guard budget.acquire(Int64(length), isCancelled: isCancelled) else {
            throw StorageError(.cancelled, "read interrupted while waiting for memory")
        }
        let flight = Flight(firstBlock: block, blockCount: last - block + 1, start: start, length: length, budget: budget, pool: buffers)
        let winner: Flight = flights.withLock { f in
            if let raced = f[key] { return raced }
            for b in block...last { f[FlightKey(object: meta.name, generation: meta.generation, block: b)] = flight }
            return flight
        }
        return (winner, winner === flight)
    }

    /// Schedules read-ahead downloads for the bytes in `range`, in parts, skipping blocks that
    /// are cached or already coming; stops where the memory budget is used up.
    private func schedule(_ stream: Stream, _ range: Range<Int64>) {
        let meta = stream.meta
        let first = Int(range.lowerBound / Int64(blockSize))
        let last = Int((range.upperBound - 1) / Int64(blockSize))
        let perPart = max(1, Int(config.partSize / Int64(blockSize)))
        var b = first
        while b <= last {
            if stream.cached?.isCached(b) ?? false
                || flights.withLock({ $0[FlightKey(object: meta.name, generation: meta.generation, block: b)] }) != nil {
                b += 1
                continue
            }
            var end = b
            while end < last, end - b + 1 < perPart, !(stream.cached?.isCached(end + 1) ?? false),
                  flights.withLock({ $0[FlightKey(object: meta.name, generation: meta.generation, block: end + 1)] }) == nil {
                end += 1
            }
            let start = Int64(b) * Int64(blockSize)
            let length = Int(min(meta.size, Int64(end + 1) * Int64(blockSize)) - start)
            if !budget.tryAcquire(Int64(length)) {
                dropFinished()
                guard budget.tryAcquire(Int64(length)) else { return }
            }
            let flight = Flight(firstBlock: b, blockCount: end - b + 1, start: start, length: length, budget: budget, pool: buffers)
            let registered: Bool = flights.withLock { f in
                for k in b...end where f[FlightKey(object: meta.name, generation: meta.generation, block: k)] != nil { return false }
                for k in b...end { f[FlightKey(object: meta.name, generation: meta.generation, block: k)] = flight }
                return true
            }
            if registered {
                // Read-ahead outlives the read that asked for it: keep the cache file open.
                stream.cached?.open()
                prefetchPool.submit { [self] in
                    self.execute(flight, stream, isCancelled: nil)
                    if let c = stream.cached { self.cache?.release(c) }
                }
            }
            b = end + 1
        }
    }

    /// Downloads a flight's bytes, stores them in the cache, then wakes its waiters.
    /// `isCancelled` is the interrupted-check of the reader that made a demand download (nil for
    /// read-ahead); other waiters of a cancelled download make their own.
    private func execute(_ flight: Flight, _ stream: Stream, isCancelled: (@Sendable () -> Bool)?) {
        let meta = stream.meta
        let t0 = now()
        do throws(StorageError) {
            try store.read(meta.name, generation: meta.generation, offset: flight.start, into: flight.buffer,
                           isCancelled: isCancelled)
        } catch {
            forget(flight, meta)  // the next reader tries afresh
            flight.finish(.failure(error))
            return
        }
        // Waiters copy from the buffer at once; the disk copy is made afterwards (the buffer
        // lives as long as this call holds the flight). The flight stays registered until a
        // reader has copied its last block, or memory runs short.
        flight.finish(.success(()))
        Log.trace("op=fetch object=\(meta.name) offset=\(flight.start) bytes=\(flight.buffer.count) get_us=\(Int((now() - t0) * 1e6))")
        if isCancelled != nil {
            // A reader made this download and is waiting to reply: write the cache copy on a
            // prefetch thread instead of in front of that reply.
            // It keeps the cache file open: the reader may close its file before this runs.
            stream.cached?.open()
            prefetchPool.submit { [self] in
                self.storeToCache(flight, stream)
                if let c = stream.cached { self.cache?.release(c) }
            }
        } else {
            storeToCache(flight, stream)
        }
    }

    private func storeToCache(_ flight: Flight, _ stream: Stream) {
        stream.cached?.store(first: flight.firstBlock, UnsafeRawBufferPointer(flight.buffer))
        if flight.markStored() { forget(flight, stream.meta) }
    }
}

extension Result {
    var isSuccess: Bool {
        if case .success = self { return true }
        return false
    }
}

/// The kernel's largest FUSE request here (max_pages 256): the most one read asks for.
public enum FuseLimits {
    public static let maxRequest = 1 << 20
}
