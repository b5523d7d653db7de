import Foundation
import Synchronization

/// A lock's place in storefs's one lock order (docs/architecture.md, "Threads and locks"). A
/// thread may take a lock only while every lock it holds comes earlier in the order (a lower
/// rank): two locks are never taken in opposite orders, so no two threads can deadlock on
/// them. Locks of one level are never held together (two objects' locks of one kind, say).
///
/// Debug builds check it on every acquisition (`LockOrder`): an inversion ends the process
/// with both locks named, so the unit and integration suites (which run the debug build)
/// fail on it. Release builds check nothing.
public struct LockLevel: Sendable, Equatable, CustomStringConvertible {
    public let rank: Int
    public let name: String

    public init(_ rank: Int, _ name: String) {
        self.rank = rank
        self.name = name
    }

    public var description: String { "\(name) (\(rank))" }
}

/// The debug-build check of the lock order: each thread's held locks, as a stack of ranks.
public enum LockOrder {
    #if DEBUG
    public static let isChecking = true
    #else
    public static let isChecking = false
    #endif

    /// The locks one thread holds, innermost last.
    private final class Held {
        var levels: [LockLevel] = []
    }

    private static let key: pthread_key_t = {
        var key = pthread_key_t()
        pthread_key_create(&key) { raw in if let raw { Unmanaged<Held>.fromOpaque(raw).release() } }
        return key
    }()

    private static var held: Held {
        if let raw = pthread_getspecific(key) { return Unmanaged<Held>.fromOpaque(raw).takeUnretainedValue() }
        let fresh = Held()
        pthread_setspecific(key, Unmanaged.passRetained(fresh).toOpaque())
        return fresh
    }

    /// About to take a lock of `level`: fails the process if a lock held comes at or after it.
    /// Inlinable, like the lock types below: in a release build every lock's wrapper compiles
    /// down to the lock itself in the caller's module (an unspecialised generic call per lock
    /// through the module boundary is what a hot path would otherwise pay).
    @inlinable @inline(__always)
    public static func willTake(_ level: LockLevel) {
        #if DEBUG
        checkAndPush(level)
        #endif
    }

    @usableFromInline
    static func checkAndPush(_ level: LockLevel) {
        #if DEBUG
        let h = held
        if let inner = h.levels.last, inner.rank >= level.rank {
            inversion(taking: level, holding: h.levels)
        }
        h.levels.append(level)
        #endif
    }

    /// A lock was taken without waiting (`try`): it cannot deadlock, so it is not checked,
    /// but what is taken under it is.
    @inlinable @inline(__always)
    public static func took(_ level: LockLevel) {
        #if DEBUG
        push(level)
        #endif
    }

    @usableFromInline
    static func push(_ level: LockLevel) {
        #if DEBUG
        held.levels.append(level)
        #endif
    }

    /// A lock of `level` was let go.
    @inlinable @inline(__always)
    public static func released(_ level: LockLevel) {
        #if DEBUG
        pop(level)
        #endif
    }

    @usableFromInline
    static func pop(_ level: LockLevel) {
        #if DEBUG
        let h = held
        if let i = h.levels.lastIndex(where: { $0.rank == level.rank && $0.name == level.name }) { h.levels.remove(at: i) }
        #endif
    }

    /// The levels this thread holds (tests).
    public static var heldLevels: [LockLevel] { held.levels }

    /// What an inversion does: by default, says so on stderr and ends the process; tests of the
    /// check install a recorder. Set before any thread takes an ordered lock.
    nonisolated(unsafe) public static var onInversion: (@Sendable (String) -> Void)? = nil

    private static func inversion(taking level: LockLevel, holding: [LockLevel]) {
        let message = "storefs: lock order violated: taking \(level) while holding "
            + holding.map(\.description).joined(separator: ", ") + " (docs/architecture.md, \"Threads and locks\")"
        if let onInversion { return onInversion(message) }
        _ = (message + "\n").withCString { write(2, $0, strlen($0)) }
        fatalError(message)
    }
}

/// A `Mutex` with its place in the lock order.
public struct OrderedMutex<Value: ~Copyable>: ~Copyable, Sendable {
    @usableFromInline let mutex: Mutex<Value>
    public let level: LockLevel

    public init(_ level: LockLevel, _ value: consuming sending Value) {
        self.level = level
        mutex = Mutex(value)
    }

    @inlinable
    public borrowing func withLock<Result: ~Copyable, E: Error>(
        _ body: (inout sending Value) throws(E) -> sending Result
    ) throws(E) -> sending Result {
        LockOrder.willTake(level)
        defer { LockOrder.released(level) }
        return try mutex.withLock(body)
    }
}

/// An `NSLock` with its place in the lock order.
public final class OrderedLock: @unchecked Sendable {
    @usableFromInline let mutex = NSLock()
    public let level: LockLevel

    public init(_ level: LockLevel) { self.level = level }

    @inlinable
    public func lock() {
        LockOrder.willTake(level)
        mutex.lock()
    }

    /// Takes the lock if it is free; true if taken (then `unlock` it).
    @inlinable
    public func `try`() -> Bool {
        guard mutex.try() else { return false }
        LockOrder.took(level)
        return true
    }

    @inlinable
    public func unlock() {
        mutex.unlock()
        LockOrder.released(level)
    }

    @inlinable
    public func withLock<T, E: Error>(_ body: () throws(E) -> T) throws(E) -> T {
        self.lock()
        defer { unlock() }
        return try body()
    }
}

/// An `NSCondition` with its place in the lock order. Waiting lets the lock go and takes it
/// back; the order is checked when it is first taken.
public final class OrderedCondition: @unchecked Sendable {
    @usableFromInline let condition = NSCondition()
    public let level: LockLevel

    public init(_ level: LockLevel) { self.level = level }

    @inlinable
    public func lock() {
        LockOrder.willTake(level)
        condition.lock()
    }

    @inlinable
    public func unlock() {
        condition.unlock()
        LockOrder.released(level)
    }

    @inlinable
    public func wait() { condition.wait() }

    /// False when `date` passed first.
    @inlinable @discardableResult
    public func wait(until date: Date) -> Bool { condition.wait(until: date) }

    @inlinable
    public func signal() { condition.signal() }

    @inlinable
    public func broadcast() { condition.broadcast() }
}

/// The one lock order, first (outermost) to last, as docs/architecture.md ("Threads and
/// locks") states it. Each lock's declaration says what it guards; a lock may be taken only
/// while every lock held comes earlier here.
extension LockLevel {
    // Held across network I/O, each for the reason given where it is declared.
    public static let credentialRefresh = LockLevel(10, "RefreshingCredentials.refreshing")
    // The read path's decision on a completing download: held across cache writes (disk), and
    // across the re-download after a crc32c mismatch (network).
    public static let integrityDecision = LockLevel(20, "ObjectIntegrity.decision")

    // The namespace (Sources/StorefsCore/Namespace, Manifest): leaves of one another, never
    // held while a lock of another layer is taken but the caller's cancellation check's.
    // The stored namespace's log is held across its disk I/O.
    public static let namespaceLog = LockLevel(50, "NamespaceStore.log")
    public static let namespaceWritten = LockLevel(52, "NamespaceStore.written")
    public static let namespacePending = LockLevel(53, "NamespaceStore.pending")
    public static let listingFlights = LockLevel(54, "Filesystem.listingFlights")
    public static let handles = LockLevel(55, "Filesystem.handles")
    public static let inodeTable = LockLevel(56, "Filesystem.table")
    public static let knownPaths = LockLevel(57, "Filesystem.known")
    public static let listings = LockLevel(58, "Filesystem.listings")
    public static let fullMetadata = LockLevel(59, "Filesystem.fullMetadata")
    public static let firstPages = LockLevel(60, "Filesystem.firstPages")
    public static let shadowLogged = LockLevel(61, "Filesystem.shadowLogged")
    public static let nameChanged = LockLevel(62, "Filesystem.nameChanged")
    public static let listingStream = LockLevel(63, "ListingStream.condition")
    public static let lookupRace = LockLevel(64, "LookupRace.condition")
    public static let callerCancellation = LockLevel(65, "CallerCancellation.lock")
    public static let manifestDirectories = LockLevel(66, "ManifestNamespace.directoryNumbers")
    public static let manifestListed = LockLevel(67, "ManifestNamespace.listed")
    public static let manifestGoneLogged = LockLevel(68, "ManifestNamespace.goneLogged")

    // The block cache, in the order Cache/BlockCache.swift states with what each guards and
    // which are held across disk I/O (and, across mounts of one directory, docs/cache.md).
    // Taken under the integrity decision, never under the read path's bookkeeping.
    public static let cacheCreating = LockLevel(70, "BlockCache.creating")
    public static let cacheObjectWriting = LockLevel(72, "CachedObject.writing")
    public static let cacheEvicting = LockLevel(74, "BlockCache.evicting")
    public static let cacheObjectIndexWriting = LockLevel(76, "CachedObject.indexWriting")
    public static let cacheState = LockLevel(78, "BlockCache.state")
    public static let cacheObjectState = LockLevel(80, "CachedObject.state")
    public static let cacheDirectories = LockLevel(82, "BlockCache.directories")
    public static let cacheOpenFiles = LockLevel(84, "BlockCache.openFiles")
    public static let sharedCacheAgreed = LockLevel(86, "SharedCache.agreed")
    public static let cacheWriterRoom = LockLevel(88, "CacheWriter.room")

    // The read path's bookkeeping (no I/O under any of them).
    public static let flightTables = LockLevel(100, "BlockReader.FlightTables.entries")
    public static let flightEntries = LockLevel(102, "FlightTable.entries")
    public static let integrityUnstored = LockLevel(104, "ObjectIntegrity.unstored")
    public static let integrityCheckEnded = LockLevel(106, "ObjectIntegrity.checkEnded")
    public static let flight = LockLevel(108, "Flight.condition")
    public static let streamParkedClaim = LockLevel(110, "Stream.parkedClaim")
    public static let streamDetector = LockLevel(112, "Stream.detector")
    public static let streamLastRead = LockLevel(114, "Stream.lastRead")
    public static let transfers = LockLevel(116, "TransferController.state")
    public static let connectionsQueued = LockLevel(118, "BlockReader.connectionsQueued")
    public static let firstBytesTable = LockLevel(120, "FirstBytesTable.entries")
    public static let firstBytesEntry = LockLevel(122, "FirstBytesTable.Entry.outcome")
    public static let flightFailure = LockLevel(124, "FlightTable.lastFailure")
    public static let memoryBudget = LockLevel(130, "MemoryBudget.condition")
    public static let flightBuffers = LockLevel(132, "FlightBufferPool.lock")
    public static let bucketHealth = LockLevel(134, "BucketHealth.state")
    public static let signedURLs = LockLevel(136, "DownloadURL.signed")
    public static let parallelMap = LockLevel(138, "ParallelMap slots")

    // The storage client.
    public static let credentialsCurrent = LockLevel(140, "RefreshingCredentials.current")
    public static let credentialsLastForced = LockLevel(142, "RefreshingCredentials.lastForced")
    public static let tokenFile = LockLevel(144, "TokenFileCredentials.cache")
    public static let refreshToken = LockLevel(146, "RefreshTokenBox.lock")
    public static let httpTrust = LockLevel(148, "HTTPClient.trust")
    public static let httpPool = LockLevel(150, "HTTPClient.pool")
    public static let httpLoopback = LockLevel(152, "HTTPClient.loopbackOrigins")
    public static let connectionClaim = LockLevel(154, "ConnectionClaim.lock")

    // The FUSE adapter.
    public static let fuseSession = LockLevel(160, "FuseContext.session")
    public static let queuedRequests = LockLevel(162, "QueuedRequests.waiting")
    public static let replyBuffers = LockLevel(164, "BufferPool.free")
    public static let notifierSession = LockLevel(166, "KernelNotifier.session")
    public static let prefetchProgress = LockLevel(168, "storefs prefetch's progress")

    // Threads: a job may be submitted under any lock above.
    public static let workerPoolWake = LockLevel(170, "WorkerPool.wake")
    public static let workerPoolState = LockLevel(172, "WorkerPool.state")
    public static let waitGroup = LockLevel(174, "WaitGroup.condition")

    // Telemetry, last: counted and logged under anything.
    public static let memoryReturn = LockLevel(180, "MemoryReturn.pools")
    public static let metricsServer = LockLevel(182, "MetricsServer.listener")
    public static let metricsFuse = LockLevel(184, "Metrics.fuse")
    public static let metricsHTTP = LockLevel(185, "Metrics.http")
    public static let metricsCache = LockLevel(186, "Metrics.cache")
    public static let log = LockLevel(190, "Log.state")
}
