import Foundation
import Glibc
import StorageClient
import Synchronization

// The block cache: this file holds the cache directory as a whole (its locks, the owner
// record, recovery after `rm -rf`, the cap and LRU eviction, the start-up scan);
// `CachedObject.swift` one object generation's file (reads, stores),
// `CachedObject+IndexCommit.swift` its index writes (the group commit),
// `CachedObject+Allocation.swift` the allocation of its data ahead of direct writes,
// `CachedObject+Eviction.swift` dropping its blocks, and
// `CachedObject+Integrity.swift` the whole-object check's state (docs/integrity.md).
//
// LOCK ORDER (the cache's part; a thread holding one may take only those below it):
//
//   1. BlockCache.creating          (NSLock)  one file creator, recovery or clear at a time
//   2. CachedObject.writing         (NSLock)  one buffered store per file
//   3. CachedObject.indexWriting    (NSLock)  one index write per file (the group commit)
//   4. BlockCache.state             (Mutex)   objects, usedBytes, degradedUntil
//   5. CachedObject.state           (Mutex)   the index in memory, descriptors, users
//   6. BlockCache.directories       (Mutex)   the CacheDirectory and `v1/.lock`
//   7. BlockCache.openFiles         (Mutex)   leaf: never held while an object's lock is taken
//   -  CacheWriter.room             (NSCondition) leaf: the write queue's backlog only
//
// Eviction (`reserve` → `evict`) runs with 1 or 2 held by the caller and takes 3 then 5 of
// each victim in turn, never two objects' locks of one level at once. Atomics (the clock,
// `lastUsed`, the check epochs) are not locks and may be read under any of these.
//
// Held across disk I/O: 1 (creating a file: mkdirat, openat, pwrite, ftruncate, renameat;
// clear's eviction), 2 (a buffered store's data and index writes, and eviction for its
// room), 3 (index page writes, fallocate of the index; eviction's entry write and hole
// punches), 4 only in `acquire` → `CachedObject.open` and eviction's removal of empty files
// (openat/fstat/trim of a file's first open; unlinkat), 5 in `open`/`close` (the first
// open's openat and `trimAllocation`; close's punches of unused allocation, futimens and
// close) and 6 (writing `v1/.lock`; `CacheDirectory.openFile`'s openat under 5). None is
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
    /// Guards `files` (replaced by recovery) and `v1/.lock`'s descriptor and text. Level 6 of
    /// the lock order; held across the lock file's writes and `CacheDirectory.openFile`.
    private let directories: Mutex<Directories>
    /// A descriptor of `cache_dir` itself, locked (flock) for the life of the process: the
    /// lock is released when the process ends, and survives `rm -rf cache_dir/v1`.
    private let topLock: Int32

    private struct State: ~Copyable {
        var objects: [String: CachedObject] = [:]
        var usedBytes: Int64 = 0
        var degradedUntil: Double = 0
    }

    /// Guards the objects known, the bytes counted against the cap and the pause. Level 4;
    /// taken under a store's `writing` (`tracks`), never while an object's `state` is held.
    private let state = Mutex(State())
    /// Objects whose cache file is open now, and how many may be: other users of an
    /// `allow_other` mount choose how many files are open, so the open count does not decide
    /// the descriptor count. Past `maxOpenFiles`, the least recently used files that no
    /// operation is using let their descriptors go; they are opened again on their next use
    /// (docs/security.md, "Local users on an allow_other mount"). Level 7, a leaf: never held
    /// while an object's lock is taken, and no lock is taken under it.
    private let openFiles = Mutex([ObjectIdentifier: CachedObject]())
    let maxOpenFiles: Int
    /// One creator of a cache file at a time (two first opens racing to rename onto one name),
    /// and recovery and `clear` beside them. Level 1, the outermost; held across the file's
    /// creation and clear's eviction (disk I/O).
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
