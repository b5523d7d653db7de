import Foundation
import Glibc
import Synchronization
internal import CBlockCache

/// A cache file's index writes: entries are written after their data, whole pages past the
/// page cache beside direct data writes (built from the index in memory), single entries
/// through it beside buffered ones, and as a group commit under `indexWriting` (whoever holds
/// it writes every page set since the last write; docs/architecture.md, "Cache writes").
///
/// Every index write holds an open file description lock on the byte range of the pages it
/// writes, so that mounts sharing the cache write one page at a time. In a shared cache a page
/// is not built from memory alone: it is read under that lock, this mount's own unwritten
/// entries (`pending`) are laid over it, and what other mounts wrote there is taken in
/// (docs/cache.md, "Index writes"). Each write is counted in the file's bucket
/// (`SharedCache.noteIndexWrite`), which is how the others know to look.
extension CachedObject {
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
    func commitIndex(fd: Int32, direct: Int32, own: (() -> Int32)?) -> Int32 {
        while indexWriting.try() {
            var failure = writeDirtyPages(fd: fd, direct: direct)
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
    func letGoOfIndexWriting() {
        indexWriting.unlock()
        commitLeftSets()
    }

    /// The entry sets stores left while `indexWriting` was held outside a store, written while
    /// the file is open (a user held for the write, so its descriptor cannot close under it).
    /// A file closed meanwhile keeps them in memory only: those blocks read as absent after a
    /// remount, as after a crash.
    private func commitLeftSets() {
        let shared = cache.shared.isShared
        guard state.withLock({ $0.setsWritten < $0.setsMade && $0.users > 0 && (shared || !$0.directRefused) }) else { return }
        let failure = withFile(direct: true) { fd, direct -> Int32 in
            direct >= 0 || shared ? commitIndex(fd: fd, direct: direct, own: nil) : 0
        } ?? 0
        // EINVAL: the device refused the alignment; the entries stay marked for the next store.
        if failure != 0, failure != EINVAL {
            cache.degrade("cannot write a cache index entry: \(String(cString: strerror(failure)))")
        }
    }

    /// Sets index entries in memory from block `first` on; returns the disk bytes of blocks
    /// that were present already (stored twice: counted once). The others are `pending` until
    /// written. Beside direct data writes (`direct`; in a shared cache, always) their pages are
    /// marked for `writeDirtyPages`, and the set counted.
    func setEntries(_ entries: [CacheFileFormat.Entry], from first: Int, direct: Bool) -> Int64 {
        let t = cache.tick()
        return state.withLock { s -> Int64 in
            var dup: Int64 = 0
            for (i, e) in entries.enumerated() {
                if s.index.isPresent(first + i) {
                    dup += Self.diskBytes(Int(s.index[first + i].length))
                } else {
                    s.pending[first + i] = e
                }
                s.index.set(first + i, e, tick: t)
            }
            guard direct, !entries.isEmpty else { return dup }
            let page = DirectIO.alignment
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

    /// Writes, past the page cache (through `fd` where `direct` is -1), every index page whose
    /// entries were set since it was last written. 0, or the errno of the write that failed
    /// (its pages stay marked, for the next store to try). The caller holds `indexWriting`.
    private func writeDirtyPages(fd: Int32, direct: Int32) -> Int32 {
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
            guard writeEntryPages(pages: pages[i]..<(pages[j - 1] + 1), fd: fd, direct: direct) else {
                let failure = Self.lastFailure()
                state.withLock { $0.dirtyPages.formUnion(pages) }
                return failure
            }
            i = j
        }
        state.withLock { $0.setsWritten = max($0.setsWritten, made) }
        return 0
    }

    /// Writes entries through the page cache (a file with no direct descriptor, alone): 0, or
    /// the errno of the failed write, as `writeDirtyPages`.
    func writeEntries(_ entries: [CacheFileFormat.Entry], from first: Int, fd: Int32) -> Int32 {
        let encoded = CacheFileFormat.encode(entries)
        let at = format.entryOffset(first)
        let (lockFrom, lockTo) = Self.pageRange(at, at + Int64(encoded.count))
        Self.lockRange(fd, lockFrom, lockTo)
        defer { Self.unlockRange(fd, lockFrom, lockTo) }
        indexWriteCount.add(1, ordering: .relaxed)
        let written = encoded.withUnsafeBytes { pwrite(fd, $0.baseAddress, $0.count, off_t(at)) }
        guard written == encoded.count else { return Self.lastFailure() }
        state.withLock { s in
            for (i, e) in entries.enumerated() where s.pending[first + i] == e { s.pending.removeValue(forKey: first + i) }
        }
        cache.shared.noteIndexWrite(bucket: bucket)
        return 0
    }

    /// The whole pages holding bytes `[from, to)` of the file.
    static func pageRange(_ from: Int64, _ to: Int64) -> (Int64, Int64) {
        let page = Int64(DirectIO.alignment)
        return (from / page * page, (to + page - 1) / page * page)
    }

    /// Waits for (then holds) the open file description lock on `[from, to)` of a cache file:
    /// index writes of one page by several mounts go one at a time.
    static func lockRange(_ fd: Int32, _ from: Int64, _ to: Int64) {
        _ = cblockcache_lock_range(fd, off_t(from), off_t(to - from), 1, 1)
    }

    static func unlockRange(_ fd: Int32, _ from: Int64, _ to: Int64) {
        _ = cblockcache_unlock_range(fd, off_t(from), off_t(to - from))
    }

    /// Writes index pages `pages` (page numbers in the file) past the page cache (through `fd`
    /// where `direct` is -1), each built whole (header, entries). A buffered write of a few
    /// entries takes the file's inode lock exclusively and so waits for every direct data
    /// write under way, and holds up the ones after it; a direct overwrite of a whole page runs
    /// beside them. Alone, a page is built from the index in memory; in a shared cache from
    /// the page on disk, read under the pages' lock, with this mount's unwritten entries laid
    /// over it (what else is there is taken into memory, and an entry another mount wrote
    /// already makes this mount's reservation for it a duplicate). The index pages are
    /// allocated on the first write (so every later one is an overwrite): as much as the cap
    /// counts for them (`overheadBytes`). False on a failed write (errno says why: EINVAL, the
    /// device refused the alignment). The caller holds `indexWriting`.
    private func writeEntryPages(pages: Range<Int>, fd: Int32, direct: Int32) -> Bool {
        let page = DirectIO.alignment
        let from = pages.lowerBound * page
        let to = pages.upperBound * page
        let pages = UnsafeMutableRawBufferPointer.allocate(byteCount: to - from, alignment: page)
        defer { pages.deallocate() }
        Self.lockRange(fd, Int64(from), Int64(to))
        defer { Self.unlockRange(fd, Int64(from), Int64(to)) }
        // Decided under the lock: a mount that joins later writes this page only after this
        // write, and merges with it.
        let merging = cache.shared.isShared
        if merging {
            guard pread(fd, pages.baseAddress, pages.count, off_t(from)) == pages.count else { return false }
        }
        let t = cache.tick()
        let firstEntry = max(0, (from - CacheFileFormat.headerSize) / CacheFileFormat.entrySize)
        let endEntry = min(format.blockCount, (to - CacheFileFormat.headerSize) / CacheFileFormat.entrySize)
        var written: [(Int, CacheFileFormat.Entry)] = []
        var duplicate: Int64 = 0
        let allocate = state.withLock { s -> Bool in
            if !merging { pages.initializeMemory(as: UInt8.self, repeating: 0) }
            if from == 0 {
                let header = format.encodeHeader()
                header.withUnsafeBytes { pages.copyMemory(from: $0) }
            }
            if firstEntry < endEntry {
                for b in firstEntry..<endEntry {
                    let at = Int(format.entryOffset(b)) - from
                    var e = s.index[b]
                    if merging {
                        let raw = CacheFileFormat.Entry(crc: UInt32(littleEndian: pages.load(fromByteOffset: at, as: UInt32.self)),
                                                        length: UInt32(littleEndian: pages.load(fromByteOffset: at + 4, as: UInt32.self)))
                        let disk = raw.length != 0 && Int(raw.length) == format.blockLength(b) ? raw : .absent
                        if let mine = s.pending[b] {
                            if disk == mine { duplicate += Self.diskBytes(Int(mine.length)) }
                            e = mine
                        } else {
                            takeIn(&s, block: b, disk: disk, tick: t)
                            e = disk
                        }
                    } else if e.length == 0 {
                        continue
                    }
                    if let mine = s.pending[b], mine == e { written.append((b, e)) }
                    pages.storeBytes(of: e.crc.littleEndian, toByteOffset: at, as: UInt32.self)
                    pages.storeBytes(of: e.length.littleEndian, toByteOffset: at + 4, as: UInt32.self)
                }
            }
            defer { s.indexAllocated = true }
            return !s.indexAllocated
        }
        let out = direct >= 0 ? direct : fd
        // Not when this write covers every page the allocation would (a small object's one
        // index page): a write of whole pages allocates them itself.
        let counted = min(format.dataOffset, overheadBytes)
        if allocate, from > 0 || Int64(to) < counted { SparseFile.allocate(out, offset: 0, length: counted) }
        indexWriteCount.add(1, ordering: .relaxed)
        guard pwrite(out, pages.baseAddress, pages.count, off_t(from)) == pages.count else { return false }
        state.withLock { s in
            for (b, e) in written where s.pending[b] == e { s.pending.removeValue(forKey: b) }
        }
        cache.shared.noteIndexWrite(bucket: bucket)
        // Another mount stored these blocks too: the disk holds them once.
        if duplicate > 0 { cache.unreserve(duplicate) }
        return true
    }
}
