import Locking
import Foundation
import Glibc
import Synchronization
internal import CBlockCache

/// What the storefs processes using one cache directory share (docs/cache.md): who they are,
/// one count of the bytes the cache holds, and who changed which files' indexes.
///
/// It lives in `cache_dir/mounts-v1/` (beside `v1/`, so that `rm -rf cache_dir/v1` under the
/// mounts leaves it), opened like everything else under `cache_dir` (verified directory
/// descriptor, `O_NOFOLLOW`, a regular file of ours with one link):
///
/// - `NNN` (000–255): one lock file per live mount, its slot. The mount holds an exclusive
///   `flock` on it for its life (the kernel lets go of it when the process ends, however it
///   ends) and writes one JSON line into it (pid, mount point, cap, block size): a slot whose
///   file nobody holds is free, and `storefs cache status` lists the held ones.
/// - `shared`: mapped by every mount (`MAP_SHARED`), a header page and per-slot records, read
///   and changed only with atomic operations (the C shim's, as Swift's `Atomic` lives in its
///   own storage). Byte ranges of it are locked with open file description locks: byte 0
///   while a mount joins (its layout and slot are set up), byte 1 by the one evictor.
///
/// Layout of `shared` (little-endian 64-bit words):
///
///     0      magic "STFSSHM1"          8   layout version
///     16     bytes the cache holds      24  joins (each mount's join adds one)
///     32     slots in use (high water)  40  eviction passes
///     48     recounts
///     4096   slot records, 64 bytes each: bytes reserved and not yet indexed (in flight),
///            cap, block size, pid, index writes
///     20480  per slot, 1024 counters of index writes, one per bucket of file names (a
///            file's bucket: the first bytes of its key hash)
///
/// The bucket counters tell a mount, without a system call, whether another mount may have
/// changed a file's index since it last looked: the sum of the other slots' counters of the
/// file's bucket (each slot's only ever grows, and only its mount adds to it).
final class SharedCache: @unchecked Sendable {
    // @unchecked: `base` points into a shared mapping that only the C shim's atomics touch;
    // every other stored property is immutable or a Mutex/Atomic.
    static let slotCount = 256
    static let buckets = 1024
    static let layoutVersion: Int64 = 1
    static let directoryName = "mounts-v1"
    static let stateName = "shared"
    private static let magic = Int64(bitPattern: 0x314D_4853_5346_5453)  // "STFSSHM1"
    private static let slotTable = 4096
    private static let slotRecord = 64
    private static let bucketTable = slotTable + slotCount * slotRecord
    private static let bucketStride = buckets * 8
    static let stateSize = bucketTable + slotCount * bucketStride

    private enum Header: Int {
        case magic = 0, version = 8, used = 16, joins = 24, slotsInUse = 32, evictions = 40, recounts = 48
    }

    private enum SlotField: Int {
        case inFlight = 0, capacity = 8, blockSize = 16, pid = 24, indexWrites = 32
    }

    /// This mount's slot.
    let slot: Int
    let directory: CacheDirectory
    private let stateFD: Int32
    private let slotFD: Int32
    private let base: UnsafeMutableRawPointer
    /// `joins` right after this mount joined: another join since makes the cache shared.
    private let joinedAt: Int64
    /// Another mount was live when this one joined, or one joined since (`isShared`).
    private let sharedSeen = Atomic<Bool>(false)
    private let ownCapacity: Int64
    private let ownBlockSize: Int
    /// The cap every mount keeps to: the smallest of the live mounts' (`capacity`), and when
    /// it was worked out (seconds, monotonic) and at which `joins`.
    private let agreed: OrderedMutex<(capacity: Int64, at: Double, joins: Int64, live: [Int])>
    static let recheckSeconds = 10.0

    struct Refused: Error {
        let message: String
    }

    /// Joins the cache at `cacheDirectory` (already verified by the caller's CacheDirectory):
    /// takes a free slot, checks that the live mounts use `blockSize` too, and records `capacity`.
    init(cacheDirectory: String, capacity: Int64, blockSize: Int) throws(Refused) {
        do throws(CacheDirectory.Refused) {
            directory = try CacheDirectory(directory: cacheDirectory, versionName: Self.directoryName)
        } catch {
            throw Refused(message: error.message)
        }
        ownCapacity = capacity
        ownBlockSize = blockSize
        guard let fd = directory.openPlainFile(Self.stateName, flags: O_RDWR | O_CREAT) else {
            throw Refused(message: "cannot open \(directory.versionPath)/\(Self.stateName): \(String(cString: strerror(errno)))")
        }
        stateFD = fd
        // One mount joins at a time: the layout is set up once, and two mounts of different
        // block sizes cannot both see the other absent.
        guard cblockcache_lock_range(fd, 0, 1, 1, 1) == 0 else {
            let why = String(cString: strerror(errno))
            Glibc.close(fd)
            throw Refused(message: "cannot lock \(directory.versionPath)/\(Self.stateName): \(why)")
        }
        defer { _ = cblockcache_unlock_range(fd, 0, 1) }
        var st = stat()
        var head = [Int64](repeating: 0, count: 2)
        let read = head.withUnsafeMutableBytes { pread(fd, $0.baseAddress, $0.count, 0) }
        let fresh = fstat(fd, &st) != 0 || Int(st.st_size) != Self.stateSize || read != 16
            || head[0] != Self.magic || head[1] != Self.layoutVersion
        if fresh {
            // New, or of another size or layout (damaged, another version): laid out afresh,
            // all zeros and sparse; no mount can be using it, as each maps it whole and checks
            // it while joining, under this lock.
            _ = ftruncate(fd, 0)
            _ = ftruncate(fd, off_t(Self.stateSize))
        }
        guard let mapped = mmap(nil, Self.stateSize, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0), mapped != MAP_FAILED else {
            let why = String(cString: strerror(errno))
            Glibc.close(fd)
            throw Refused(message: "cannot map \(directory.versionPath)/\(Self.stateName): \(why)")
        }
        // Every page this mount will store into is given its disk now, before the first
        // store (`MappedFile`): the header and slot records here, this mount's bucket
        // counters once it has a slot; the other slots' pages are their mounts' to allocate.
        if let why = MappedFile.allocate(fd, 0, Self.bucketTable, zeroFill: fresh) {
            munmap(mapped, Self.stateSize)
            Glibc.close(fd)
            throw Refused(message: Self.noRoom(cacheDirectory, why))
        }
        base = mapped
        if fresh {
            cblockcache_atomic_store(Self.word(mapped, Header.version.rawValue), Self.layoutVersion)
            cblockcache_atomic_store(Self.word(mapped, Header.magic.rawValue), Self.magic)
        }
        // A free slot: its lock file, held exclusively from now on.
        var claimed: (slot: Int, fd: Int32)? = nil
        for i in 0..<Self.slotCount {
            guard let f = directory.openPlainFile(Self.slotName(i), flags: O_RDWR | O_CREAT) else { continue }
            if flock(f, LOCK_EX | LOCK_NB) == 0 {
                claimed = (i, f)
                break
            }
            Glibc.close(f)
        }
        guard let claimed else {
            munmap(mapped, Self.stateSize)
            Glibc.close(fd)
            throw Refused(message: "cache_dir \(cacheDirectory) is shared by \(Self.slotCount) storefs mounts already: give this one another cache_dir=")
        }
        if let why = MappedFile.allocate(fd, Self.bucketTable + claimed.slot * Self.bucketStride, Self.bucketStride, zeroFill: true) {
            Glibc.close(claimed.fd)
            munmap(mapped, Self.stateSize)
            Glibc.close(fd)
            throw Refused(message: Self.noRoom(cacheDirectory, why))
        }
        slot = claimed.slot
        slotFD = claimed.fd
        let inUse = Self.word(mapped, Header.slotsInUse.rawValue)
        if cblockcache_atomic_load(inUse) < Int64(slot + 1) { cblockcache_atomic_store(inUse, Int64(slot + 1)) }
        // The others, live now: they must use this block size (a cache file's layout).
        var live: [Int] = []
        for i in 0..<Self.slotsInUse(mapped) where i != slot && Self.isHeld(directory, i) {
            live.append(i)
            let theirs = Int(cblockcache_atomic_load(Self.slotWord(mapped, i, .blockSize)))
            if theirs != 0 && theirs != blockSize {
                let pid = cblockcache_atomic_load(Self.slotWord(mapped, i, .pid))
                Glibc.close(claimed.fd)
                munmap(mapped, Self.stateSize)
                Glibc.close(fd)
                throw Refused(message: "cache_dir \(cacheDirectory) is in use by a storefs mount with block_size=\(theirs) (pid \(pid)): mounts sharing a cache directory use one block size; give block_size=\(theirs) or another cache_dir=")
            }
        }
        // This slot's record: what a mount killed here before reserved and never indexed is
        // not on disk (its reservations in flight), so it is not counted any more.
        let left = cblockcache_atomic_exchange(Self.slotWord(mapped, slot, .inFlight), 0)
        if left != 0 { cblockcache_atomic_add(Self.word(mapped, Header.used.rawValue), -left) }
        cblockcache_atomic_store(Self.slotWord(mapped, slot, .capacity), capacity)
        cblockcache_atomic_store(Self.slotWord(mapped, slot, .blockSize), Int64(blockSize))
        cblockcache_atomic_store(Self.slotWord(mapped, slot, .pid), Int64(getpid()))
        joinedAt = cblockcache_atomic_add(Self.word(mapped, Header.joins.rawValue), 1)
        sharedSeen.store(!live.isEmpty, ordering: .relaxed)
        agreed = OrderedMutex(.sharedCacheAgreed, (capacity, 0, joinedAt, live))
        _ = refreshMembers(force: true)
    }

    deinit {
        munmap(base, Self.stateSize)
        Glibc.close(stateFD)
        Glibc.close(slotFD)  // lets the slot go
    }

    private static func noRoom(_ cacheDirectory: String, _ why: String) -> String {
        "cache_dir \(cacheDirectory): cannot allocate \(directoryName)/\(stateName), the state the mounts of a cache share (\(why)): free space on its filesystem or give another cache_dir="
    }

    static func slotName(_ i: Int) -> String {
        let s = String(i)
        return String(repeating: "0", count: 3 - s.count) + s
    }

    private static func word(_ base: UnsafeMutableRawPointer, _ offset: Int) -> UnsafeMutablePointer<Int64> {
        (base + offset).assumingMemoryBound(to: Int64.self)
    }

    private static func slotWord(_ base: UnsafeMutableRawPointer, _ slot: Int, _ field: SlotField) -> UnsafeMutablePointer<Int64> {
        word(base, slotTable + slot * slotRecord + field.rawValue)
    }

    private func header(_ field: Header) -> UnsafeMutablePointer<Int64> { Self.word(base, field.rawValue) }
    private func mine(_ field: SlotField) -> UnsafeMutablePointer<Int64> { Self.slotWord(base, slot, field) }

    /// Slots ever used (bounded: the file is another process's writing, if the same user's).
    private static func slotsInUse(_ base: UnsafeMutableRawPointer) -> Int {
        Int(max(0, min(Int64(slotCount), cblockcache_atomic_load(word(base, Header.slotsInUse.rawValue)))))
    }

    /// Whether a mount holds slot `i` (its lock file's exclusive flock), probed on a
    /// descriptor of its own and let go at once.
    static func isHeld(_ directory: CacheDirectory, _ i: Int) -> Bool {
        guard let f = directory.openPlainFile(slotName(i), flags: O_RDONLY) else { return false }
        defer { Glibc.close(f) }
        return flock(f, LOCK_SH | LOCK_NB) != 0 && errno == EWOULDBLOCK
    }

    // MARK: The mounts

    /// Whether another mount uses (or used, since this one joined) the directory: then indexes
    /// are merged with what is on disk, and eviction looks at every file (docs/cache.md).
    /// Once shared, always shared for this mount.
    var isShared: Bool {
        if sharedSeen.load(ordering: .relaxed) { return true }
        guard cblockcache_atomic_load(header(.joins)) != joinedAt else { return false }
        sharedSeen.store(true, ordering: .relaxed)
        return true
    }

    /// The cap: the smallest `cache_size` of the mounts live now (checked again when a mount
    /// joins, and every `recheckSeconds`: a mount that left gives its larger cap back then).
    var capacity: Int64 { refreshMembers(force: false) }

    /// Looks at who is live when a mount joined or `recheckSeconds` passed; returns the cap.
    @discardableResult
    func refreshMembers(force: Bool) -> Int64 {
        let joins = cblockcache_atomic_load(header(.joins))
        let at = now()
        let current = agreed.withLock { a -> Int64? in
            force || a.joins != joins || at - a.at >= Self.recheckSeconds ? nil : a.capacity
        }
        if let current { return current }
        var cap = ownCapacity
        var live: [Int] = []
        for i in 0..<Self.slotsInUse(base) where i != slot && Self.isHeld(directory, i) {
            live.append(i)
            let theirs = cblockcache_atomic_load(Self.slotWord(base, i, .capacity))
            if theirs > 0 { cap = min(cap, theirs) }
        }
        if !live.isEmpty { sharedSeen.store(true, ordering: .relaxed) }
        let changed = agreed.withLock { a -> Bool in
            defer { a = (cap, at, joins, live) }
            return a.capacity != cap && a.at != 0
        }
        if changed {
            Log.info("cache: the mounts sharing the cache directory keep to a new cap (the smallest cache_size of the live mounts)",
                     ["dir": directory.path, "cap_bytes": String(cap), "mounts": String(live.count + 1)])
        }
        return cap
    }

    /// Writes this mount's record into its slot file (`storefs cache status` shows it).
    func recordMount(mountpoint: String) {
        let json = "{\"pid\":\(getpid()),\"mountpoint\":\(LogLine.jsonString(mountpoint)),\"capacity\":\(ownCapacity),"
            + "\"block_size\":\(ownBlockSize),\"format\":\(CacheFileFormat.version)}\n"
        cblockcache_atomic_store(mine(.pid), Int64(getpid()))
        let bytes = Array(json.utf8)
        _ = ftruncate(slotFD, 0)
        _ = bytes.withUnsafeBytes { pwrite(slotFD, $0.baseAddress, $0.count, 0) }
    }

    /// The live mounts of a cache directory, from their slot files (for `storefs cache status`
    /// and `clear`, which do not join).
    static func liveMembers(cacheDirectoryFD dirFD: Int32) -> [CacheMount] {
        let fd = openat(dirFD, directoryName, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)
        guard fd >= 0 else { return [] }
        defer { Glibc.close(fd) }
        var members: [CacheMount] = []
        for i in 0..<slotCount {
            let f = openat(fd, slotName(i), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC)
            guard f >= 0 else { continue }
            defer { Glibc.close(f) }
            var st = stat()
            guard fstat(f, &st) == 0, st.st_mode & S_IFMT == S_IFREG,
                  flock(f, LOCK_SH | LOCK_NB) != 0, errno == EWOULDBLOCK else { continue }
            var m = CacheMount.record(from: f)
            m.slot = i
            members.append(m)
        }
        return members
    }

    /// Bytes the cache holds, for every mount (`stateFD` read without mapping: the tools).
    static func usedBytes(cacheDirectoryFD dirFD: Int32) -> Int64? {
        let fd = openat(dirFD, directoryName + "/" + stateName, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC)
        guard fd >= 0 else { return nil }
        defer { Glibc.close(fd) }
        var words = [Int64](repeating: 0, count: 3)
        let n = words.withUnsafeMutableBytes { pread(fd, $0.baseAddress, $0.count, 0) }
        guard n == 24, words[0] == magic else { return nil }
        return words[2]
    }

    // MARK: The bytes the cache holds

    var used: Int64 { cblockcache_atomic_load(header(.used)) }

    /// Counts `bytes` more if they fit under `capacity`; false if they do not.
    func reserve(_ bytes: Int64, capacity: Int64) -> Bool {
        let p = header(.used)
        while true {
            let now = cblockcache_atomic_load(p)
            guard now + bytes <= capacity else { return false }
            if cblockcache_atomic_cas(p, now, now + bytes) == 1 { break }
        }
        cblockcache_atomic_add(mine(.inFlight), bytes)
        return true
    }

    /// Bytes reserved earlier now have their index entries set (or were given back).
    func landed(_ bytes: Int64) { cblockcache_atomic_add(mine(.inFlight), -bytes) }

    func add(_ bytes: Int64) { cblockcache_atomic_add(header(.used), bytes) }

    /// Bytes killed mounts reserved and never indexed are not counted any more: each slot no
    /// live mount holds gives back what it had in flight (docs/cache.md, "One cap"). The count
    /// is otherwise kept exact by every mount's changes (reservations, duplicates found when
    /// an index page is merged, what eviction found on disk and freed), so nothing is counted
    /// again from the files while mounts write.
    func reclaimDead() {
        for i in 0..<Self.slotsInUse(base) where i != slot {
            let p = Self.slotWord(base, i, .inFlight)
            guard cblockcache_atomic_load(p) != 0, !Self.isHeld(directory, i) else { continue }
            let left = cblockcache_atomic_exchange(p, 0)
            if left != 0 {
                cblockcache_atomic_add(header(.used), -left)
                cblockcache_atomic_add(header(.recounts), 1)
            }
        }
    }

    /// Sets the count from a recount after the version directory went (`rm -rf v1`):
    /// `onDisk` (what the files hold, read just now) plus what live mounts have in flight, as
    /// a change against `before` (the count when the recount began).
    func recount(onDisk: Int64, before: Int64) {
        var inFlight: Int64 = cblockcache_atomic_load(mine(.inFlight))
        let live = agreed.withLock { $0.live }
        for i in live { inFlight += max(0, cblockcache_atomic_load(Self.slotWord(base, i, .inFlight))) }
        cblockcache_atomic_add(header(.used), onDisk + inFlight - before)
        cblockcache_atomic_add(header(.recounts), 1)
    }

    /// Sets the count outright (the only mount, after its start-up scan).
    func setUsed(_ bytes: Int64) { cblockcache_atomic_store(header(.used), bytes) }

    var recounts: Int64 { cblockcache_atomic_load(header(.recounts)) }

    // MARK: Index changes

    static func bucket(_ hex: String) -> Int {
        var v = 0
        for c in hex.utf8.prefix(3) { v = v << 4 | Int(c <= UInt8(ascii: "9") ? c - UInt8(ascii: "0") : c - UInt8(ascii: "a") + 10) }
        return v % buckets
    }

    private func bucketWord(_ slot: Int, _ bucket: Int) -> UnsafeMutablePointer<Int64> {
        Self.word(base, Self.bucketTable + slot * Self.bucketStride + bucket * 8)
    }

    /// This mount wrote index entries of a file in `bucket` (after the write).
    func noteIndexWrite(bucket: Int) {
        cblockcache_atomic_add(bucketWord(slot, bucket), 1)
        cblockcache_atomic_add(mine(.indexWrites), 1)
    }

    /// Index writes other mounts made to files of `bucket`, ever: a change since a look at a
    /// file's index means it may have changed. 0 while nobody else ever used the directory.
    func foreignIndexWrites(bucket: Int) -> Int64 {
        guard isShared else { return 0 }
        var total: Int64 = 0
        for i in 0..<Self.slotsInUse(base) where i != slot { total &+= cblockcache_atomic_load(bucketWord(i, bucket)) }
        return total
    }

    // MARK: The evictor

    /// Waits until no other mount evicts (an open file description lock on byte 1 of
    /// `shared`, which a killed mount's end lets go), then holds it until `endEviction`.
    func beginEviction() {
        _ = cblockcache_lock_range(stateFD, 1, 1, 1, 1)
        cblockcache_atomic_add(header(.evictions), 1)
    }

    func endEviction() { _ = cblockcache_unlock_range(stateFD, 1, 1) }
}

/// A mount using a cache directory, as its lock file says (`storefs cache status|clear`, which
/// do not join).
public struct CacheMount: Sendable {
    /// Its slot under `mounts-v1/`; nil for an older storefs, which holds the cache alone.
    public var slot: Int?
    public var pid: Int?
    public var mountpoint: String?
    public var capacity: Int64?
    public var blockSize: Int?

    public init(slot: Int? = nil, pid: Int? = nil, mountpoint: String? = nil, capacity: Int64? = nil, blockSize: Int? = nil) {
        self.slot = slot
        self.pid = pid
        self.mountpoint = mountpoint
        self.capacity = capacity
        self.blockSize = blockSize
    }

    /// The JSON line a mount writes into its lock file (a slot file; older versions
    /// `v1/.lock`), read from its start (at most 4 KiB); what is missing stays nil. The file is
    /// the same user's, but what it says is shown escaped (`Log.escaped`).
    public static func record(from fd: Int32) -> CacheMount {
        var m = CacheMount()
        var buffer = [UInt8](repeating: 0, count: 4096)
        let n = buffer.withUnsafeMutableBytes { pread(fd, $0.baseAddress, $0.count, 0) }
        if n > 0, let obj = try? JSONSerialization.jsonObject(with: Data(buffer[0..<n])) as? [String: Any] {
            m.pid = obj["pid"] as? Int
            m.mountpoint = obj["mountpoint"] as? String
            m.capacity = (obj["capacity"] as? NSNumber)?.int64Value
            m.blockSize = obj["block_size"] as? Int
        }
        return m
    }
}

extension BlockCache {
    /// The mounts using the cache directory open at `dirFD` now (docs/cache.md, "Who uses a cache").
    public static func liveMounts(cacheDirectoryFD dirFD: Int32) -> [CacheMount] {
        SharedCache.liveMembers(cacheDirectoryFD: dirFD)
    }

    /// The bytes its mounts count against the cap, nil when no mount ever used it.
    public static func countedBytes(cacheDirectoryFD dirFD: Int32) -> Int64? {
        SharedCache.usedBytes(cacheDirectoryFD: dirFD)
    }
}
