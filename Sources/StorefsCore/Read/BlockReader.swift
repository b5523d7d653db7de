import Foundation
import StorageClient
import Synchronization
import Locking

/// The read path below a file handle, one file per step (docs/architecture.md, "The data path"):
///
/// - `DemandRead.swift`: `read`, the one entry point. A read of `[offset, offset+n)` walks its
///   blocks: cached blocks are copied out after their CRC32C check, landed downloads are copied
///   (or lent to the reply), and with `Network.allowed` a missing block is taken from a
///   download in flight or a new download of the run of missing blocks, made on the calling
///   thread. The read returns a `ReadReply` (ReadReply.swift); it never replies itself.
/// - `ReadAhead.swift`: sequential streams (`Prefetcher`) schedule read-ahead downloads of
///   `partSize` on the prefetch threads, as many at once as `TransferController` allows,
///   within the memory budget, and warm cached runs ahead of their reader.
/// - `Downloads.swift`: a download (`Flight`) runs, lands, and gets its cache copy: a reader's
///   own after its reply, read-ahead's on its thread (or the `CacheWriter` with
///   `cache_writes=keep_up`). Every download is pinned to the generation seen at open.
/// - `FlightTable.swift`: the downloads of one object generation, shared by its readers.
/// - `ObjectIntegrity.swift`: the whole-object crc32c check (docs/integrity.md).
/// - `OpenStream.swift`: what one open file holds (`Stream`).
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
        /// The most one read asks for: the kernel's largest FUSE request (the adapter's
        /// `FuseSession.maxRequestSize`), which sizes readers' own download buffers.
        public var maxRequest = 1 << 20
        /// A file at most this large is fetched whole by its first read that misses, with one
        /// request, and has no read-ahead: a small file costs one round trip however the
        /// kernel splits its reads (docs/architecture.md, "Small files"). 0: never.
        public var wholeObjectLimit: Int64

        public init(blockSize: Int = 16 << 10, readAhead: Int64 = 64 << 20, parallel: Int = 4,
                    partSize: Int64 = 8 << 20, memoryLimit: Int64 = 256 << 20, writeBacklog: Int64? = nil,
                    cacheWrites: CacheWrites = .all, adaptive: Bool = false,
                    wholeObjectLimit: Int64 = BlockReader.defaultWholeObjectLimit) {
            self.wholeObjectLimit = wholeObjectLimit
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
    /// `Config.wholeObjectLimit`'s default, chosen by measurement: through the `wan` link model,
    /// files of 2 and 4 MiB fetched whole were read faster than in parts by 1 and by 16 readers,
    /// 8 MiB slower by one (docs/experiments.md, "2026-12-07: whole_file's default, files fetched whole up to 4 MiB").
    public static let defaultWholeObjectLimit: Int64 = 4 << 20
    let store: ObjectStore
    /// How the store's connections may be steered, where it pools them (the HTTP stores).
    let tuning: (any ConnectionTuning)?
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
    let slowWritesNoted = Atomic<Bool>(false)
    /// Set at unmount (`finishPendingWork`): read-ahead under way ends as if interrupted, so
    /// no download retries on past the mount (its transfer within about a second, its
    /// retry waits at once); finished downloads still get their cache copy.
    let stopping = Atomic<Bool>(false)
    /// The downloads in flight (or finished and not yet read), per object generation, in
    /// shards by the object's hash, each under a lock of its own (`FlightTables`).
    let flightTables = (0..<FlightTables.shards).map { _ in FlightTables() }

    /// One shard of `flightTables`. Under one lock for all, 16 threads reading small files
    /// (an open, a close and a retirement each per file) spun for it in `Mutex`'s slow path:
    /// 6% of the daemon's CPU, gone with 16 shards (docs/experiments.md, "2026-12-07, evening").
    final class FlightTables: Sendable {
        static let shards = 16
        let entries = OrderedMutex(.flightTables, [ObjectKey: (table: FlightTable, streams: Int)]())
    }

    func tables(_ key: ObjectKey) -> FlightTables {
        flightTables[Int(UInt(bitPattern: key.hashValue) % UInt(FlightTables.shards))]
    }
    /// The daemon's threads (`WorkerPools`): read-ahead runs on `prefetch`, connections are
    /// opened ahead on `connect`, first bytes are asked on `probe`.
    let pools: WorkerPools
    /// Openings of connections ahead queued and not yet under way (`openConnectionsAhead`).
    let connectionsQueued = OrderedMutex(.connectionsQueued, 0)
    /// First bytes asked for beside lookups, for the first read of the file to take.
    let firstBytes = FirstBytesTable()

    struct ObjectKey: Hashable {
        var object: ByteName
        var generation: Int64
    }

    /// `pools`: the daemon's threads; by default pools of its own (tests).
    public convenience init(store: ObjectStore, cache: BlockCache?, endpoint: String, config: Config,
                            health: BucketHealth = BucketHealth(), pools: WorkerPools = WorkerPools()) {
        self.init(store: store, cache: cache, endpoint: endpoint, config: config,
                  writer: CacheWriter(maxBacklog: config.writeBacklog, pool: pools.cacheWrites), health: health, pools: pools)
    }

    init(store: ObjectStore, cache: BlockCache?, endpoint: String, config: Config, writer: CacheWriter,
         health: BucketHealth = BucketHealth(), pools: WorkerPools = WorkerPools()) {
        self.pools = pools
        self.health = health
        self.store = store
        self.tuning = store as? any ConnectionTuning
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
            fixedParts: config.adaptive ? nil : config.parallel), fastestAnswer: { [tuning] in tuning?.fastestFirstByte })
        // Regions as large as the largest part: a grown part never takes a mapping of its own
        // beside the recycled ones (only the pages a part touches become resident).
        let part = Int(max(maxPartSize, Int64(config.blockSize)))
        let request = config.maxRequest + config.blockSize
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
    func newFlight(first: Int, last: Int, start: Int64, length: Int, readAhead: Bool = false, wholeObject: Bool = false,
                   probe: BucketHealth.Probe? = nil) -> Flight {
        let pool = length <= requestBuffers.regionSize ? requestBuffers : buffers
        return Flight(firstBlock: first, blockCount: last - first + 1, start: start, length: length, isReadAhead: readAhead,
                      keptUntilRead: readAhead || wholeObject, budget: budget, pool: pool, probe: probe)
    }

    /// Prefetch threads start on first use, after the daemon has forked. A thread writes its
    /// part's cache copy before its next download, and the part's slot is free meanwhile. Twice
    /// `nearMaxParts` (the most that run near the server): there the threads bound the parts
    /// that wait in memory for their cache write (docs/architecture.md, "Threads": 16 threads
    /// rather than 32 took one cold reader on loopback from a median of 115 to 84 MiB of peak
    /// RSS, at the same speed). A count of parts past that (far links only) has `nearMaxParts`
    /// threads more than parts, for their writes.
    var prefetchPool: WorkerPool {
        let near = transfers.limits.nearMaxParts, parts = transfers.parts
        let threads = !config.adaptive ? config.parallel : parts > 2 * near ? parts + near : 2 * near
        pools.prefetch.grow(to: max(1, threads))
        return pools.prefetch
    }

    /// Waits for read-ahead and cache writes under way (unmount): what was read before an
    /// unmount is in the cache after it.
    public func finishPendingWork(timeout: Double) {
        stopping.store(true, ordering: .relaxed)
        // Downloads first: each one may queue a cache write.
        if !pools.prefetch.drain(timeout: timeout) {
            Log.warn("unmount: read-ahead and cache writes still running after \(Int(timeout))s; leaving them")
        } else if !writer.drain(timeout: timeout) {
            Log.warn("unmount: cache writes still running after \(Int(timeout))s; leaving them")
        }
    }


    func openStream(_ meta: ObjectMetadata) -> Stream {
        let cached = meta.size > 0 ? cache?.acquire(endpoint: endpoint, meta: meta) : nil
        let minWindow = min(config.partSize, config.readAhead, config.initialWindow)
        let key = ObjectKey(object: ByteName(meta.name), generation: meta.generation)
        let table = tables(key).entries.withLock { t -> FlightTable in
            let entry = t[key] ?? (FlightTable(), 0)
            t[key] = (entry.table, entry.streams + 1)
            return entry.table
        }
        return Stream(meta: meta, cached: cached, flights: table,
                      detector: ReadStreams(minWindow: minWindow, maxWindow: config.readAhead))
    }

    func closeStream(_ stream: Stream) {
        let key = ObjectKey(object: ByteName(stream.meta.name), generation: stream.meta.generation)
        let last = tables(key).entries.withLock { t -> Bool in
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
    func isOpen(_ stream: Stream) -> Bool {
        let key = ObjectKey(object: ByteName(stream.meta.name), generation: stream.meta.generation)
        return tables(key).entries.withLock { t in t[key].map { $0.streams > 0 && $0.table === stream.flights } ?? false }
    }

    /// Forgets an object's flight table once no file has it open and no download is left in it.
    func retireIfIdle(_ stream: Stream) {
        let key = ObjectKey(object: ByteName(stream.meta.name), generation: stream.meta.generation)
        tables(key).entries.withLock { t in
            if let entry = t[key], entry.streams <= 0, entry.table === stream.flights, entry.table.isEmpty {
                t.removeValue(forKey: key)
            }
        }
    }

    var blockSize: Int { config.blockSize }

    func blockLength(_ meta: ObjectMetadata, _ block: Int) -> Int {
        Int(min(Int64(blockSize), meta.size - Int64(block) * Int64(blockSize)))
    }
}

extension BlockReader {
    /// The read path's gauges: the block cache, memory in flight, read-ahead.
    func report(into g: inout Gauges) {
        if let cache {
            g.cacheDirectory = cache.directory
            g.cacheUsedBytes = cache.usedBytes
            g.cacheCapacityBytes = cache.capacity
            g.cacheObjects = cache.objectCount
            g.cachePaused = cache.isDegraded
        }
        g.inFlightBytes = budget.inUse
        g.memoryLimitBytes = config.memoryLimit
        g.readAheadBytes = config.readAhead
        g.parallel = transfers.parts
        g.partBytes = transfers.partSize
        g.partsRunning = transfers.running
        g.adaptive = config.adaptive
    }
}
