import Locking
import Glibc
import StorageClient
import Synchronization
internal import CBlockCache

/// The namespace on disk, beside the block cache (docs/architecture.md, "Offline namespace",
/// which gives the format): what is needed to serve known paths after a remount
/// with the bucket unreachable — the name, size, generation and time of every file opened
/// (whose blocks the cache may hold), and the directory listings fetched.
///
/// One append-only log per mounted source, `cache_dir/ns-v1/<source hash>.log`, made of
/// checksummed records; a torn tail (a crash mid-append) is cut off at load, and the log is
/// rewritten compactly (temporary file, fsync, rename) when it holds mostly superseded
/// records. Appends happen on a thread of their own, never on a FUSE thread. What is loaded
/// only ever answers while the bucket cannot: fresh answers replace it.
///
/// Several mounts of one source may share the log (one cache directory, docs/cache.md): each
/// appends whole records with `O_APPEND` (one `write` a record, so records never interleave),
/// holds a shared `flock` on the log while it has it open, and rewrites it (compaction, a torn
/// tail cut off) only when it can have it alone; otherwise it reads it as it is and appends.
public final class NamespaceStore: Sendable {
    static let versionName = "ns-v1"
    static let magic: [UInt8] = Array("storefs-namespace\n".utf8)
    static let formatVersion: UInt32 = 2
    /// Largest log read at mount; past it appends of listings stop (files go on).
    static let maxLogBytes = 256 << 20
    /// Largest listing written (entries).
    static let maxStoredListing = 100_000
    /// Files recorded per mount, at most (the memory of what was written is bounded too).
    static let maxFiles = 1_000_000

    public struct Loaded: Sendable {
        public var files: [(path: String, record: FileRecord)] = []
        public var listings: [(path: String, listing: DirectoryListing)] = []
        public var isEmpty: Bool { files.isEmpty && listings.isEmpty }
    }

    private let directory: CacheDirectory
    private let fileName: String
    private let log: OrderedMutex<Int32>
    /// Its one thread (`WorkerPools.namespace`; threads start at the first record, after the
    /// daemon has forked).
    private let writer: WorkerPool
    private let written = OrderedMutex(.namespaceWritten, Written())
    /// Records appended but not yet written: the writer takes all of them at once, so a
    /// burst of opens (a thousand files by 16 threads) costs a few wake-ups and writes, not
    /// one each.
    private let pending = OrderedMutex(.namespacePending, [UInt8]())
    private struct Written {
        var files: [ByteName: Int64] = [:]
        var listings: [ByteName: UInt64] = [:]
        var bytes = 0
    }

    /// Opens (creating) the log of `source` under `cacheDirectory` (which the block cache has
    /// already verified and locked). `writer`: the thread that appends records.
    public init(cacheDirectory: String, source: String,
                writer: WorkerPool = WorkerPool(threads: 1, name: "storefs-ns")) throws(FilesystemError) {
        self.writer = writer
        do throws(CacheDirectory.Refused) {
            directory = try CacheDirectory(directory: cacheDirectory, versionName: Self.versionName)
        } catch {
            throw FilesystemError(.invalidArgument, error.message)
        }
        // Another mount may be compacting its log right now: only old temporary files go.
        directory.removeTemporaryPlainFiles(all: false)
        fileName = Self.fileName(source: source)
        guard let fd = Self.openLog(directory, fileName, create: true) else {
            throw FilesystemError(.invalidArgument, "cannot open \(directory.versionPath)/\(fileName): \(String(cString: strerror(errno)))")
        }
        log = OrderedMutex(.namespaceLog, fd)
    }

    /// Opens the log for appending, with a shared lock held while it is open; a log another
    /// mount replaced while the lock was awaited (compaction renames a new one into place) is
    /// opened again by name.
    private static func openLog(_ directory: CacheDirectory, _ name: String, create: Bool) -> Int32? {
        for _ in 0..<3 {
            guard let fd = directory.openPlainFile(name, flags: O_RDWR | O_APPEND | (create ? O_CREAT : 0)) else { return nil }
            while flock(fd, LOCK_SH) != 0 && errno == EINTR {}
            var st = stat()
            if fstat(fd, &st) == 0 && st.st_nlink > 0 {
                startIfEmpty(fd)
                return fd
            }
            close(fd)
        }
        return nil
    }

    deinit { _ = log.withLock { close($0) } }

    static func fileName(source: String) -> String {
        var h: UInt64 = 0xcbf2_9ce4_8422_2325
        for b in source.utf8 { h = (h ^ UInt64(b)) &* 0x100_0000_01b3 }
        let hex = String(h, radix: 16)
        return String(repeating: "0", count: 16 - hex.count) + hex + ".log"
    }

    /// Whether `cacheDirectory` holds a stored namespace for `source` (offline=auto at mount).
    public static func hasStoredNamespace(cacheDirectory: String, source: String) -> Bool {
        let path = cacheDirectory + "/" + versionName + "/" + fileName(source: source)
        var st = stat()
        return lstat(path, &st) == 0 && st.st_mode & S_IFMT == S_IFREG && st.st_uid == geteuid()
            && Int(st.st_size) > magic.count + 4
    }

    // MARK: Loading

    /// Reads the log: the last record of each path wins. A torn or corrupt tail is cut off; a
    /// log of another format is started afresh. Rewrites it compactly when that halves it.
    public func load() -> Loaded {
        let bytes = log.withLock { fd -> [UInt8] in
            let size = Int(lseek(fd, 0, SEEK_END))
            guard size > 0 else { return [] }
            var buf = [UInt8](repeating: 0, count: min(size, Self.maxLogBytes))
            let n = buf.withUnsafeMutableBytes { pread(fd, $0.baseAddress, $0.count, 0) }
            return n > 0 ? Array(buf.prefix(n)) : []
        }
        var files: [ByteName: FileRecord] = [:]
        var listings: [ByteName: DirectoryListing] = [:]
        var reader = RecordReader(bytes)
        var valid = 0
        if reader.readHeader() {
            valid = reader.offset
            while let record = reader.next() {
                switch record {
                case .file(let path, let r): files[ByteName(path)] = r
                case .listing(let path, let l): listings[ByteName(path)] = l
                }
                valid = reader.offset
            }
        }
        var loaded = Loaded()
        loaded.files = files.map { ($0.key.string, $0.value) }
        loaded.listings = listings.map { ($0.key.string, $0.value) }
        let compact = Self.encode(loaded)
        written.withLock { w in
            for (p, r) in files { w.files[p] = r.generation }
            for (p, l) in listings { w.listings[p] = Self.digest(l) }
            w.bytes = compact.count
        }
        if valid == 0 || compact.count * 2 < valid || valid < bytes.count {
            // A fresh log, a torn tail, or mostly superseded records: write the compact form,
            // if no other mount has the log open (it appends to the file it has: a log renamed
            // into place under it would lose what it appends). A tail another mount is writing
            // right now looks torn too, and is then not cut off.
            let alone = log.withLock { fd in
                if flock(fd, LOCK_EX | LOCK_NB) == 0 { return true }
                while flock(fd, LOCK_SH) != 0 && errno == EINTR {}  // a failed conversion let it go
                return false
            }
            if alone {
                if directory.replacePlainFile(fileName, with: compact) {
                    reopen()
                } else {
                    Log.warn("namespace: cannot rewrite \(directory.versionPath)/\(fileName): \(String(cString: strerror(errno)))")
                    log.withLock { fd in _ = flock(fd, LOCK_SH) }
                }
            }
        }
        return loaded
    }

    /// A new (empty) log gets its header now, before any record, whether or not another mount
    /// has it open too: one at a time (an open file description lock on its first byte), and
    /// only while it is still empty, so that two mounts starting at once write it once.
    private static func startIfEmpty(_ fd: Int32) {
        _ = cblockcache_lock_range(fd, 0, 1, 1, 1)
        defer { _ = cblockcache_unlock_range(fd, 0, 1) }
        var st = stat()
        guard fstat(fd, &st) == 0, st.st_size == 0 else { return }
        let header = encode(Loaded())
        _ = header.withUnsafeBytes { Glibc.write(fd, $0.baseAddress, $0.count) }
    }

    /// The log was replaced (the exclusive lock held on the old one meanwhile): the new one is
    /// opened and locked, then the old one let go, so no mount opens the new one unlocked.
    private func reopen() {
        guard let fd = directory.openPlainFile(fileName, flags: O_RDWR | O_APPEND) else { return }
        _ = flock(fd, LOCK_SH)
        log.withLock { old in
            close(old)
            old = fd
        }
    }

    // MARK: Recording

    /// Remembers that `path` is this file (when opened: its blocks may now be cached).
    public func recordFile(_ path: String, _ record: FileRecord) {
        let key = ByteName(path)
        let isNew = written.withLock { w -> Bool in
            // Bounded: past the log's size limit (or a million files this mount) nothing more
            // is recorded until the next mount compacts the log.
            guard w.files[key] != record.generation, w.bytes < Self.maxLogBytes, w.files.count < Self.maxFiles else {
                return false
            }
            w.files[key] = record.generation
            return true
        }
        guard isNew else { return }
        var out: [UInt8] = []
        Self.appendRecord(&out) { p in
            p.append(1)
            Self.put(string: path, &p)
            Self.put(record: record, &p)
        }
        append(out)
    }

    /// Remembers a directory's listing (only when it changed, and while the log is small).
    public func recordListing(_ path: String, _ listing: DirectoryListing) {
        guard listing.count <= Self.maxStoredListing else { return }
        let key = ByteName(path)
        let digest = Self.digest(listing)
        let isNew = written.withLock { w -> Bool in
            guard w.listings[key] != digest, w.bytes < Self.maxLogBytes / 2 else { return false }
            w.listings[key] = digest
            return true
        }
        guard isNew else { return }
        writer.submit { [self] in
            var out: [UInt8] = []
            Self.appendRecord(&out) { p in Self.put(listing: listing, at: path, &p) }
            write(out)
        }
    }

    private func append(_ bytes: [UInt8]) {
        let first = pending.withLock { p -> Bool in
            defer { p += bytes }
            return p.isEmpty
        }
        // A job is queued while records wait; the first record after it took them queues
        // the next.
        guard first else { return }
        writer.submit { [self] in
            let all = pending.withLock { p -> [UInt8] in
                defer { p = [] }
                return p
            }
            write(all)
        }
    }

    private func write(_ bytes: [UInt8]) {
        written.withLock { $0.bytes += bytes.count }
        // One `write` with O_APPEND: the record lands whole after whatever another mount
        // appended, never over it.
        log.withLock { fd in
            var done = 0
            while done < bytes.count {
                let n = bytes.withUnsafeBytes { Glibc.write(fd, $0.baseAddress! + done, $0.count - done) }
                if n <= 0 { break }
                done += n
            }
        }
    }

    /// Waits until every record asked for is written (unmount).
    public func flush(timeout: Double) {
        _ = writer.drain(timeout: timeout)
    }

    // MARK: Encoding (docs/architecture.md, "Offline namespace")

    enum Record {
        case file(String, FileRecord)
        case listing(String, DirectoryListing)
    }

    static func encode(_ loaded: Loaded) -> [UInt8] {
        var out = magic
        put(u32: formatVersion, &out)
        for (path, record) in loaded.files {
            appendRecord(&out) { p in
                p.append(1)
                put(string: path, &p)
                put(record: record, &p)
            }
        }
        for (path, listing) in loaded.listings {
            appendRecord(&out) { p in put(listing: listing, at: path, &p) }
        }
        return out
    }

    /// A frame: payload length (u32), crc32c of the payload (u32), payload.
    static func appendRecord(_ out: inout [UInt8], _ fill: (inout [UInt8]) -> Void) {
        var payload: [UInt8] = []
        fill(&payload)
        put(u32: UInt32(payload.count), &out)
        put(u32: payload.withUnsafeBytes { Checksum.crc32c($0) }, &out)
        out += payload
    }

    static func put(listing: DirectoryListing, at path: String, _ p: inout [UInt8]) {
        p.append(2)
        put(string: path, &p)
        put(u32: UInt32(listing.count), &p)
        for (name, entry) in zip(listing.names, listing.entries) {
            switch entry {
            case .directory: p.append(0)
            case .file: p.append(1)
            case .unsizedFile: p.append(2)
            }
            put(string: name, &p)
            if case .file(let r) = entry { put(record: r, &p) }
        }
    }

    static func put(u32 v: UInt32, _ out: inout [UInt8]) { withUnsafeBytes(of: v.littleEndian) { out += $0 } }
    static func put(u64 v: UInt64, _ out: inout [UInt8]) { withUnsafeBytes(of: v.littleEndian) { out += $0 } }

    static func put(string s: String, _ out: inout [UInt8]) {
        put(u32: UInt32(s.utf8.count), &out)
        out += s.utf8
    }

    static func put(record r: FileRecord, _ out: inout [UInt8]) {
        put(u64: UInt64(bitPattern: r.size), &out)
        put(u64: UInt64(bitPattern: r.generation), &out)
        put(u64: UInt64(bitPattern: r.modified.seconds), &out)
        put(u32: UInt32(bitPattern: r.modified.nanoseconds), &out)
        let crc = Array((r.crc32c ?? "").utf8.prefix(15))
        out.append(UInt8(crc.count))
        out += crc
        withUnsafeBytes(of: (r.posixMode ?? 0xFFFF).littleEndian) { out += $0 }
        put(u32: r.posixUID ?? .max, &out)
        put(u32: r.posixGID ?? .max, &out)
        out.append(r.symlink?.rawValue ?? 0)
        withUnsafeBytes(of: r.metadataTargetLength.littleEndian) { out += $0 }
    }

    static func digest(_ l: DirectoryListing) -> UInt64 {
        var out: [UInt8] = []
        put(listing: l, at: "", &out)
        var h: UInt64 = 0xcbf2_9ce4_8422_2325
        for b in out { h = (h ^ UInt64(b)) &* 0x100_0000_01b3 }
        return h
    }
}

/// Parses the log, trusting nothing: every length is bounded by what is left, every record's
/// checksum is checked, and the first bad frame ends the log.
struct RecordReader {
    let bytes: [UInt8]
    private(set) var offset = 0

    init(_ bytes: [UInt8]) { self.bytes = bytes }

    mutating func readHeader() -> Bool {
        let m = NamespaceStore.magic
        guard bytes.count >= m.count + 4, Array(bytes[0..<m.count]) == m else { return false }
        offset = m.count
        guard let v = u32(), v == NamespaceStore.formatVersion else { return false }
        return true
    }

    mutating func next() -> NamespaceStore.Record? {
        let start = offset
        guard let length = u32().map(Int.init), let crc = u32(), length <= bytes.count - offset else {
            offset = start
            return nil
        }
        let payload = Array(bytes[offset..<(offset + length)])
        guard payload.withUnsafeBytes({ Checksum.crc32c($0) }) == crc else {
            offset = start
            return nil
        }
        offset += length
        var p = RecordReader(payload)
        guard let record = p.record() else {
            offset = start
            return nil
        }
        return record
    }

    private mutating func record() -> NamespaceStore.Record? {
        guard let type = u8(), let path = string() else { return nil }
        switch type {
        case 1:
            guard let r = fileRecord() else { return nil }
            return .file(path, r)
        case 2:
            guard let count = u32(), Int(count) <= bytes.count - offset else { return nil }
            var pages = ListPage(items: [], prefixes: [], nextPageToken: nil)
            var unsized = ListPage(items: [], prefixes: [], nextPageToken: nil, metadataComplete: false)
            let prefix = path.isEmpty ? "" : path + "/"
            for _ in 0..<count {
                guard let kind = u8(), let name = string() else { return nil }
                switch kind {
                case 0: pages.prefixes.append(prefix + name + "/")
                case 1:
                    guard let r = fileRecord() else { return nil }
                    pages.items.append(r.objectMetadata(name: prefix + name, bucket: ""))
                case 2: unsized.items.append(ObjectMetadata(name: prefix + name, bucket: "", size: 0, generation: 0,
                                                            updated: Timestamp(seconds: 0)))
                default: return nil
                }
            }
            return .listing(path, DirectoryListing(prefix: prefix, pages: [pages, unsized]))
        default:
            return nil
        }
    }

    private mutating func fileRecord() -> FileRecord? {
        guard let size = u64(), let generation = u64(), let seconds = u64(), let nanos = u32(), let crcLength = u8(),
              crcLength <= 15, Int(crcLength) <= bytes.count - offset else { return nil }
        let crc = String(decoding: bytes[offset..<(offset + Int(crcLength))], as: UTF8.self)
        offset += Int(crcLength)
        guard let modeLow = u8(), let modeHigh = u8(), let uid = u32(), let gid = u32(), let link = u8(),
              let lengthLow = u8(), let lengthHigh = u8() else { return nil }
        let mode = UInt16(modeLow) | UInt16(modeHigh) << 8
        let s = Int64(bitPattern: size), g = Int64(bitPattern: generation)
        guard (0...ObjectMetadata.maxSize).contains(s), g > 0 else { return nil }
        var r = FileRecord(size: s, generation: g, modified: Timestamp(seconds: Int64(bitPattern: seconds), nanoseconds: Int32(bitPattern: nanos)),
                           crc32c: crc.isEmpty ? nil : crc, posixMode: mode == 0xFFFF ? nil : mode & 0o777,
                           posixUID: uid == .max ? nil : uid, posixGID: gid == .max ? nil : gid,
                           symlink: FileRecord.SymlinkStyle(rawValue: link))
        r.metadataTargetLength = UInt16(lengthLow) | UInt16(lengthHigh) << 8
        return r
    }

    private mutating func string() -> String? {
        guard let n = u32(), Int(n) <= bytes.count - offset, n <= 65_536 else { return nil }
        let s = String(decoding: bytes[offset..<(offset + Int(n))], as: UTF8.self)
        guard s.utf8.count == Int(n) else { return nil }  // not valid UTF-8: not ours
        offset += Int(n)
        return s
    }

    private mutating func u8() -> UInt8? {
        guard offset < bytes.count else { return nil }
        defer { offset += 1 }
        return bytes[offset]
    }

    private mutating func u32() -> UInt32? {
        guard bytes.count - offset >= 4 else { return nil }
        var v: UInt32 = 0
        for i in 0..<4 { v |= UInt32(bytes[offset + i]) << (8 * i) }
        offset += 4
        return v
    }

    private mutating func u64() -> UInt64? {
        guard bytes.count - offset >= 8 else { return nil }
        var v: UInt64 = 0
        for i in 0..<8 { v |= UInt64(bytes[offset + i]) << (8 * i) }
        offset += 8
        return v
    }
}
