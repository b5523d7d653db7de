import Foundation
import Glibc
import StorageClient
import Synchronization

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
public final class BlockCache: Sendable {
    public let directory: String
    public let capacity: Int64
    public let blockSize: Int
    /// Block data is written past the page cache where the filesystem allows (`DirectWrites`).
    public let directWrites: Bool
    /// Every file operation under `directory` (verified descriptors, never followed links).
    /// Replaced when the version directory is deleted under the mount (`recoverIfRemoved`).
    var files: CacheDirectory { directories.withLock { $0.files } }
    private struct Directories: ~Copyable {
        var files: CacheDirectory
        /// `v1/.lock`, holding who has the cache (docs/operations.md, "Cache tools").
        var lockFD: Int32
        var owner: String = ""
    }
    private let directories: Mutex<Directories>
    /// A descriptor of `cache_dir` itself, locked (flock) for the life of the process: the
    /// lock is released when the process ends, and survives `rm -rf cache_dir/v1`.
    private let topLock: Int32

    private struct State: ~Copyable {
        var objects: [String: CachedObject] = [:]
        var usedBytes: Int64 = 0
        var degradedUntil: Double = 0
    }

    private let state = Mutex(State())
    /// Objects whose cache file is open now, and how many may be: other users of an
    /// `allow_other` mount choose how many files are open, so the open count does not decide
    /// the descriptor count. Past `maxOpenFiles`, the least recently used files that no
    /// operation is using let their descriptors go; they are opened again on their next use
    /// (docs/security.md, "Local users on an allow_other mount"). Never held while an object's
    /// lock is taken.
    private let openFiles = Mutex([ObjectIdentifier: CachedObject]())
    let maxOpenFiles: Int
    private let creating = NSLock()
    private let clock = Atomic<UInt64>(1)
    static let degradedSeconds = 30.0

    /// Opens (creating with mode 0700) the cache directory and loads what earlier mounts left.
    /// A directory another user could have made or changed is refused (CacheDirectory).
    /// `maxOpenFiles` nil: an eighth of the open-file limit (each holds two descriptors), 16 to 4096.
    public init(directory: String, capacity: Int64, blockSize: Int, directWrites: Bool = true,
                maxOpenFiles: Int? = nil) throws(FilesystemError) {
        self.maxOpenFiles = maxOpenFiles ?? Self.defaultMaxOpenFiles()
        self.directory = directory
        self.directWrites = directWrites
        self.capacity = capacity
        self.blockSize = blockSize
        let files: CacheDirectory
        do throws(CacheDirectory.Refused) {
            files = try CacheDirectory(directory: directory, versionName: "v\(CacheFileFormat.version)")
        } catch {
            throw FilesystemError(.invalidArgument, error.message)
        }
        // One process per cache: each enforces the cap on what it knows and cleans up at start.
        topLock = dup(files.topFD)
        guard topLock >= 0, flock(topLock, LOCK_EX | LOCK_NB) == 0 else {
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
        directories = Mutex(Directories(files: files, lockFD: lockFD))
        loadExisting()
    }

    private let directRefused = Atomic<Bool>(false)

    static func defaultMaxOpenFiles() -> Int {
        var limit = rlimit()
        guard getrlimit(__rlimit_resource_t(RLIMIT_NOFILE.rawValue), &limit) == 0 else { return 128 }
        return max(16, min(4096, Int(min(limit.rlim_cur, 1 << 30)) / 8))
    }

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

    static func busyMessage(_ directory: String) -> String {
        "cache_dir \(directory) is in use by another storefs process: give each mount its own cache_dir="
    }

    /// Opens and locks `v1/.lock` (which older storefs versions lock instead of `cache_dir`).
    private static func lockVersionDirectory(_ files: CacheDirectory) throws(FilesystemError) -> Int32 {
        let fd: Int32
        do throws(CacheDirectory.Refused) {
            fd = try files.openLockFile()
        } catch {
            throw FilesystemError(.invalidArgument, error.message)
        }
        guard flock(fd, LOCK_EX | LOCK_NB) == 0 else {
            let busy = errno == EWOULDBLOCK
            let why = String(cString: strerror(errno))
            Glibc.close(fd)
            throw FilesystemError(.invalidArgument, busy ? busyMessage(files.path)
                                                         : "cache_dir \(files.path): cannot lock \(files.versionPath)/.lock: \(why)")
        }
        return fd
    }

    /// Writes who holds the cache into `v1/.lock` (`storefs cache status` shows it): one JSON
    /// object with the daemon's pid, mount point, capacity and block size.
    public func recordOwner(mountpoint: String) {
        let json = "{\"pid\":\(getpid()),\"mountpoint\":\(LogLine.jsonString(mountpoint)),\"capacity\":\(capacity),"
            + "\"block_size\":\(blockSize),\"format\":\(CacheFileFormat.version)}\n"
        directories.withLock { d in
            d.owner = json
            Self.writeOwner(json, to: d.lockFD)
        }
    }

    private static func writeOwner(_ json: String, to fd: Int32) {
        guard !json.isEmpty else { return }
        let bytes = Array(json.utf8)
        _ = ftruncate(fd, 0)
        _ = bytes.withUnsafeBytes { pwrite(fd, $0.baseAddress, $0.count, 0) }
    }

    /// After `rm -rf cache_dir/v1` under the mount: makes the version directory again (with
    /// every check of the first time), locks it, and forgets the deleted files (readers of
    /// an open one finish on it). The lock on `cache_dir` was never let go, so no second
    /// mount could take the cache meanwhile. True if it was gone and is back.
    @discardableResult
    public func recoverIfRemoved() -> Bool {
        guard files.isRemoved else { return false }
        creating.lock()
        defer { creating.unlock() }
        return recoverIfRemovedHoldingCreator()
    }

    /// `recoverIfRemoved` for a caller that holds `creating`.
    private func recoverIfRemovedHoldingCreator() -> Bool {
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
            Self.writeOwner(d.owner, to: lockFD)
        }
        state.withLock { s in
            s.objects.removeAll()
            s.usedBytes = 0
            s.degradedUntil = 0
        }
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

    func tick() -> UInt64 { clock.add(1, ordering: .relaxed).newValue }

    /// Bytes the cache holds now (for tests and logs).
    public var usedBytes: Int64 { state.withLock { $0.usedBytes } }

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
        // A complete object found on disk is checked end to end now (docs/integrity.md).
        _ = object.expect(crc32c: meta.crc32c.flatMap(Checksum.crc32c(base64:)))
        return object
    }

    private func acquireFile(endpoint: String, meta: ObjectMetadata) -> CachedObject? {
        let hash = Self.keyHash(endpoint: endpoint, bucket: meta.bucket, name: meta.name, generation: meta.generation)
        let hex = Self.hex(hash)
        // Marked in use under the cache's lock: eviction removes only unused files, under it too.
        let existing: CachedObject? = state.withLock { s in
            guard let o = s.objects[hex], o.format.objectSize == meta.size, o.format.blockSize == blockSize else { return nil }
            o.open()
            return o
        }
        if let existing { return existing }
        if isDegraded { return nil }
        // One creator at a time: two first opens racing to rename a file onto the same name
        // would otherwise leave one of them writing into an unlinked file.
        creating.lock()
        defer { creating.unlock() }
        let raced: CachedObject? = state.withLock { s in
            guard let o = s.objects[hex], o.format.objectSize == meta.size, o.format.blockSize == blockSize else { return nil }
            o.open()
            return o
        }
        if let raced { return raced }
        let format = CacheFileFormat(blockSize: blockSize, objectSize: meta.size, generation: meta.generation, keyHash: hash)
        guard let created = create(format: format, hex: hex) else { return nil }
        state.withLock { s in
            if let stale = s.objects[hex] { s.usedBytes -= stale.overheadBytes + stale.storedBytes }
            s.objects[hex] = created
            s.usedBytes += created.overheadBytes
            created.open()
        }
        return created
    }

    /// Empties the cache while mounted (`storefs cache clear --force`, through the daemon):
    /// every block is evicted and every file nobody reads is removed. Returns the bytes it held
    /// before and after (blocks being read or written may come back at once).
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

    /// Objects with a cache file.
    public var objectCount: Int { state.withLock { $0.objects.count } }

    /// Bytes of one object generation held in the cache (`user.storefs.cached`).
    public func cachedBytes(endpoint: String, bucket: String, name: String, generation: Int64, size: Int64) -> Int64 {
        let hex = Self.hex(Self.keyHash(endpoint: endpoint, bucket: bucket, name: name, generation: generation))
        guard let o = state.withLock({ $0.objects[hex] }), o.format.objectSize == size else { return 0 }
        return o.presentBytes
    }

    func release(_ object: CachedObject) {
        object.close()
    }

    var isDegraded: Bool { state.withLock { $0.degradedUntil > now() } }

    func degrade(_ why: String) {
        let first = state.withLock { s -> Bool in
            let was = s.degradedUntil > now()
            s.degradedUntil = now() + Self.degradedSeconds
            return !was
        }
        if first { Log.warn("block cache paused for \(Int(Self.degradedSeconds))s, reads stream uncached: \(why)") }
    }

    /// Makes room for `bytes` more (evicting least recently used blocks); false if it cannot.
    func reserve(_ bytes: Int64) -> Bool {
        if bytes > capacity { return false }
        let needsEviction = state.withLock { $0.usedBytes + bytes > capacity }
        if needsEviction { evict(toMakeRoomFor: bytes) }
        return state.withLock { s in
            guard s.usedBytes + bytes <= capacity else { return false }
            s.usedBytes += bytes
            return true
        }
    }

    /// Returns reserved bytes that were not used (a failed write, a block already present).
    func unreserve(_ bytes: Int64) {
        state.withLock { $0.usedBytes -= bytes }
    }

    /// Evicts least recently used blocks down to a low-water mark (`everything`: all blocks,
    /// `storefs cache clear --force`); files left empty and unused go too.
    private func evict(toMakeRoomFor bytes: Int64, everything: Bool = false) {
        let lowWater = everything ? 0 : capacity - capacity / 10 - bytes
        let objects = state.withLock { Array($0.objects.values) }
        var candidates: [(tick: UInt64, object: CachedObject, block: Int)] = []
        for o in objects { o.collectBlocks(into: &candidates) }
        candidates.sort { $0.tick < $1.tick }
        var freed: Int64 = 0
        var blocks = 0
        let over = everything ? Int64.max : state.withLock { $0.usedBytes } - max(0, lowWater)
        for c in candidates where freed < over {
            let f = c.object.evict(block: c.block)
            freed += f
            if f > 0 { blocks += 1 }
        }
        Metrics.shared.evicted(blocks: blocks, bytes: freed)
        // Files with nothing left and nobody reading them go entirely.
        var removed: Int64 = 0
        state.withLock { s in
            for o in objects where o.isEmptyAndUnused {
                if s.objects[o.hex] === o {
                    s.objects.removeValue(forKey: o.hex)
                    files.removeFile(o.hex)
                    removed += o.overheadBytes
                }
            }
            s.usedBytes -= freed + removed
        }
        Log.debug("cache eviction freed=\(freed + removed) used=\(usedBytes) cap=\(capacity)")
    }

    private func create(format: CacheFileFormat, hex: String) -> CachedObject? {
        var made = files.createFile(hex, header: format.encodeHeader(), size: format.dataOffset + format.objectSize)
        if made.error != nil, !made.outOfDescriptors, recoverIfRemovedHoldingCreator() {
            made = files.createFile(hex, header: format.encodeHeader(), size: format.dataOffset + format.objectSize)
        }
        if let why = made.error, made.outOfDescriptors {
            // One reader holding many files open must not pause the cache for everyone: this
            // object is read uncached, the others keep their cache (issue 43, item 3).
            Log.warn("cache: no file descriptor to spare, a file is read uncached", ["error": why])
            return nil
        }
        if let why = made.error {
            degrade(why)
            return nil
        }
        return CachedObject(cache: self, format: format, hex: hex, path: path(forHex: hex),
                            index: BlockIndex(count: format.blockCount, tick: tick()))
    }

    /// Start-up scan: reuse valid files (oldest first in LRU order), delete anything else.
    private func loadExisting() {
        var found: [(mtime: Int, object: CachedObject)] = []
        files.scan { hex, fd, mtime in
            guard let object = load(fd: fd, hex: hex) else { return false }
            found.append((mtime, object))
            return true
        }
        found.sort { $0.mtime < $1.mtime }
        var used: Int64 = 0
        state.withLock { s in
            for (_, o) in found {
                o.setTicks(tick())
                s.objects[o.hex] = o
                used += o.overheadBytes + o.storedBytes
            }
            s.usedBytes = used
        }
        if used > capacity { evict(toMakeRoomFor: 0) }
        Log.debug("cache loaded objects=\(found.count) bytes=\(used) dir=\(directory)")
    }

    /// The cached object in an open cache file, or nil when the file is not a valid one.
    private func load(fd: Int32, hex: String) -> CachedObject? {
        var st = stat()
        guard fstat(fd, &st) == 0 else { return nil }
        var header = [UInt8](repeating: 0, count: CacheFileFormat.headerSize)
        guard header.withUnsafeMutableBytes({ pread(fd, $0.baseAddress, $0.count, 0) }) == header.count,
              let format = CacheFileFormat.decodeHeader(header), format.blockSize == blockSize,
              BlockCache.hex(format.keyHash) == hex,
              Int64(st.st_size) == format.dataOffset + format.objectSize else { return nil }
        // The on-disk index is read in chunks and only present blocks are kept: a huge object's
        // index (8 bytes a block, mostly holes) never sits in memory whole.
        var index = BlockIndex(count: format.blockCount)
        let perChunk = 1 << 17
        var first = 0
        let indexEnd = format.entryOffset(format.blockCount)
        while first < format.blockCount {
            // Holes in the index (never-written pages) are skipped: loading costs what is cached.
            let data = lseek(fd, off_t(format.entryOffset(first)), 3)  // SEEK_DATA (Linux; not in Glibc's Swift module)
            if data < 0 || Int64(data) >= indexEnd { break }
            let firstWithData = max(first, Int((Int64(data) - Int64(CacheFileFormat.headerSize)) / Int64(CacheFileFormat.entrySize)))
            if firstWithData > first {
                first = firstWithData
                continue
            }
            let n = min(perChunk, format.blockCount - first)
            var raw = [UInt8](repeating: 0, count: n * CacheFileFormat.entrySize)
            let at = off_t(format.entryOffset(first))
            guard raw.withUnsafeMutableBytes({ pread(fd, $0.baseAddress, $0.count, at) }) == raw.count else { return nil }
            for (i, e) in CacheFileFormat.decodeEntries(raw, count: n).enumerated()
            where e.length != 0 && Int(e.length) == format.blockLength(first + i) {
                index.set(first + i, e, tick: 0)
            }
            first += n
        }
        return CachedObject(cache: self, format: format, hex: hex, path: path(forHex: hex), index: index)
    }
}

/// The cached blocks of one object generation: its file, its index in memory, and LRU ticks.
final class CachedObject: Sendable {
    let format: CacheFileFormat
    let hex: String
    let path: String
    private unowned let cache: BlockCache

    private struct State: ~Copyable {
        var index: BlockIndex
        var fd: Int32 = -1
        /// The same file for data writes past the page cache (`DirectWrites`); -1 where not.
        var directFD: Int32 = -1
        /// A direct write was turned down (EINVAL): buffered from then on (`directFD` stays
        /// open until the file is closed, as writers may be using it).
        var directRefused = false
        var users = 0
        /// Operations using `fd`/`directFD` outside this lock (`withFile`): while any is, the
        /// descriptors stay open.
        var active = 0
        /// The object's own CRC32C, once an open told it (the file does not keep it).
        var expected: UInt32?
        /// Every block was there and their combined CRC32C matched `expected`.
        var verified = false
        /// Data chunks (`allocationChunk` bytes each, from the data offset) allocated ahead of
        /// the read-ahead writes into them (`allocate`). A block evicted from one leaves a hole
        /// in it: a write there is then no overwrite, slower beside other writers, still right.
        var allocatedChunks = Set<Int>()
        /// The index pages are allocated, so writing one is an overwrite (`writeEntries`).
        var indexAllocated = false
        /// Index pages (by page number in the file) holding entries set in memory beside
        /// direct data writes and not written since (`writeDirtyPages`).
        var dirtyPages = Set<Int>()
        /// Entry sets made beside direct data writes, and how many of the first of them are
        /// on disk: a store whose set is among those has nothing left to write.
        var setsMade: UInt64 = 0
        var setsWritten: UInt64 = 0
        /// The file's allocation was checked against its blocks since this mount opened it
        /// (`trimAllocation`).
        var allocationChecked = false
    }

    /// What storing blocks did to the object as a whole (docs/integrity.md).
    enum Completion: Equatable {
        /// Blocks are still missing, or nothing is known to check against.
        case incomplete
        /// The object is complete and its combined CRC32C matches the object's.
        case verified
        /// The object was complete and did not match: every block was dropped. `previous`: the
        /// CRC32C each block had (what readers may have been served).
        case mismatch(previous: [UInt32])
    }

    private let state: Mutex<State>
    private let servedWrong = Atomic<Int>(0)
    private let checksBegun = Atomic<Int>(0)
    private let checksRunning = Atomic<Int>(0)
    /// One buffered writer per file at a time: concurrent buffered writes into one file queue
    /// on its inode lock, and the kernel spins waiting for it (with 4 read-ahead threads that
    /// spinning cost more CPU than the copies). A sleeping lock of our own is cheaper. Direct
    /// writes run side by side instead: each waits for the disk, and one at a time capped
    /// 8 readers of one file at the disk's speed for one writer (~600 MiB/s here).
    /// They allocate their range first, so each is an overwrite, which ext4 lets run under a
    /// shared inode lock (docs/architecture.md, "Cache writes").
    private let writing = NSLock()
    /// Index entries are written under this lock, one write at a time per file: a page built
    /// from memory (`writeEntryPages`) holds every entry set before it, and no entry is
    /// written after a page built without it. Beside direct data writes, entries are set in
    /// memory before it is taken and whoever holds it writes every page set since the last
    /// write (a group commit, docs/architecture.md, "Cache writes"): one direct page write
    /// takes about a millisecond here, and one per store, in turn, held up to 40 finished
    /// parts (80 MiB) in memory behind it on a cold loopback read. A store that finds it
    /// taken does not wait: the holder looks again once it lets go and writes what was left
    /// (`commitIndex`; outside a store, `letGoOfIndexWriting`).
    private let indexWriting = NSLock()
    private let indexWriteCount = Atomic<Int>(0)

    /// Index writes made, direct or buffered (tests).
    var indexWrites: Int { indexWriteCount.load(ordering: .relaxed) }

    /// Entry sets made beside direct data writes and not on disk yet (tests).
    var unwrittenIndexSets: UInt64 { state.withLock { $0.setsMade - $0.setsWritten } }

    /// Runs `body` while no index write of this file can start (tests: stores leave their
    /// entries to it), then writes what they left.
    func withIndexWritesHeld<T>(_ body: () throws -> T) rethrows -> T {
        indexWriting.lock()
        defer { letGoOfIndexWriting() }
        return try body()
    }

    /// Writes the dirty index pages (beside direct data writes) unless another thread holds
    /// `indexWriting`: then this set is left to that thread, which looks again once it has let
    /// go of the lock. The data is on disk already and the entries are set in memory, so the
    /// store need not wait for a write made for it: a store used to wait here for the one
    /// under way (its page queued at the disk behind the data writes) and then often for its
    /// own, ~10–16 ms a 2 MiB part through `wan`, and the finished parts waiting so held up to
    /// 40 buffers (docs/architecture.md, "Cache writes"). `direct` must stay open meanwhile:
    /// the caller holds a user of the file. `own` runs under the lock when a direct page
    /// write is refused (EINVAL): it writes the caller's entries buffered (the pages stay
    /// marked, so this thread stops there). 0, or the errno of a failed write.
    private func commitIndex(direct: Int32, own: (() -> Int32)?) -> Int32 {
        while indexWriting.try() {
            var failure = writeDirtyPages(direct: direct)
            let refused = failure == EINVAL
            if refused, let own { failure = own() }
            indexWriting.unlock()
            // A store that found the lock taken meanwhile left its entries to this thread.
            guard failure == 0, !refused, state.withLock({ $0.setsWritten < $0.setsMade }) else { return failure }
        }
        return 0
    }

    /// Unlocks `indexWriting` taken outside a store (eviction, tests) and writes the entry sets
    /// stores left meanwhile: every holder must look after letting go (`commitIndex`).
    private func letGoOfIndexWriting() {
        indexWriting.unlock()
        commitLeftSets()
    }

    /// The entry sets stores left while `indexWriting` was held outside a store, written while
    /// the file is open (a user held for the write, so its descriptor cannot close under it).
    /// A file closed meanwhile keeps them in memory only: those blocks read as absent after a
    /// remount, as after a crash.
    private func commitLeftSets() {
        guard state.withLock({ $0.setsWritten < $0.setsMade && $0.users > 0 && !$0.directRefused }) else { return }
        let failure = withFile(writing: true) { _, direct -> Int32 in
            direct >= 0 ? commitIndex(direct: direct, own: nil) : 0
        } ?? 0
        // EINVAL: the device refused the alignment; the entries stay marked for the next store.
        if failure != 0, failure != EINVAL {
            cache.degrade("cannot write a cache index entry: \(String(cString: strerror(failure)))")
        }
    }

    /// Read-ahead's data is allocated this much at a time: allocating takes the file's inode
    /// lock exclusively and waits for every direct write under way, so one `fallocate` per run
    /// (2–4 MiB) queued 8 readers' writers behind each other (docs/architecture.md, "Cache
    /// writes"). What a chunk holds beyond the blocks written is disk the cap does not count,
    /// so a chunk is at most 1/64 of the cap, none below 4 MiB (then each run allocates its
    /// own range), an allocation (with the chunks taken ahead) at most 1/64 of the cap too,
    /// and the rest of a file's chunks is let go when its last user closes it.
    private var allocationChunk: Int64 {
        let chunk = min(16 << 20, cache.capacity / 64) / Int64(format.blockSize) * Int64(format.blockSize)
        return chunk >= 4 << 20 ? chunk : 0
    }

    /// Chunks one allocation may take at most: itself and those allocated ahead with it, within
    /// 128 MiB and 1/64 of the cap (`allocate`).
    private var allocationRunChunks: Int {
        let chunk = allocationChunk
        return chunk > 0 ? max(1, Int(min(128 << 20, cache.capacity / 64) / chunk)) : 1
    }

    init(cache: BlockCache, format: CacheFileFormat, hex: String, path: String, index: BlockIndex) {
        self.cache = cache
        self.format = format
        self.hex = hex
        self.path = path
        state = Mutex(State(index: index))
    }

    /// The header and index pages, counted against the cap. The index region is sparse: a huge
    /// object's (8 bytes a block of its size) takes disk only where blocks are present, so at
    /// most a dense object's worth is counted; otherwise opening one object a server says is
    /// 1 TiB would take 512 MiB of the cap and evict everything else.
    var overheadBytes: Int64 { min(format.dataOffset, 4096 + Int64(BlockIndex.denseLimit * CacheFileFormat.entrySize)) }

    static func diskBytes(_ length: Int) -> Int64 { Int64((length + 4095) / 4096 * 4096) }

    var storedBytes: Int64 {
        state.withLock { s in
            var total: Int64 = 0
            s.index.forEachPresent { _, e, _ in total += Self.diskBytes(Int(e.length)) }
            return total
        }
    }

    /// Object bytes in present blocks.
    var presentBytes: Int64 {
        state.withLock { s in
            var total: Int64 = 0
            s.index.forEachPresent { _, e, _ in total += Int64(e.length) }
            return total
        }
    }

    var isEmptyAndUnused: Bool { state.withLock { s in s.users == 0 && s.index.present == 0 } }

    func setTicks(_ t: UInt64) { state.withLock { $0.index.setAllTicks(t) } }

    /// A user (an open file handle, a cache copy being written) holds the object. The file is
    /// opened here the first time in this mount (to trim what a killed daemon left allocated,
    /// `trimAllocation`), otherwise at its next use (`withFile`).
    func open() {
        let opened = state.withLock { s -> Bool in
            s.users += 1
            guard !s.allocationChecked else { return false }
            s.allocationChecked = true
            if s.fd >= 0 {
                trimAllocation(&s)
                return false
            }
            s.fd = cache.files.openFile(hex) ?? -1
            guard s.fd >= 0 else { return false }
            trimAllocation(&s)
            return true
        }
        if opened {
            lastUsed.store(cache.tick(), ordering: .relaxed)
            cache.noteOpened(self)
        }
    }

    func close() {
        let closed = state.withLock { s -> Bool in
            s.users -= 1
            guard s.users == 0 else { return false }
            // Nobody writes it now (a cache copy keeps it in use): what the chunks allocated
            // ahead hold beyond the blocks written goes.
            if !s.allocatedChunks.isEmpty || s.fd >= 0 {
                let temporary = s.fd < 0
                if temporary { s.fd = cache.files.openFile(hex) ?? -1 }
                if s.fd >= 0 {
                    for c in s.allocatedChunks { punchAbsent(&s, in: chunkBlocks(c)) }
                    futimens(s.fd, nil)  // the file's mtime is its recency for the next mount's LRU
                }
                s.allocatedChunks.removeAll()
            }
            // An operation still using the descriptors (its caller let its user go early)
            // closes them when it ends (`withFile`).
            guard s.active == 0 else { return false }
            let wasOpen = s.fd >= 0
            closeDescriptors(&s)
            s.directRefused = false
            return wasOpen
        }
        if closed { cache.noteClosed(self) }
    }

    /// Recency among open files, for letting descriptors go (`BlockCache.noteOpened`).
    var lastUse: UInt64 { lastUsed.load(ordering: .relaxed) }
    private let lastUsed = Atomic<UInt64>(0)

    private func closeDescriptors(_ s: inout State) {
        if s.fd >= 0 { Glibc.close(s.fd) }
        s.fd = -1
        if s.directFD >= 0 { Glibc.close(s.directFD) }
        s.directFD = -1
    }

    /// Lets the descriptors go if no operation is using them (the file stays in use: its next
    /// operation opens it again). True if it closed them.
    func closeIfIdle() -> Bool {
        let closed = state.withLock { s -> Bool in
            guard s.active == 0, s.fd >= 0 else { return false }
            closeDescriptors(&s)
            return true
        }
        if closed { cache.noteClosed(self) }
        return closed
    }

    /// Runs `body` with the file's descriptors (buffered, and direct or -1), open for as long as
    /// it runs; nil, without running it, when nobody holds the object (`open`) or the file
    /// cannot be opened (no descriptor to spare, the file gone).
    ///
    /// The direct descriptor is opened only for `writing` (a file only read never holds one).
    func withFile<T>(writing: Bool = false, _ body: (_ fd: Int32, _ direct: Int32) -> T) -> T? {
        lastUsed.store(cache.tick(), ordering: .relaxed)
        let needsOpening = state.withLock { s -> Bool? in
            guard s.users > 0 else { return nil }
            s.active += 1
            return s.fd < 0
        }
        guard let needsOpening else { return nil }
        defer {
            let closed = state.withLock { s -> Bool in
                s.active -= 1
                guard s.active == 0, s.users == 0, s.fd >= 0 else { return false }
                closeDescriptors(&s)
                s.directRefused = false
                return true
            }
            if closed { cache.noteClosed(self) }
        }
        if needsOpening {
            // Opened outside the lock (a system call that may wait for the disk), kept if no
            // other use opened it meanwhile.
            let fd = cache.files.openFile(hex) ?? -1
            let installed = state.withLock { s -> Bool in
                guard s.fd < 0, fd >= 0 else { return false }
                s.fd = fd
                if !s.allocationChecked {
                    s.allocationChecked = true
                    trimAllocation(&s)
                }
                return true
            }
            if installed {
                cache.noteOpened(self)
            } else if fd >= 0 {
                Glibc.close(fd)
            }
        }
        if writing, cache.directWrites { openDirect() }
        let (fd, direct) = state.withLock { ($0.fd, $0.directRefused ? -1 : $0.directFD) }
        guard fd >= 0 else { return nil }
        return body(fd, direct)
    }

    /// Opens the direct descriptor beside the open buffered one, once (a use holds the file).
    /// One the filesystem refuses is not asked for again until the file is closed.
    private func openDirect() {
        let fd = state.withLock { s -> Int32 in s.directFD < 0 && !s.directRefused ? s.fd : -1 }
        guard fd >= 0 else { return }
        let direct = DirectWrites.reopen(fd) ?? -1
        if direct < 0 { cache.noteNoDirectWrites() }
        let kept = state.withLock { s -> Bool in
            guard direct >= 0 else {
                s.directRefused = true
                return true
            }
            guard s.directFD < 0, !s.directRefused else { return false }
            s.directFD = direct
            return true
        }
        if !kept { Glibc.close(direct) }
    }

    func isCached(_ block: Int) -> Bool { state.withLock { $0.index.isPresent(block) } }

    /// For each block of `blocks`: is it cached?
    func cachedMask(_ blocks: ClosedRange<Int>) -> [Bool] {
        state.withLock { s in blocks.map { s.index.isPresent($0) } }
    }

    /// How many bytes from `offset` (at most up to `end`) lie in consecutive cached blocks.
    func cachedBytes(from offset: Int64, upTo end: Int64) -> Int {
        let bs = Int64(format.blockSize)
        let first = Int(offset / bs)
        let last = Int((end - 1) / bs)
        let run = state.withLock { s -> Int in
            var b = first
            while b <= last, s.index.isPresent(b) { b += 1 }
            return b - first
        }
        guard run > 0 else { return 0 }
        return Int(min(end, Int64(first + run) * bs) - offset)
    }

    /// Asks the kernel to start reading these cached blocks from disk (a sequential reader is
    /// coming): the disk then streams ahead instead of being asked one request at a time.
    func willNeed(blocks: ClosedRange<Int>) {
        let from = format.blockOffset(blocks.lowerBound)
        let to = format.blockOffset(blocks.upperBound) + Int64(format.blockLength(blocks.upperBound))
        _ = withFile { fd, _ in posix_fadvise(fd, off_t(from), off_t(to - from), POSIX_FADV_WILLNEED) }
    }

    /// Copies bytes `[offset, offset + dst.count)` of the object into `dst` with one disk read,
    /// after checking the CRC32C of every block they touch. False (and a damaged block dropped)
    /// when any of them is absent or fails its check.
    func read(at offset: Int64, into dst: UnsafeMutableRawBufferPointer) -> Bool {
        guard dst.count > 0 else { return true }
        let bs = Int64(format.blockSize)
        let first = Int(offset / bs)
        let last = Int((offset + Int64(dst.count) - 1) / bs)
        let t = cache.tick()
        var crcs = [UInt32](repeating: 0, count: last - first + 1)
        let present = state.withLock { s -> Bool in
            for b in first...last {
                let e = s.index[b]
                if e.length == 0 { return false }
                crcs[b - first] = e.crc
                s.index.touch(b, tick: t)
            }
            return true
        }
        guard present else { return false }
        return withFile { fd, _ in readVerified(fd: fd, at: offset, into: dst, first: first, last: last, crcs: crcs) } ?? false
    }

    /// `read`'s disk read and checks, with the file open.
    private func readVerified(fd: Int32, at offset: Int64, into dst: UnsafeMutableRawBufferPointer,
                              first: Int, last: Int, crcs: [UInt32]) -> Bool {
        let bs = Int64(format.blockSize)
        let runStart = Int64(first) * bs
        let runLength = Int(min(format.objectSize, Int64(last + 1) * bs) - runStart)
        let direct = offset == runStart && dst.count == runLength
        let scratch = direct ? dst : UnsafeMutableRawBufferPointer.allocate(byteCount: runLength, alignment: 4096)
        defer { if !direct { scratch.deallocate() } }
        guard pread(fd, scratch.baseAddress, runLength, off_t(format.blockOffset(first))) == runLength else { return false }
        for b in first...last {
            let at = Int(Int64(b) * bs - runStart)
            let block = UnsafeRawBufferPointer(rebasing: scratch[at..<(at + format.blockLength(b))])
            if Checksum.crc32c(block) != crcs[b - first] {
                Log.debug("cache block failed verification object=\(hex.prefix(12)) block=\(b): refetching")
                _ = dropIfUnchanged(block: b, entry: CacheFileFormat.Entry(crc: crcs[b - first], length: UInt32(block.count)))
                return false
            }
        }
        if !direct {
            let skip = Int(offset - runStart)
            dst.copyMemory(from: UnsafeRawBufferPointer(rebasing: scratch[skip..<(skip + dst.count)]))
        }
        return true
    }

    /// Stores whole blocks starting at `first` from `bytes` (which hold exactly those blocks):
    /// each run of absent blocks with one data write and one index write (docs/architecture.md,
    /// "Cache writes").
    func store(first: Int, _ bytes: UnsafeRawBufferPointer, ahead: Bool = false) {
        _ = withFile(writing: true) { fd, direct in store(first: first, bytes, ahead: ahead, fd: fd, direct: direct) }
    }

    /// `store` with the file open: `direct` -1 where data goes through the page cache.
    private func store(first: Int, _ bytes: UnsafeRawBufferPointer, ahead: Bool, fd: Int32, direct directFD: Int32) {
        let serial = directFD < 0
        if serial { writing.lock() }
        defer { if serial { writing.unlock() } }
        // A file whose directory was deleted under the mount takes no more blocks: they could
        // never be evicted, yet would count against the cap.
        guard cache.tracks(self) else { return }
        let bs = format.blockSize
        let count = (bytes.count + bs - 1) / bs
        // At most 1 MiB reserved (and evicted for) at once; 4 MiB for direct writes, each of
        // which waits for the disk (a quarter of the cap at most).
        let maxRun = max(1, min(Int64(serial ? 1 << 20 : 4 << 20), cache.capacity / 4) / Int64(bs))
        var b = first
        while b < first + count {
            if cache.isDegraded { return }
            // The next run of blocks not cached yet.
            let (runFirst, runEnd) = state.withLock { s -> (Int, Int) in
                var a = b
                while a < first + count, s.index.isPresent(a) { a += 1 }
                var e = a
                while e < first + count, e - a < Int(maxRun), !s.index.isPresent(e) { e += 1 }
                return (a, e)
            }
            if runFirst >= runEnd { return }
            b = runEnd
            let from = (runFirst - first) * bs
            let to = min(bytes.count, (runEnd - first) * bs)
            let run = UnsafeRawBufferPointer(rebasing: bytes[from..<to])
            var entries: [CacheFileFormat.Entry] = []
            entries.reserveCapacity(runEnd - runFirst)
            var cost: Int64 = 0
            for k in runFirst..<runEnd {
                let length = format.blockLength(k)
                let at = (k - runFirst) * bs
                let crc = Checksum.crc32c(UnsafeRawBufferPointer(rebasing: run[at..<(at + length)]))
                entries.append(CacheFileFormat.Entry(crc: crc, length: UInt32(length)))
                cost += Self.diskBytes(length)
            }
            guard cache.reserve(cost) else { return }
            // A direct write refused by an earlier run (EINVAL) goes buffered from then on.
            let direct = state.withLock { $0.directRefused } ? -1 : directFD
            // Data first, then the index entries: a crash in between leaves blocks that are
            // simply absent. The data goes past the page cache where it can (`DirectWrites`).
            var stillDirect = direct
            if direct >= 0 { allocate(blocks: runFirst..<runEnd, direct: direct, ahead: ahead) }
            let wrote = DirectWrites.write(run, at: format.blockOffset(runFirst), buffered: fd, direct: &stillDirect)
            if stillDirect != direct { state.withLock { $0.directRefused = true } }
            guard wrote else {
                cache.unreserve(cost)
                cache.degrade("cannot write a cached block: \(String(cString: strerror(errno)))")
                return
            }
            // The index entries: set in memory first (the data is on disk already), then
            // written, the way the data went: past the page cache as whole pages built from
            // memory beside direct data writes, buffered beside buffered ones (which hold the
            // file's `writing` lock anyway; a page written direct would wait for the disk).
            // Every index write of a file holds `indexWriting`, so a page built from memory
            // never overwrites an entry written after it was built. Direct: the entries are set
            // before the lock, and a store that finds it taken leaves them to its holder.
            let duplicate: Int64
            var failure: Int32
            if stillDirect >= 0 {
                duplicate = setEntries(entries, from: runFirst, direct: true)
                failure = commitIndex(direct: stillDirect) {
                    // The device refused the alignment: these entries buffered.
                    self.writeEntries(entries, from: runFirst, fd: fd)
                }
            } else {
                indexWriting.lock()
                duplicate = setEntries(entries, from: runFirst, direct: false)
                failure = writeEntries(entries, from: runFirst, fd: fd)
                indexWriting.unlock()
            }
            if duplicate > 0 { cache.unreserve(duplicate) }
            guard failure == 0 else {
                cache.degrade("cannot write a cache index entry: \(String(cString: strerror(failure)))")
                return
            }
        }
    }

    /// Sets index entries in memory from block `first` on; returns the disk bytes of blocks
    /// that were present already (stored twice: counted once). Beside direct data writes
    /// (`direct`) their pages are marked for `writeDirtyPages`, and the set counted.
    private func setEntries(_ entries: [CacheFileFormat.Entry], from first: Int, direct: Bool) -> Int64 {
        let t = cache.tick()
        return state.withLock { s -> Int64 in
            var dup: Int64 = 0
            for (i, e) in entries.enumerated() {
                if s.index.isPresent(first + i) { dup += Self.diskBytes(Int(s.index[first + i].length)) }
                s.index.set(first + i, e, tick: t)
            }
            guard direct, !entries.isEmpty else { return dup }
            let page = DirectWrites.alignment
            let pages = Int(format.entryOffset(first)) / page...Int(format.entryOffset(first + entries.count) - 1) / page
            s.dirtyPages.formUnion(pages)
            s.setsMade += 1
            return dup
        }
    }

    /// The errno of a write that just failed; EIO for a short write, which sets none (0 would
    /// read as success).
    private static func lastFailure() -> Int32 { errno != 0 ? errno : EIO }

    /// The most index pages one write takes (a 1 MiB buffer at most).
    private static let pagesPerIndexWrite = 256

    /// Writes, past the page cache, every index page whose entries were set since it was last
    /// written. 0, or the errno of the write that failed (its pages stay marked, for the next
    /// store to try). The caller holds `indexWriting`.
    private func writeDirtyPages(direct: Int32) -> Int32 {
        let (pages, made) = state.withLock { s -> ([Int], UInt64) in
            guard s.setsWritten < s.setsMade else { return ([], s.setsWritten) }
            defer { s.dirtyPages.removeAll(keepingCapacity: true) }
            return (s.dirtyPages.sorted(), s.setsMade)
        }
        if pages.isEmpty {
            // Every set made so far was in a write that ended (an empty set has no pages).
            state.withLock { $0.setsWritten = max($0.setsWritten, made) }
            return 0
        }
        var i = 0
        while i < pages.count {
            var j = i + 1
            while j < pages.count, pages[j] == pages[j - 1] + 1, j - i < Self.pagesPerIndexWrite { j += 1 }
            guard writeEntryPages(pages: pages[i]..<(pages[j - 1] + 1), direct: direct) else {
                let failure = Self.lastFailure()
                state.withLock { $0.dirtyPages.formUnion(pages) }
                return failure
            }
            i = j
        }
        state.withLock { $0.setsWritten = max($0.setsWritten, made) }
        return 0
    }

    /// Writes entries through the page cache (a file with no direct descriptor): 0, or the
    /// errno of the failed write, as `writeDirtyPages`.
    private func writeEntries(_ entries: [CacheFileFormat.Entry], from first: Int, fd: Int32) -> Int32 {
        let encoded = CacheFileFormat.encode(entries)
        indexWriteCount.add(1, ordering: .relaxed)
        let written = encoded.withUnsafeBytes { pwrite(fd, $0.baseAddress, $0.count, off_t(format.entryOffset(first))) }
        return written == encoded.count ? 0 : Self.lastFailure()
    }

    /// Writes index pages `pages` (page numbers in the file) past the page cache, each built
    /// whole (header, entries) from the index in memory. A buffered write of a few entries
    /// takes the file's inode lock exclusively and so waits for every direct data write under
    /// way, and holds up the ones after it; a direct overwrite of a whole page runs beside
    /// them. The index pages are allocated on the first write (so every later one is an
    /// overwrite): as much as the cap counts for them (`overheadBytes`). False on a failed
    /// write (errno says why: EINVAL, the device refused the alignment). The caller holds
    /// `indexWriting`.
    private func writeEntryPages(pages: Range<Int>, direct: Int32) -> Bool {
        let page = DirectWrites.alignment
        let from = pages.lowerBound * page
        let to = pages.upperBound * page
        let pages = UnsafeMutableRawBufferPointer.allocate(byteCount: to - from, alignment: page)
        defer { pages.deallocate() }
        let allocate = state.withLock { s -> Bool in
            pages.initializeMemory(as: UInt8.self, repeating: 0)
            if from == 0 {
                let header = format.encodeHeader()
                header.withUnsafeBytes { pages.copyMemory(from: $0) }
            }
            let firstEntry = max(0, (from - CacheFileFormat.headerSize) / CacheFileFormat.entrySize)
            let endEntry = min(format.blockCount, (to - CacheFileFormat.headerSize) / CacheFileFormat.entrySize)
            if firstEntry < endEntry {
                for b in firstEntry..<endEntry where s.index.isPresent(b) {
                    let at = Int(format.entryOffset(b)) - from
                    let e = s.index[b]
                    pages.storeBytes(of: e.crc.littleEndian, toByteOffset: at, as: UInt32.self)
                    pages.storeBytes(of: e.length.littleEndian, toByteOffset: at + 4, as: UInt32.self)
                }
            }
            defer { s.indexAllocated = true }
            return !s.indexAllocated
        }
        if allocate { SparseFile.allocate(direct, offset: 0, length: min(format.dataOffset, overheadBytes)) }
        indexWriteCount.add(1, ordering: .relaxed)
        return pwrite(direct, pages.baseAddress, pages.count, off_t(from)) == pages.count
    }

    /// The blocks of allocation chunk `c`.
    private func chunkBlocks(_ c: Int) -> Range<Int> {
        let perChunk = Int(allocationChunk / Int64(format.blockSize))
        return min(format.blockCount, c * perChunk)..<min(format.blockCount, (c + 1) * perChunk)
    }

    /// Punches every run of absent blocks in `blocks` (under the state lock, with the file open).
    private func punchAbsent(_ s: inout State, in blocks: Range<Int>) {
        var b = blocks.lowerBound
        while b < blocks.upperBound {
            while b < blocks.upperBound, s.index.isPresent(b) { b += 1 }
            var e = b
            while e < blocks.upperBound, !s.index.isPresent(e) { e += 1 }
            if e > b {
                let from = Int64(b) * Int64(format.blockSize)
                let to = min(format.objectSize, Int64(e) * Int64(format.blockSize))
                _ = SparseFile.punchHole(s.fd, offset: format.dataOffset + from, length: to - from)
            }
            b = e
        }
    }

    /// A file that holds more disk than its blocks and index (chunks allocated ahead by a
    /// daemon killed before it closed the file) lets the rest go, the first time a mount opens it.
    private func trimAllocation(_ s: inout State) {
        var st = stat()
        guard fstat(s.fd, &st) == 0 else { return }
        var stored: Int64 = 0
        s.index.forEachPresent { _, e, _ in stored += Self.diskBytes(Int(e.length)) }
        guard Int64(st.st_blocks) * 512 > overheadBytes + stored + (1 << 20) else { return }
        var present: [Int] = []
        s.index.forEachPresent { b, _, _ in present.append(b) }
        present.sort()
        var next = 0
        for b in present + [format.blockCount] {
            if b > next {
                let from = Int64(next) * Int64(format.blockSize)
                let to = min(format.objectSize, Int64(b) * Int64(format.blockSize))
                _ = SparseFile.punchHole(s.fd, offset: format.dataOffset + from, length: to - from)
            }
            next = b + 1
        }
    }

    /// Allocates the data of `blocks` before a direct write into them, so that the write is an
    /// overwrite, which ext4 runs under a shared inode lock beside the file's other writers.
    /// Read-ahead (`ahead`) allocates whole `allocationChunk`s once each; a reader's own miss
    /// (random reads, mostly) only its own range.
    ///
    /// Each allocation waits for every direct write of the file under way, so read-ahead that
    /// needs a chunk also allocates the chunks after it, as many as the file has allocated
    /// already (up to `allocationRunChunks`): a file read from its start allocates 16, 32, 64,
    /// then 128 MiB at a time. Disk the cap does not count thus grows with what the file holds,
    /// as read-ahead grows with evidence: a `head` of a large file still allocates one chunk
    /// (docs/architecture.md, "Cache writes"). A chunk is claimed before its `fallocate`, so two
    /// stores never allocate it twice; a store into a chunk still being allocated writes into
    /// unallocated blocks, which is slower beside other writers but right.
    private func allocate(blocks: Range<Int>, direct: Int32, ahead: Bool) {
        let bs = Int64(format.blockSize)
        let from = Int64(blocks.lowerBound) * bs
        let to = min(format.objectSize, Int64(blocks.upperBound) * bs)
        let chunk = allocationChunk
        guard ahead, chunk > 0 else {
            SparseFile.allocate(direct, offset: format.dataOffset + from, length: to - from)
            return
        }
        let chunks = Int((format.objectSize + chunk - 1) / chunk)
        let most = allocationRunChunks
        let claimed = state.withLock { s -> ClosedRange<Int>? in
            let needed = (Int(from / chunk)...Int((to - 1) / chunk)).filter { !s.allocatedChunks.contains($0) }
            guard let first = needed.first, let last = needed.last else { return nil }
            let ahead = min(s.allocatedChunks.count, most - needed.count)
            var end = last
            while end + 1 - last <= ahead, end + 1 < chunks, !s.allocatedChunks.contains(end + 1) { end += 1 }
            s.allocatedChunks.formUnion(first...end)
            return first...end
        }
        guard let claimed else { return }
        // One `fallocate` for the run: the chunks a store needs (one or two: a run is at most
        // 4 MiB) and those ahead of them. A run that fails stays claimed: what it did
        // allocate (ext4 keeps the blocks it allocated before running out of space) is punched
        // with the rest at close, and writes into what it did not are slower beside other
        // writers, still right. Nothing is tried again in this open, as a full disk or a
        // filesystem without `fallocate` would refuse each try anyway.
        let start = Int64(claimed.lowerBound) * chunk
        let end = min(format.objectSize, Int64(claimed.upperBound + 1) * chunk)
        SparseFile.allocate(direct, offset: format.dataOffset + start, length: end - start)
    }

    /// Stores blocks (as `store(first:_:)`), then, if that made the object complete, checks it
    /// end to end: the blocks' CRC32Cs combined must equal the object's `crc32c`.
    func storeAndCheck(first: Int, _ bytes: UnsafeRawBufferPointer) -> Completion {
        store(first: first, bytes)
        return checkIfComplete()
    }

    /// Tells the object its expected CRC32C (from the metadata of an open); a complete object
    /// found on disk is checked at once. nil: nothing to check against (no `crc32c`).
    func expect(crc32c: UInt32?) -> Completion {
        guard let crc32c else { return .incomplete }
        state.withLock { s in
            if s.expected != crc32c { s.expected = crc32c; s.verified = false }
        }
        return checkIfComplete()
    }

    /// Whether storing the blocks of `ranges` would leave no block missing.
    func wouldComplete(_ ranges: [ClosedRange<Int>]) -> Bool {
        state.withLock { s in
            // Most downloads of a large object are far from completing it: no per-block walk.
            guard ranges.reduce(0, { $0 + $1.count }) >= s.index.count - s.index.present else { return false }
            var missing = Set<Int>()  // the ranges may overlap (a download made again)
            for r in ranges { for b in r where !s.index.isPresent(b) { missing.insert(b) } }
            return s.index.present + missing.count == s.index.count
        }
    }

    var isVerified: Bool { state.withLock { $0.verified } }

    /// Bytes of this object were served before a mismatch showed they may be wrong: every
    /// file open on it until now fails its further reads (the kernel would otherwise retry a
    /// failed page and hide the error), and opens after this drop the kernel's page cache.
    func noteServedWrong() { servedWrong.add(1, ordering: .releasing) }

    /// How many times bytes of this object were found wrong after readers may have had them; a
    /// stream opened before the latest one fails its reads (docs/integrity.md). Read on every
    /// read: an atomic, not the state lock its readers share.
    var servedWrongEpoch: Int { servedWrong.load(ordering: .acquiring) }

    /// An end-to-end check of a completing download (`BlockReader.completeAndCheck`) begins:
    /// from now until `endCheck`, bytes read from this file may be that download's, unchecked.
    /// Readers take `checkEpoch` and `isChecking` before they copy and look again after: a read
    /// that overlapped a check waits for it and honours its verdict (docs/integrity.md).
    func beginCheck() {
        checksRunning.add(1, ordering: .sequentiallyConsistent)
        checksBegun.add(1, ordering: .sequentiallyConsistent)
    }

    /// The check is over; called after `noteServedWrong` if it found wrong bytes served, so a
    /// reader that sees it over sees the verdict too.
    func endCheck() { checksRunning.subtract(1, ordering: .sequentiallyConsistent) }

    /// How many checks have begun (read before `isChecking`).
    var checkEpoch: Int { checksBegun.load(ordering: .sequentiallyConsistent) }

    var isChecking: Bool { checksRunning.load(ordering: .sequentiallyConsistent) > 0 }

    /// Whether a known CRC32C still waits to be checked (so completing the object matters).
    var awaitsCheck: Bool { state.withLock { $0.expected != nil && !$0.verified } }

    /// If every block is present and not yet verified: combines and compares (a mismatch drops
    /// every block). The block reader calls it under its object's check lock.
    func checkIfComplete() -> Completion {
        // Copied out under the lock, combined outside it (a large object has many blocks).
        let snapshot = state.withLock { s -> (crcs: [UInt32], expected: UInt32)? in
            guard let expected = s.expected, !s.verified, let crcs = s.index.allCRCs() else { return nil }
            return (crcs, expected)
        }
        guard let snapshot else { return state.withLock { $0.verified } ? .verified : .incomplete }
        let combined = Checksum.crc32c(combining: snapshot.crcs, blockLength: format.blockSize,
                                       lastLength: format.blockLength(format.blockCount - 1))
        if combined == snapshot.expected {
            state.withLock { s in if s.expected == snapshot.expected { s.verified = true } }
            return .verified
        }
        Log.warn("op=verify cache_file=\(hex.prefix(12)) crc32c mismatch: blocks combine to \(String(combined, radix: 16)), "
                 + "the object says \(String(snapshot.expected, radix: 16)); dropping every cached block of it")
        cache.unreserve(evictAll())
        return .mismatch(previous: snapshot.crcs)
    }

    /// The end-to-end check of a download that would complete the object, made before its
    /// bytes are stored (docs/integrity.md, "Checked before stored"): every block's CRC32C comes
    /// from the index where the block is present, else from the finished download in `pending`
    /// that holds it (the completing one and those whose cache copy is still being written).
    /// True when they combine to the object's CRC32C; false when they do not; nil when it
    /// cannot tell (a block in neither, no CRC32C to compare with, or already verified). It
    /// marks nothing verified and drops nothing: the cache copies, once made, are checked again
    /// from the index (`checkIfComplete`), and a mismatch here is left to the full check.
    func matchesBeforeStoring(_ pending: [(first: Int, bytes: UnsafeRawBufferPointer)]) -> Bool? {
        let snapshot = state.withLock { s -> (crcs: [UInt32], present: [Bool], expected: UInt32)? in
            guard let expected = s.expected, !s.verified else { return nil }
            var crcs = [UInt32](repeating: 0, count: s.index.count)
            var present = [Bool](repeating: false, count: s.index.count)
            s.index.forEachPresent { b, e, _ in
                crcs[b] = e.crc
                present[b] = true
            }
            return (crcs, present, expected)
        }
        guard var snapshot else { return nil }
        let bs = format.blockSize
        for (first, bytes) in pending {
            var b = first
            while b < format.blockCount, (b - first) * bs < bytes.count {
                if !snapshot.present[b] {
                    let at = (b - first) * bs
                    let length = format.blockLength(b)
                    guard at + length <= bytes.count else { return nil }
                    snapshot.crcs[b] = Checksum.crc32c(UnsafeRawBufferPointer(rebasing: bytes[at..<(at + length)]))
                    snapshot.present[b] = true
                }
                b += 1
            }
        }
        guard !snapshot.present.contains(false) else { return nil }
        return Checksum.crc32c(combining: snapshot.crcs, blockLength: bs,
                               lastLength: format.blockLength(format.blockCount - 1)) == snapshot.expected
    }

    /// Drops every block (index and disk) at once; returns the disk bytes freed.
    func evictAll() -> Int64 {
        // Under `indexWriting`: an index page built before this and written after it would
        // bring the entries back (their blocks then fail their checks: refetched, but untidy).
        indexWriting.lock()
        defer { letGoOfIndexWriting() }
        return state.withLock { s -> Int64 in
            var freed: Int64 = 0
            s.index.forEachPresent { _, e, _ in freed += Self.diskBytes(Int(e.length)) }
            s.index.removeAll()
            s.verified = false
            s.allocatedChunks.removeAll()
            s.indexAllocated = false
            // Nothing set so far is left to write: every entry is gone.
            s.dirtyPages.removeAll()
            s.setsWritten = s.setsMade
            let temporary = s.fd < 0
            let fd = temporary ? (cache.files.openFile(hex) ?? -1) : s.fd
            guard fd >= 0 else { return freed }
            // The index first (a punched hole reads as zeros: every block absent), then the
            // data's disk space.
            _ = SparseFile.punchHole(fd, offset: Int64(CacheFileFormat.headerSize),
                                     length: Int64(CacheFileFormat.entrySize * format.blockCount))
            _ = SparseFile.punchHole(fd, offset: format.dataOffset, length: format.objectSize)
            if temporary { Glibc.close(fd) }
            return freed
        }
    }

    func collectBlocks(into out: inout [(tick: UInt64, object: CachedObject, block: Int)]) {
        state.withLock { s in
            s.index.forEachPresent { block, _, tick in out.append((tick, self, block)) }
        }
    }

    /// Drops a block from the index and the disk; returns the disk bytes freed. The descriptor
    /// is used under the lock that guards its lifetime: a descriptor closed and reused meanwhile
    /// would otherwise take these writes into another file.
    func evict(block: Int) -> Int64 {
        indexWriting.lock()  // as in `evictAll`
        defer { letGoOfIndexWriting() }
        return state.withLock { s -> Int64 in
            let entry = s.index[block]
            guard entry.length != 0 else { return 0 }
            s.index.set(block, .absent, tick: 0)
            s.verified = false  // complete again later: checked again then
            let temporary = s.fd < 0
            let fd = temporary ? (cache.files.openFile(hex) ?? -1) : s.fd
            if fd >= 0 {
                let zero = CacheFileFormat.encode(.absent)
                _ = zero.withUnsafeBytes { pwrite(fd, $0.baseAddress, $0.count, off_t(format.entryOffset(block))) }
                _ = SparseFile.punchHole(fd, offset: format.blockOffset(block), length: Int64(entry.length))
                if temporary { Glibc.close(fd) }
            }
            return Self.diskBytes(Int(entry.length))
        }
    }

    /// A block that failed verification is removed, unless a writer replaced it meanwhile.
    private func dropIfUnchanged(block: Int, entry: CacheFileFormat.Entry) -> Int64 {
        let same = state.withLock { $0.index[block] == entry }
        guard same else { return 0 }
        let freed = evict(block: block)
        cache.unreserve(freed)
        return freed
    }
}
