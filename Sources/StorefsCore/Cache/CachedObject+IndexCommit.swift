import Foundation
import Glibc
import Synchronization

/// A cache file's index writes: entries are written after their data, whole pages past the
/// page cache beside direct data writes (built from the index in memory), single entries
/// through it beside buffered ones, and as a group commit under `indexWriting` (whoever holds
/// it writes every page set since the last write; docs/architecture.md, "Cache writes").
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
    func commitIndex(direct: Int32, own: (() -> Int32)?) -> Int32 {
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
    func letGoOfIndexWriting() {
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

    /// Sets index entries in memory from block `first` on; returns the disk bytes of blocks
    /// that were present already (stored twice: counted once). Beside direct data writes
    /// (`direct`) their pages are marked for `writeDirtyPages`, and the set counted.
    func setEntries(_ entries: [CacheFileFormat.Entry], from first: Int, direct: Bool) -> Int64 {
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
    func writeEntries(_ entries: [CacheFileFormat.Entry], from first: Int, fd: Int32) -> Int32 {
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
}
