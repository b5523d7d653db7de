/// Every pool of threads the daemon runs, made in one place (the daemon's start, or a test)
/// and passed to the parts that use them (docs/architecture.md, "Threads and locks"). Threads
/// start at a pool's first job, after the daemon has forked; above its floor a pool grows
/// while jobs wait and shrinks back when idle (`WorkerPool`).
public struct WorkerPools: Sendable {
    /// Reads that wait for the network, served by the FUSE adapter: 16 kept, up to 64 while
    /// downloads stall, so a read behind a stalled server waits for its own download only.
    public let reads: WorkerPool
    /// Lookups, attribute refreshes and listings that need the bucket: a stalled server ties
    /// up these threads, never FUSE's, and at most 64 at once.
    public let metadata: WorkerPool
    /// Read-ahead downloads and their cache copies; grown with the parts allowed in flight
    /// (`BlockReader.prefetchPool`).
    public let prefetch: WorkerPool
    /// Connections opened ahead of need on a far link (`openConnectionsAhead`).
    public let connect: WorkerPool
    /// A lookup's requests: its directory's first page, the metadata GET and the "is it a
    /// directory?" list (and, over v0, the first bytes), three per lookup, for as many lookups
    /// as the metadata pool runs at once (64). With 16, 16 lookups stalled together queued
    /// their requests behind each other's and each took three stalls (issue 49, item 3).
    public let probe: WorkerPool
    /// Sub-directories listed ahead of `find` and `ls -R` (`list_ahead=`).
    public let listing: WorkerPool
    /// Cache copies with `cache_writes=keep_up` (`CacheWriter`).
    public let cacheWrites: WorkerPool
    /// Records of the offline namespace (`NamespaceStore`).
    public let namespace: WorkerPool
    /// Entry invalidations sent to the kernel (`KernelNotifier`).
    public let notify: WorkerPool

    public init(readWorkers: Int = 16) {
        reads = WorkerPool(threads: readWorkers, name: "storefs-read", maxThreads: max(readWorkers, 64))
        metadata = WorkerPool(threads: 4, name: "storefs-meta", maxThreads: 64)
        prefetch = WorkerPool(threads: 1, name: "storefs-prefetch")
        connect = WorkerPool(threads: 1, name: "storefs-connect", maxThreads: 16)
        probe = WorkerPool(threads: 2, name: "storefs-probe", maxThreads: 3 * 64)
        listing = WorkerPool(threads: 1, name: "storefs-list", maxThreads: 4)
        cacheWrites = WorkerPool(threads: 1, name: "storefs-cachewrite")
        namespace = WorkerPool(threads: 1, name: "storefs-ns")
        notify = WorkerPool(threads: 1, name: "storefs-notify")
    }

    /// Lets every pool's threads finish their queued work and exit.
    public func shutdown() {
        for pool in [reads, metadata, prefetch, connect, probe, listing, cacheWrites, namespace, notify] { pool.shutdown() }
    }
}
