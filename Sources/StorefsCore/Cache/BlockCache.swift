import Locking
import Foundation
import Glibc
import StorageClient
import Synchronization

// The block cache: this file holds the cache directory as a whole (its locks, joining the
// mounts that share it, recovery after `rm -rf`, opening and creating objects);
// `BlockCache+Eviction.swift` the cap and LRU eviction, `BlockCache+Loading.swift` the
// start-up scan; `SharedCache.swift` what the mounts of one directory share (docs/cache.md);
// `CachedObject.swift` one object generation's file (reads, stores),
// `CachedObject+IndexCommit.swift` its index writes (the group commit),
// `CachedObject+Sharing.swift` what a mount learns from the indexes other mounts wrote,
// `CachedObject+Allocation.swift` the allocation of its data ahead of direct writes,
// `CachedObject+Eviction.swift` dropping its blocks, and
// `CachedObject+Integrity.swift` the whole-object check's state (docs/integrity.md).
//
// LOCK ORDER (the cache's part, ranks 70-88 of the one order in Sources/Locking/LockOrder.swift,
// checked in debug builds; a thread holding one may take only those below it):
//
//   1. BlockCache.creating          (NSLock)  one file creator, recovery or clear at a time
//   2. CachedObject.writing         (NSLock)  one buffered store per file
//   3. BlockCache.evicting          (NSLock)  one evictor per mount, then, across mounts,
//      + the evictor lock                     SharedCache byte 1 (an OFD lock, waited for)
//   4. CachedObject.indexWriting    (NSLock)  one index write per file (the group commit)
//   5. index page range locks       (OFD locks on the cache file, across mounts; waited for)
//   6. BlockCache.state             (Mutex)   objects
//   7. CachedObject.state           (Mutex)   the index in memory, descriptors, users
//   8. BlockCache.directories       (Mutex)   the CacheDirectory and `v1/.lock`
//   9. BlockCache.openFiles         (Mutex)   leaf: never held while an object's lock is taken
//   -  SharedCache.agreed           (Mutex)   leaf: the cap the mounts agree on
//   -  CacheWriter.room             (NSCondition) leaf: the write queue's backlog only
//
// Eviction (`reserve` → `evict`) runs with 1 or 2 held by the caller, takes 3, and then 4, 5
// and 7 of each victim in turn, never two objects' locks of one level at once. A cache file's
// shared `flock` (held while a mount has it open, `CacheDirectory.openFile`) is taken under 6
// and 7 and waits only for an exclusive holder, which holds nothing else of the cache while
// it removes or trims the file. Atomics (the clock, `lastUsed`, the check epochs, the shared
// counters) are not locks and may be read under any of these. Across mounts the only locks
// waited for are 3's and 5's, and no mount waits for 3 while it holds 5.
//
// Held across disk I/O: 1 (creating a file: mkdirat, openat, pwrite, ftruncate, renameat;
// clear's eviction), 2 (a buffered store's data and index writes, and eviction for its
// room), 3 (all of an eviction: reading indexes, entry writes, hole punches, unlinks), 4 and 5
// (index page reads and writes, fallocate of the index; eviction's entry write and punches),
// 6 only in eviction's removal of empty files (an exclusive flock, the index read, unlinkat),
// 7 in `open`/`close` (the first open's openat and `trimAllocation`; close's punches of unused
// allocation, futimens and close) and 8 (`CacheDirectory.openFile`'s openat under 7). None is
// held across network I/O. Eviction's writes into a victim's file run outside its state lock
// (`CachedObject.withAnyDescriptor` keeps the descriptor open meanwhile).

/// The on-disk block cache: fixed-size blocks of object generations under `cache_dir`.
///
/// - Keyed by (endpoint, bucket, object name, generation): a new generation never sees old bytes.
/// - Every block is checked against its CRC32C before it is served (`CachedObject.read`).
/// - `capacity` is a hard cap on the bytes the cache holds on disk (blocks rounded to 4 KiB plus
///   each file's header page): before a block is written, the least recently used blocks are
///   evicted (hole-punched; whole files removed once empty and unused) down to a low-water mark.
/// - A write that fails (a full disk) switches caching off for a while: reads keep working,
///   streamed straight from the network.
/// - It survives unmounts: at start-up the directory is scanned and every valid file is reused,
///   most recently used last in the eviction order.
/// - Several storefs processes of one user may use one directory at once (docs/cache.md): they
///   share its files, one count of its bytes and one cap (`SharedCache`).
public final class BlockCache: Sendable {
    public let directory: String
    /// This mount's `cache_size`; the cap it keeps to is `capacity`.
    public let ownCapacity: Int64
    public let blockSize: Int
    /// Block data is written past the page cache where the filesystem allows (`DirectIO`),
    /// but for small objects stored whole (`CachedObject.store`).
    public let directWrites: Bool
    /// Who shares the directory, the bytes it holds, who changed which index.
    let shared: SharedCache
    /// Every file operation under `directory` (verified descriptors, never followed links).
    /// Replaced when the version directory is deleted under the mount (`recoverIfRemoved`).
    var files: CacheDirectory { directories.withLock { $0.files } }
    struct Directories: ~Copyable {
        var files: CacheDirectory
        /// `v1/.lock`, which older storefs versions lock exclusively (docs/cache.md).
        var lockFD: Int32
    }
    /// Guards `files` (replaced by recovery) and `v1/.lock`'s descriptor. Level 8 of the lock
    /// order; held across `CacheDirectory.openFile`'s openat.
    let directories: OrderedMutex<Directories>
    /// A descriptor of `cache_dir` itself, locked (shared flock) for the life of the process:
    /// `storefs cache clear` and older storefs versions take it exclusively, so neither runs
    /// beside a mount. The lock is released when the process ends, and survives
    /// `rm -rf cache_dir/v1`.
    private let topLock: Int32

    struct State: ~Copyable {
        var objects: [String: CachedObject] = [:]
    }
    /// Until when the cache is paused (`degrade`): a `Double` of `now()`'s clock, by its bit
    /// pattern. Every first open asks (`isDegraded`), so it is an atomic, not under `state`.
    private let degradedUntil = Atomic<UInt64>(0)

    /// Guards the objects known. Level 6; taken under a store's `writing`
    /// (`tracks`), never while an object's `state` is held. Held across disk I/O only while
    /// eviction removes empty files.
    let state = OrderedMutex(.cacheState, State())
    /// Objects whose cache file is open now, and how many may be: other users of an
    /// `allow_other` mount choose how many files are open, so the open count does not decide
    /// the descriptor count. Past `maxOpenFiles`, the least recently used files that no
    /// operation is using let their descriptors go; they are opened again on their next use
    /// (docs/security.md, "Local users on an allow_other mount"). Level 9, a leaf: never held
    /// while an object's lock is taken, and no lock is taken under it.
    private let openFiles = OrderedMutex(.cacheOpenFiles, [ObjectIdentifier: CachedObject]())
    let maxOpenFiles: Int
    /// One creator of a cache file at a time in this mount (two first opens of one object
    /// make one file), and recovery and `clear` beside them. Level 1, the outermost; held
    /// across the file's creation and clear's eviction (disk I/O). Creators in other mounts
    /// are told apart by the file system (`CacheDirectory.createFile` never renames over a
    /// file another made).
    let creating = OrderedLock(.cacheCreating)
    /// One eviction at a time in this mount (then the evictor lock across mounts). Level 3;
    /// held across the whole eviction's disk I/O.
    let evicting = OrderedLock(.cacheEvicting)
    static let degradedSeconds = 30.0

    /// Opens (creating with mode 0700) the cache directory, joins the mounts using it, and
    /// loads what earlier mounts left. A directory another user could have made or changed is
    /// refused (CacheDirectory). `maxOpenFiles` nil: an eighth of the open-file limit (each
    /// holds two descriptors), 16 to 4096.
    public init(directory: String, capacity: Int64, blockSize: Int, directWrites: Bool = true,
                maxOpenFiles: Int? = nil) throws(FilesystemError) {
        self.maxOpenFiles = maxOpenFiles ?? Self.defaultMaxOpenFiles()
        self.directory = directory
        self.directWrites = directWrites
        self.ownCapacity = capacity
        self.blockSize = blockSize
        let files: CacheDirectory
        do throws(CacheDirectory.Refused) {
            files = try CacheDirectory(directory: directory, versionName: "v\(CacheFileFormat.version)")
        } catch {
            throw FilesystemError(.invalidArgument, error.message)
        }
        // Shared with the other mounts; exclusive only for `cache clear` and older versions.
        topLock = dup(files.topFD)
        guard topLock >= 0, flock(topLock, LOCK_SH | LOCK_NB) == 0 else {
            let busy = errno == EWOULDBLOCK
            let why = String(cString: strerror(errno))
            if topLock >= 0 { Glibc.close(topLock) }
            throw FilesystemError(.invalidArgument, busy ? Self.busyMessage(directory)
                                                         : "cache_dir \(directory): cannot lock it: \(why)")
        }
        let lockFD: Int32
        do throws(FilesystemError) {
            lockFD = try Self.lockVersionDirectory(files)
        } catch {
            Glibc.close(topLock)
            throw error
        }
        do throws(SharedCache.Refused) {
            shared = try SharedCache(cacheDirectory: directory, capacity: capacity, blockSize: blockSize)
        } catch {
            Glibc.close(lockFD)
            Glibc.close(topLock)
            throw FilesystemError(.invalidArgument, error.message)
        }
        directories = OrderedMutex(.cacheDirectories, Directories(files: files, lockFD: lockFD))
        loadExisting()
    }

    private let directRefused = Atomic<Bool>(false)

    static func defaultMaxOpenFiles() -> Int {
        var limit = rlimit()
        guard getrlimit(__rlimit_resource_t(RLIMIT_NOFILE.rawValue), &limit) == 0 else { return 128 }
        return max(16, min(4096, Int(min(limit.rlim_cur, 1 << 30)) / 8))
    }

    /// The cap this mount keeps to: the smallest `cache_size` of the mounts sharing the
    /// directory now (docs/cache.md, "One cap").
    public var capacity: Int64 { shared.capacity }

    /// Whether other mounts use (or used, since this one started) the directory.
    public var isShared: Bool { shared.isShared }

    /// Cache files open now (tests).
    var openFileCount: Int { openFiles.withLock { $0.count } }

    /// `object` opened its file: past `maxOpenFiles`, the least recently used idle ones close
    /// theirs. Called with no lock held.
    func noteOpened(_ object: CachedObject) {
        let over = openFiles.withLock { held -> [CachedObject]? in
            held[ObjectIdentifier(object)] = object
            return held.count > maxOpenFiles ? Array(held.values) : nil
        }
        guard let candidates = over else { return }
        let excess = candidates.count - maxOpenFiles * 7 / 8
        var closed = 0
        for o in candidates.sorted(by: { $0.lastUse < $1.lastUse }) where o !== object {
            if closed >= excess { break }
            if o.closeIfIdle() { closed += 1 }
        }
    }

    /// `object` closed its file.
    func noteClosed(_ object: CachedObject) {
        _ = openFiles.withLock { $0.removeValue(forKey: ObjectIdentifier(object)) }
    }

    /// Says once per mount that the cache's filesystem turned O_DIRECT down.
    func noteNoDirectWrites() {
        let why = String(cString: strerror(errno))
        guard !directRefused.exchange(true, ordering: .relaxed) else { return }
        Log.info("cache_dir \(directory): the filesystem does not take direct writes (\(why)): cache data goes through the page cache")
    }

    /// Mounts share a cache directory; only an older storefs (which keeps one to itself) or
    /// `storefs cache clear` holds it exclusively.
    static func busyMessage(_ directory: String) -> String {
        "cache_dir \(directory) is held by an older storefs version (which keeps a cache directory to itself) or is being cleared: unmount that one or wait for the clear, or give this mount another cache_dir="
    }

    /// Opens and locks (shared) `v1/.lock`, which older storefs versions lock exclusively
    /// instead of `cache_dir`.
    private static func lockVersionDirectory(_ files: CacheDirectory) throws(FilesystemError) -> Int32 {
        let fd: Int32
        do throws(CacheDirectory.Refused) {
            fd = try files.openLockFile()
        } catch {
            throw FilesystemError(.invalidArgument, error.message)
        }
        guard flock(fd, LOCK_SH | LOCK_NB) == 0 else {
            let busy = errno == EWOULDBLOCK
            let why = String(cString: strerror(errno))
            Glibc.close(fd)
            throw FilesystemError(.invalidArgument, busy ? busyMessage(files.path)
                                                         : "cache_dir \(files.path): cannot lock \(files.versionPath)/.lock: \(why)")
        }
        return fd
    }

    /// Writes who this mount is into its slot file (`storefs cache status` lists the live
    /// ones): one JSON object with the daemon's pid, mount point, cap and block size.
    public func recordOwner(mountpoint: String) {
        shared.recordMount(mountpoint: mountpoint)
    }

    /// After `rm -rf cache_dir/v1` under the mount: makes the version directory again (with
    /// every check of the first time), locks it, and forgets the deleted files (readers of
    /// an open one finish on it). The lock on `cache_dir` was never let go, so no older
    /// storefs could take the cache meanwhile. True if it was gone and is back.
    @discardableResult
    public func recoverIfRemoved() -> Bool {
        guard files.isRemoved else { return false }
        creating.lock()
        defer { creating.unlock() }
        return recoverIfRemovedHoldingCreator()
    }

    /// `recoverIfRemoved` for a caller that holds `creating`.
    func recoverIfRemovedHoldingCreator() -> Bool {
        guard files.isRemoved else { return false }
        let fresh: CacheDirectory
        let lockFD: Int32
        do throws(FilesystemError) {
            do throws(CacheDirectory.Refused) {
                fresh = try CacheDirectory(directory: directory, versionName: "v\(CacheFileFormat.version)")
            } catch {
                throw FilesystemError(.invalidArgument, error.message)
            }
            lockFD = try Self.lockVersionDirectory(fresh)
        } catch {
            degrade("\(files.versionPath) was deleted and cannot be made again: \(error.message)")
            return false
        }
        directories.withLock { d in
            Glibc.close(d.lockFD)
            d.files = fresh
            d.lockFD = lockFD
        }
        state.withLock { $0.objects.removeAll() }
        degradedUntil.store(0, ordering: .relaxed)
        // What the deleted files held is gone: counted again from what the directory holds
        // now (other mounts may have made files in it already).
        recount()
        Log.warn("cache directory was deleted under the mount: made it again, empty", ["dir": fresh.versionPath])
        return true
    }

    deinit {
        let fd = directories.withLock { $0.lockFD }
        Glibc.close(fd)
        Glibc.close(topLock)
    }

    /// Whether `object` is still this cache's (not a file deleted with its directory).
    func tracks(_ object: CachedObject) -> Bool { state.withLock { $0.objects[object.hex] === object } }

    /// The LRU clock: wall-clock nanoseconds, so that this mount's uses compare with other
    /// mounts' (a cache file's mtime, docs/cache.md "Eviction").
    func tick() -> UInt64 { Self.wallClock() }

    static func wallClock() -> UInt64 {
        var ts = timespec()
        clock_gettime(CLOCK_REALTIME, &ts)
        return UInt64(max(0, ts.tv_sec)) * 1_000_000_000 + UInt64(max(0, ts.tv_nsec))
    }

    /// Bytes the cache holds now, as every mount of it counts them (for tests and logs).
    public var usedBytes: Int64 { shared.used }

    /// The key hash of an object generation.
    static func keyHash(endpoint: String, bucket: String, name: String, generation: Int64) -> [UInt8] {
        var key = Array("storefs-cache-key-v1".utf8)
        for part in [endpoint, bucket, name, String(generation)] { key.append(0); key += Array(part.utf8) }
        return Checksum.sha256(key)
    }

    static func hex(_ bytes: [UInt8]) -> String {
        let digits = Array("0123456789abcdef".utf8)
        var out: [UInt8] = []
        for b in bytes { out.append(digits[Int(b >> 4)]); out.append(digits[Int(b & 15)]) }
        return String(decoding: out, as: UTF8.self)
    }

    /// Where the file of `hex` lies (for messages and tests; it is never opened by this path).
    func path(forHex hex: String) -> String { "\(files.versionPath)/\(hex.prefix(2))/\(hex).blk" }

    /// The cache entry of an object generation, created if needed and marked in use; nil when
    /// caching is off (degraded) and nothing is cached for it.
    func acquire(endpoint: String, meta: ObjectMetadata) -> CachedObject? {
        guard let object = acquireFile(endpoint: endpoint, meta: meta) else { return nil }
        // Another mount may have stored blocks of it since this one last looked.
        object.catchUp()
        // A complete object found on disk is checked end to end now (docs/integrity.md).
        _ = object.expect(crc32c: meta.crc32c.flatMap(Checksum.crc32c(base64:)))
        return object
    }

    private func acquireFile(endpoint: String, meta: ObjectMetadata) -> CachedObject? {
        let hash = Self.keyHash(endpoint: endpoint, bucket: meta.bucket, name: meta.name, generation: meta.generation)
        let hex = Self.hex(hash)
        if let existing = useKnown(hex, size: meta.size) { return existing }
        if isDegraded { return nil }
        // One creator at a time: two first opens racing to rename a file onto the same name
        // would otherwise leave one of them writing into an unlinked file.
        creating.lock()
        defer { creating.unlock() }
        if let raced = useKnown(hex, size: meta.size) { return raced }
        let format = CacheFileFormat(blockSize: blockSize, objectSize: meta.size, generation: meta.generation, keyHash: hash)
        guard let created = create(format: format, hex: hex) else { return nil }
        state.withLock { s in
            s.objects[hex] = created
            created.addUser()
        }
        created.prepare()
        return created
    }

    /// The known object of `hex`, marked in use, if its file is still the one it knows: in a
    /// shared cache another mount may have removed it (it was empty and nobody had it open)
    /// and perhaps made it again; then it is forgotten here and opened or created afresh.
    private func useKnown(_ hex: String, size: Int64) -> CachedObject? {
        // Marked in use under the cache's lock: eviction removes only unused files, under it too.
        let known: CachedObject? = state.withLock { s in
            guard let o = s.objects[hex], o.format.objectSize == size, o.format.blockSize == blockSize else { return nil }
            o.addUser()
            return o
        }
        guard let known else { return nil }
        if known.isOpen || !shared.isShared || files.identity(hex) == known.inode {
            known.prepare()
            return known
        }
        known.close()
        state.withLock { s in
            if s.objects[hex] === known { s.objects.removeValue(forKey: hex) }
        }
        return nil
    }

    /// Empties the cache while mounted (`storefs cache clear --force`, through the daemon):
    /// every block is evicted and every file nobody reads is removed, the other mounts' too.
    /// Returns the bytes it held before and after (blocks being read or written may come
    /// back at once).
    public func clear() -> (before: Int64, after: Int64) {
        recoverIfRemoved()
        let before = usedBytes
        creating.lock()
        defer { creating.unlock() }
        evict(toMakeRoomFor: 0, everything: true)
        return (before, usedBytes)
    }

    /// The on-disk format version (`cache_dir/v<N>`).
    public static var formatVersion: Int { Int(CacheFileFormat.version) }

    /// Objects with a cache file that this mount knows.
    public var objectCount: Int { state.withLock { $0.objects.count } }

    /// Bytes of one object generation held in the cache (`user.storefs.cached`). In a shared
    /// cache, what other mounts stored counts too.
    public func cachedBytes(endpoint: String, bucket: String, name: String, generation: Int64, size: Int64) -> Int64 {
        let hex = Self.hex(Self.keyHash(endpoint: endpoint, bucket: bucket, name: name, generation: generation))
        var object = state.withLock { $0.objects[hex] }
        if object == nil, shared.isShared { object = adopt(hex) }
        guard let o = object, o.format.objectSize == size else { return 0 }
        o.catchUp()
        return o.presentBytes
    }

    func release(_ object: CachedObject) {
        object.close()
    }

    var isDegraded: Bool { Double(bitPattern: degradedUntil.load(ordering: .relaxed)) > now() }

    func degrade(_ why: String) {
        let t = now()
        let was = Double(bitPattern: degradedUntil.exchange((t + Self.degradedSeconds).bitPattern, ordering: .relaxed))
        let first = was <= t
        if first { Log.warn("block cache paused for \(Int(Self.degradedSeconds))s, reads stream uncached: \(why)") }
    }

    /// The object of a file just made, given the descriptor it was made with (`adopt`s it once
    /// a user holds it): its header and index pages count against the cap.
    private func fresh(format: CacheFileFormat, hex: String, fd: Int32, inode: ino_t) -> CachedObject {
        let object = CachedObject(cache: self, format: format, hex: hex, path: path(forHex: hex),
                                  index: BlockIndex(count: format.blockCount, tick: tick()), inode: inode)
        object.madeWith(fd: fd)
        shared.add(object.overheadBytes)
        return object
    }

    private func create(format: CacheFileFormat, hex: String) -> CachedObject? {
        var made = files.createFile(hex, header: format.encodeHeader(), size: format.dataOffset + format.objectSize)
        if case .failed(_, let full) = made, !full, recoverIfRemovedHoldingCreator() {
            made = files.createFile(hex, header: format.encodeHeader(), size: format.dataOffset + format.objectSize)
        }
        switch made {
        case .created(let fd, let inode):
            return fresh(format: format, hex: hex, fd: fd, inode: inode)
        case .exists:
            // Another mount made it first: it is used as that mount left it, unless it is not
            // a valid file for this object (then it is replaced, as nobody can be using it).
            if let existing = adopt(hex, insert: false), existing.format == format { return existing }
            if case .created(let fd, let inode) = files.createFile(hex, header: format.encodeHeader(),
                                                                   size: format.dataOffset + format.objectSize, replace: true) {
                return fresh(format: format, hex: hex, fd: fd, inode: inode)
            }
            return nil
        case .failed(let why, outOfDescriptors: true):
            // One reader holding many files open must not pause the cache for everyone: this
            // object is read uncached, the others keep their cache (issue 43, item 3).
            Log.warn("cache: no file descriptor to spare, a file is read uncached", ["error": why])
            return nil
        case .failed(let why, outOfDescriptors: false):
            degrade(why)
            return nil
        }
    }
}
