import Locking
import Foundation
import Glibc
import Synchronization

/// The cached blocks of one object generation: its file, its index in memory, and LRU ticks.
///
/// This file: the state, opening and closing the file, reads (every block checked against its
/// CRC32C) and stores (data first, then the index entries). Beside it: the index writes
/// (`CachedObject+IndexCommit.swift`), the allocation ahead of direct writes
/// (`+Allocation`), dropping blocks (`+Eviction`) and the whole-object check's state
/// (`+Integrity`). Locks: `BlockCache.swift` states their order. Over 500 lines because a
/// read and a store share the state's invariants (which blocks are present, which file
/// descriptor serves them) and read best side by side.
final class CachedObject: Sendable {
    let format: CacheFileFormat
    let hex: String
    let path: String
    unowned let cache: BlockCache
    /// The file's inode number: in a shared cache another mount may remove the file (empty and
    /// unused) and make it again; this object is the one of this inode only.
    let inode: ino_t
    /// The file's bucket among the shared counters of index writes (`SharedCache`).
    let bucket: Int

    struct State: ~Copyable {
        var index: BlockIndex
        var fd: Int32 = -1
        /// The same file for data writes and one-block reads past the page cache (`DirectIO`);
        /// -1 where not.
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
        /// The descriptor this mount made the file with (`CacheDirectory.createFile`), until
        /// `prepare` takes it: a file just made is not opened again, and has nothing to trim.
        var madeFD: Int32 = -1
        /// Entries set in memory and not yet written to the index on disk: what this mount
        /// adds when an index page is merged with the disk's in a shared cache
        /// (`writeEntryPages`), and what it keeps when it takes in what other mounts wrote.
        var pending: [Int: CacheFileFormat.Entry] = [:]
        /// Blocks dropped here (not through `pending`) since the object was made: a look at
        /// the disk's index that began before a drop does not bring the block back.
        var drops: UInt64 = 0
        /// Other mounts' index writes of this file's bucket when the whole index was last read
        /// (`catchUp`), and when the pages in `lookedAt` were (`lookOnDisk`).
        var caughtUpAt: Int64 = 0
        var lookedAtForeign: Int64 = 0
        var lookedAt = Set<Int>()
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

    /// Guards `State`: the index in memory, the descriptors and who uses them, the expected
    /// CRC32C and the allocation and group-commit bookkeeping. Level 5 of the cache's lock
    /// order (`BlockCache.swift`): taken under `writing`, `indexWriting` and the cache's
    /// `state`; takes only `BlockCache.directories` (`CacheDirectory.openFile`). Held across
    /// disk I/O only in `open` (the first open's openat and `trimAllocation`) and `close`
    /// (punching unused allocation, futimens, close).
    let state: OrderedMutex<State>
    let servedWrong = Atomic<Int>(0)
    let checksBegun = Atomic<Int>(0)
    let checksRunning = Atomic<Int>(0)
    /// One buffered writer per file at a time: concurrent buffered writes into one file queue
    /// on its inode lock, and the kernel spins waiting for it (with 4 read-ahead threads that
    /// spinning cost more CPU than the copies). A sleeping lock of our own is cheaper. Direct
    /// writes run side by side instead: each waits for the disk, and one at a time capped
    /// 8 readers of one file at the disk's speed for one writer (~600 MiB/s here).
    /// They allocate their range first, so each is an overwrite, which ext4 lets run under a
    /// shared inode lock (docs/architecture.md, "Cache writes").
    /// Level 2 of the lock order; held across the buffered data and index writes and the
    /// eviction `reserve` may run for their room (other objects' levels 3 and 5).
    let writing = OrderedLock(.cacheObjectWriting)
    /// Index entries are written under this lock, one write at a time per file: a page built
    /// from memory (`writeEntryPages`) holds every entry set before it, and no entry is
    /// written after a page built without it. Beside direct data writes, entries are set in
    /// memory before it is taken and whoever holds it writes every page set since the last
    /// write (a group commit, docs/architecture.md, "Cache writes"): one direct page write
    /// takes about a millisecond here, and one per store, in turn, held up to 40 finished
    /// parts (80 MiB) in memory behind it on a cold loopback read. A store that finds it
    /// taken does not wait: the holder looks again once it lets go and writes what was left
    /// (`commitIndex`; outside a store, `letGoOfIndexWriting`).
    /// Level 3 of the lock order; held across index page writes (and the index's first
    /// fallocate) and across eviction's entry write and hole punches in this file.
    let indexWriting = OrderedLock(.cacheObjectIndexWriting)
    let indexWriteCount = Atomic<Int>(0)

    init(cache: BlockCache, format: CacheFileFormat, hex: String, path: String, index: BlockIndex, inode: ino_t) {
        self.cache = cache
        self.format = format
        self.hex = hex
        self.path = path
        self.inode = inode
        bucket = SharedCache.bucket(hex)
        state = OrderedMutex(.cacheObjectState, State(index: index))
    }

    /// The header and index pages, counted against the cap. The index region is sparse: a huge
    /// object's (8 bytes a block of its size) takes disk only where blocks are present, so at
    /// most a dense object's worth is counted; otherwise opening one object a server says is
    /// 1 TiB would take 512 MiB of the cap and evict everything else.
    var overheadBytes: Int64 { min(format.dataOffset, 4096 + Int64(BlockIndex.denseLimit * CacheFileFormat.entrySize)) }

    /// The largest object `store` writes through the page cache when it is stored whole: the
    /// sizes measured (files of 1–4 MiB still gained); larger ones (`whole_file=` up to 64M)
    /// go direct as parts do.
    static let bufferedWholeLimit: Int64 = 4 << 20

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

    /// Nobody holds the object and no operation uses its descriptors.
    var isUnused: Bool { state.withLock { s in s.users == 0 && s.active == 0 } }

    /// Its file is open now (then no other mount can remove it: `CacheDirectory.openFile`).
    var isOpen: Bool { state.withLock { $0.fd >= 0 } }

    func setTicks(_ t: UInt64) { state.withLock { $0.index.setAllTicks(t) } }

    /// A user (an open file handle, a cache copy being written) holds the object. The file is
    /// opened here the first time in this mount (to trim what a killed daemon left allocated,
    /// `trimAllocation`), otherwise at its next use (`withFile`).
    func open() {
        addUser()
        prepare()
    }

    /// `open`'s first half: one more user (under the cache's lock, where eviction decides
    /// which files nobody uses).
    func addUser() { state.withLock { $0.users += 1 } }

    /// `open`'s second half, once per mount: the file is opened, and if no other mount has it
    /// open, what a killed mount left allocated beyond its blocks goes (`trimAllocation`, by
    /// the index on disk in a shared cache, as other mounts may have stored blocks since). A
    /// file this mount just made keeps the descriptor it was made with (`madeWith`).
    func prepare() {
        let (first, made) = state.withLock { s -> (Bool, Int32) in
            guard !s.allocationChecked else { return (false, -1) }
            s.allocationChecked = true
            defer { s.madeFD = -1 }
            return (true, s.madeFD)
        }
        guard first else { return }
        if made >= 0 {
            install(made)
            return
        }
        guard let (fd, alone) = cache.files.openFile(hex, tryAlone: true) else { return }
        let same = Self.inode(of: fd) == inode
        let disk = alone && same && cache.shared.isShared ? Self.readIndex(fd: fd, format: format) : nil
        let installed = state.withLock { s -> Bool in
            guard same else { return false }
            if alone { trimAllocation(fd: fd, index: disk ?? s.index) }
            guard s.fd < 0, s.users > 0 else { return false }
            s.fd = fd
            return true
        }
        if alone { CacheDirectory.share(fd) }
        noteInstalled(installed, fd)
    }

    /// The file was just made by this mount with `fd` (open, holding its shared lock): `prepare`
    /// uses it.
    func madeWith(fd: Int32) {
        state.withLock { $0.madeFD = fd }
    }

    /// `fd` becomes the file's descriptor if it has none and a user holds the object.
    private func install(_ fd: Int32) {
        let installed = state.withLock { s -> Bool in
            guard s.fd < 0, s.users > 0 else { return false }
            s.fd = fd
            return true
        }
        noteInstalled(installed, fd)
    }

    private func noteInstalled(_ installed: Bool, _ fd: Int32) {
        if installed {
            lastUsed.store(cache.tick(), ordering: .relaxed)
            cache.noteOpened(self)
        } else {
            Glibc.close(fd)
        }
    }

    static func inode(of fd: Int32) -> ino_t? {
        var st = stat()
        return fstat(fd, &st) == 0 ? st.st_ino : nil
    }

    func close() {
        let closed = state.withLock { s -> Bool in
            s.users -= 1
            guard s.users == 0 else { return false }
            // Nobody writes it now (a cache copy keeps it in use): what the chunks allocated
            // ahead hold beyond the blocks written goes.
            if !s.allocatedChunks.isEmpty || s.fd >= 0 {
                let temporary = s.fd < 0
                if temporary { s.fd = openOwnFile() ?? -1 }
                if s.fd >= 0 {
                    letAllocationGo(&s)
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

    /// Recency among open files, for letting descriptors go (`BlockCache.noteOpened`), and this
    /// mount's last use of the file (wall-clock ns, `BlockCache.tick`).
    var lastUse: UInt64 { lastUsed.load(ordering: .relaxed) }
    private let lastUsed = Atomic<UInt64>(0)
    /// When this mount last set the file's mtime for a read (`markUsed`).
    private let stampedAt = Atomic<UInt64>(0)
    /// The file's mtime when eviction last looked, if another mount used it after this one
    /// did (`noteFileTime`); 0 otherwise.
    let foreignUse = Atomic<UInt64>(0)
    /// How often a read sets the file's mtime, at most.
    static let stampInterval: UInt64 = 1_000_000_000

    /// A read was served from the file at `t`: in a shared cache its mtime says so to the
    /// other mounts' eviction (docs/cache.md, "Eviction"), at most once a `stampInterval`.
    /// Writes set it by themselves. Alone, the mtime is set at close only (`futimens` takes
    /// the inode's lock, which waits for the direct writes under way).
    private func markUsed(fd: Int32, at t: UInt64) {
        guard cache.shared.isShared, t &- stampedAt.load(ordering: .relaxed) > Self.stampInterval else { return }
        stampedAt.store(t, ordering: .relaxed)
        futimens(fd, nil)
    }

    /// Eviction saw the file's mtime `mtime` (ns): later than this mount's own last use (by
    /// more than `stampInterval`), it is another mount's use, and every block of the file
    /// counts as used then (`collectBlocks`).
    func noteFileTime(_ mtime: Int64) {
        let t = UInt64(max(0, mtime))
        foreignUse.store(t > lastUse &+ Self.stampInterval ? t : 0, ordering: .relaxed)
    }

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
    /// The direct descriptor is opened only when asked for (`direct`: writes, and reads of one
    /// block; a file only read in runs never holds one).
    func withFile<T>(direct wantsDirect: Bool = false, _ body: (_ fd: Int32, _ direct: Int32) -> T) -> T? {
        lastUsed.store(cache.tick(), ordering: .relaxed)
        let needsOpening = state.withLock { s -> Bool? in
            guard s.users > 0 else { return nil }
            s.active += 1
            return s.fd < 0
        }
        guard let needsOpening else { return nil }
        defer { endUse() }
        if needsOpening {
            // Opened outside the lock (a system call that may wait for the disk), kept if no
            // other use opened it meanwhile.
            let fd = openOwnFile() ?? -1
            let installed = state.withLock { s -> Bool in
                guard s.fd < 0, fd >= 0 else { return false }
                s.fd = fd
                return true
            }
            if installed {
                cache.noteOpened(self)
            } else if fd >= 0 {
                Glibc.close(fd)
            }
        }
        if wantsDirect, cache.directWrites { openDirect() }
        let (fd, direct) = state.withLock { ($0.fd, $0.directRefused ? -1 : $0.directFD) }
        guard fd >= 0 else { return nil }
        return body(fd, direct)
    }

    /// An operation that held the descriptors open (`active`) is over: the last one closes them
    /// once nobody holds the object.
    private func endUse() {
        let closed = state.withLock { s -> Bool in
            s.active -= 1
            guard s.active == 0, s.users == 0, s.fd >= 0 else { return false }
            closeDescriptors(&s)
            s.directRefused = false
            return true
        }
        if closed { cache.noteClosed(self) }
    }

    /// Runs `body` with the buffered descriptor, outside the state lock, whether or not anyone
    /// holds the object (eviction): the open descriptor, kept open meanwhile (`active`: no
    /// close lets it go, so no other file can take its number under these writes), or one
    /// opened for the call. Not run when the file cannot be opened (gone, no descriptor).
    func withAnyDescriptor(_ body: (Int32) -> Void) {
        let open = state.withLock { s -> Int32 in
            guard s.fd >= 0 else { return -1 }
            s.active += 1
            return s.fd
        }
        if open >= 0 {
            body(open)
            endUse()
        } else if let fd = openOwnFile() {
            body(fd)
            Glibc.close(fd)
        }
    }

    /// Opens this object's file by its name: nil when the name is gone or is another file now
    /// (another mount removed this one, and perhaps made it again: this object serves its
    /// readers uncached until they let it go, and the next open uses the new file).
    func openOwnFile() -> Int32? {
        guard let fd = cache.files.openFile(hex) else { return nil }
        guard Self.inode(of: fd) == inode else {
            Glibc.close(fd)
            return nil
        }
        return fd
    }

    /// Opens the direct descriptor beside the open buffered one, once (a use holds the file).
    /// One the filesystem refuses is not asked for again until the file is closed.
    private func openDirect() {
        let fd = state.withLock { s -> Int32 in s.directFD < 0 && !s.directRefused ? s.fd : -1 }
        guard fd >= 0 else { return }
        let direct = DirectIO.reopen(fd) ?? -1
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

    func isCached(_ block: Int) -> Bool {
        lookOnDisk(block...block)
        return state.withLock { $0.index.isPresent(block) }
    }

    /// For each block of `blocks`: is it cached?
    func cachedMask(_ blocks: ClosedRange<Int>) -> [Bool] {
        lookOnDisk(blocks)
        return state.withLock { s in blocks.map { s.index.isPresent($0) } }
    }

    /// How many bytes from `offset` (at most up to `end`) lie in consecutive cached blocks.
    func cachedBytes(from offset: Int64, upTo end: Int64) -> Int {
        let bs = Int64(format.blockSize)
        let first = Int(offset / bs)
        let last = Int((end - 1) / bs)
        lookOnDisk(first...last)
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
        lookOnDisk(first...last)
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
        // One block (a random read) is read past the page cache if the kernel let its pages
        // go (`DirectIO.read`); a run stays buffered, as the kernel's read-ahead of the cache
        // file and `warm` serve sequential readers (docs/architecture.md, "Cached runs ahead").
        let single = first == last
        return withFile(direct: single) { fd, direct -> Bool in
            guard readVerified(fd: fd, direct: single ? direct : -1, at: offset, into: dst, first: first, last: last, crcs: crcs) else {
                return false
            }
            markUsed(fd: fd, at: t)
            return true
        } ?? false
    }

    /// `read`'s disk read and checks, with the file open (`direct`: the O_DIRECT descriptor
    /// for a read of one block, else -1).
    private func readVerified(fd: Int32, direct: Int32, at offset: Int64, into dst: UnsafeMutableRawBufferPointer,
                              first: Int, last: Int, crcs: [UInt32]) -> Bool {
        let bs = Int64(format.blockSize)
        let runStart = Int64(first) * bs
        let runLength = Int(min(format.objectSize, Int64(last + 1) * bs) - runStart)
        // Into the reader's buffer when it wants exactly the run and no direct read may land
        // there (unaligned, and rounded up past its end).
        let inPlace = direct < 0 && offset == runStart && dst.count == runLength
        let room = direct < 0 ? runLength : (runLength + DirectIO.alignment - 1) / DirectIO.alignment * DirectIO.alignment
        let scratch = inPlace ? dst : UnsafeMutableRawBufferPointer.allocate(byteCount: room, alignment: DirectIO.alignment)
        defer { if !inPlace { scratch.deallocate() } }
        guard DirectIO.read(into: scratch, length: runLength, at: format.blockOffset(first), buffered: fd, direct: direct) else { return false }
        for b in first...last {
            let at = Int(Int64(b) * bs - runStart)
            let block = UnsafeRawBufferPointer(rebasing: scratch[at..<(at + format.blockLength(b))])
            if Checksum.crc32c(block) != crcs[b - first] {
                Log.debug("cache block failed verification object=\(hex.prefix(12)) block=\(b): refetching")
                _ = dropIfUnchanged(block: b, entry: CacheFileFormat.Entry(crc: crcs[b - first], length: UInt32(block.count)))
                return false
            }
        }
        if !inPlace {
            let skip = Int(offset - runStart)
            dst.copyMemory(from: UnsafeRawBufferPointer(rebasing: scratch[skip..<(skip + dst.count)]))
        }
        return true
    }

    /// Stores whole blocks starting at `first` from `bytes` (which hold exactly those blocks):
    /// each run of absent blocks with one data write and one index write (docs/architecture.md,
    /// "Cache writes"). The whole object at once (a file fetched whole), up to
    /// `bufferedWholeLimit`, goes through the page cache: for 1,000 files of 32–256 KiB a
    /// direct write each, which waits for the disk and allocates as it goes, cost the host 20%
    /// more CPU and the readers 16% of their rate (docs/experiments.md,
    /// "2026-12-07, afternoon").
    /// `crcs`: the blocks' CRC32Cs where the caller has them already (`blockCRCs`), one per block.
    func store(first: Int, _ bytes: UnsafeRawBufferPointer, ahead: Bool = false, crcs: [UInt32]? = nil) {
        let whole = first == 0 && Int64(bytes.count) == format.objectSize && format.objectSize <= Self.bufferedWholeLimit
        let known = crcs?.count == (bytes.count + format.blockSize - 1) / format.blockSize ? crcs : nil
        _ = withFile(direct: !whole) { fd, direct in
            store(first: first, bytes, ahead: ahead, crcs: known, fd: fd, direct: whole ? -1 : direct)
        }
    }

    /// `store` with the file open: `direct` -1 where data goes through the page cache.
    private func store(first: Int, _ bytes: UnsafeRawBufferPointer, ahead: Bool, crcs known: [UInt32]?, fd: Int32,
                       direct directFD: Int32) {
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
                let crc = known?[k - first] ?? Checksum.crc32c(UnsafeRawBufferPointer(rebasing: run[at..<(at + length)]))
                entries.append(CacheFileFormat.Entry(crc: crc, length: UInt32(length)))
                cost += Self.diskBytes(length)
            }
            guard cache.reserve(cost) else { return }
            defer { cache.landed(cost) }
            // A direct write refused by an earlier run (EINVAL) goes buffered from then on.
            let direct = state.withLock { $0.directRefused } ? -1 : directFD
            // Data first, then the index entries: a crash in between leaves blocks that are
            // simply absent. The data goes past the page cache where it can (`DirectIO`).
            var stillDirect = direct
            if direct >= 0 { allocate(blocks: runFirst..<runEnd, direct: direct, ahead: ahead) }
            let wrote = DirectIO.write(run, at: format.blockOffset(runFirst), buffered: fd, direct: &stillDirect)
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
            if stillDirect >= 0 || cache.shared.isShared {
                // In a shared cache buffered entries go the same way (merged with the disk's
                // page under its lock, `writeEntryPages`), written through the page cache.
                duplicate = setEntries(entries, from: runFirst, direct: true)
                failure = commitIndex(fd: fd, direct: stillDirect) {
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
}
