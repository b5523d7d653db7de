import Foundation
import Glibc
import Synchronization

/// What a mount learns from the index other mounts of a shared cache wrote (docs/cache.md,
/// "Reading what another mount stored"). The index in memory is this mount's view of the
/// file's index on disk: entries it set and has not written yet (`pending`) are its own, the
/// rest is whatever the disk says when it looks. It looks only where another mount may have
/// written an index of the file's bucket since it last looked (`SharedCache`'s counters: no
/// system call to tell), so a mount alone, or with mounts that read other files, never looks.
///
/// Nothing read from disk is served without its CRC32C check (`read`), so an entry taken in
/// whose block was evicted, or is being written, meanwhile is a miss, never wrong bytes.
extension CachedObject {
    /// The index on disk of an open cache file: only present, well-formed entries are kept,
    /// read in chunks with the holes of never-written pages skipped, so that a huge object's
    /// index (8 bytes a block, mostly holes) never sits in memory whole. nil on a failed read.
    static func readIndex(fd: Int32, format: CacheFileFormat) -> BlockIndex? {
        var index = BlockIndex(count: format.blockCount)
        let perChunk = 1 << 17
        var first = 0
        let indexEnd = format.entryOffset(format.blockCount)
        while first < format.blockCount {
            let data = lseek(fd, off_t(format.entryOffset(first)), 3)  // SEEK_DATA (Linux; not in Glibc's Swift module)
            if data < 0 || Int64(data) >= indexEnd { break }
            let firstWithData = max(first, Int((Int64(data) - Int64(CacheFileFormat.headerSize)) / Int64(CacheFileFormat.entrySize)))
            if firstWithData > first {
                first = firstWithData
                continue
            }
            let n = min(perChunk, format.blockCount - first)
            guard let entries = readEntries(fd: fd, format: format, from: first, count: n) else { return nil }
            for (i, e) in entries.enumerated() where e.length != 0 { index.set(first + i, e, tick: 0) }
            first += n
        }
        return index
    }

    /// `count` entries from block `first`, each as the disk has it if well formed (its length
    /// the block's), else absent. nil on a failed read.
    static func readEntries(fd: Int32, format: CacheFileFormat, from first: Int, count: Int) -> [CacheFileFormat.Entry]? {
        var raw = [UInt8](repeating: 0, count: count * CacheFileFormat.entrySize)
        let at = off_t(format.entryOffset(first))
        guard raw.withUnsafeMutableBytes({ pread(fd, $0.baseAddress, $0.count, at) }) == raw.count else { return nil }
        return CacheFileFormat.decodeEntries(raw, count: count).enumerated().map { i, e in
            e.length != 0 && Int(e.length) == format.blockLength(first + i) ? e : .absent
        }
    }

    /// Takes the disk's entry `disk` of `block` into the index in memory, unless this mount set
    /// one it has not written yet (under the state lock).
    func takeIn(_ s: inout State, block: Int, disk: CacheFileFormat.Entry, tick: UInt64) {
        guard s.pending[block] == nil else { return }
        let mine = s.index[block]
        guard mine != disk else { return }
        // Stored by another mount (this one learns of it: its first use is now), evicted by
        // one, or (never for right bytes) stored with another CRC: checked again when complete.
        s.index.set(block, disk, tick: disk.length == 0 ? 0 : tick)
        if mine.length != 0 { s.verified = false }
    }

    /// Index entries per 4 KiB page of the file, and the page of a block's entry.
    private static var entriesPerPage: Int { DirectIO.alignment / CacheFileFormat.entrySize }
    private func page(of block: Int) -> Int { Int(format.entryOffset(block)) / DirectIO.alignment }

    /// The blocks whose entries lie in index page `page`.
    private func blocksOf(page: Int) -> Range<Int> {
        let first = max(0, (page * DirectIO.alignment - CacheFileFormat.headerSize + CacheFileFormat.entrySize - 1) / CacheFileFormat.entrySize)
        let end = min(format.blockCount, ((page + 1) * DirectIO.alignment - CacheFileFormat.headerSize) / CacheFileFormat.entrySize)
        return first..<max(first, end)
    }

    /// Before this mount decides that blocks of `blocks` are not cached: where another mount
    /// wrote an index of the file's bucket since this one last looked, the index pages holding
    /// absent blocks of `blocks` are read again (each once until the next such write) and what
    /// they hold is taken in. A system call only then; the caller holds a user of the object.
    func lookOnDisk(_ blocks: ClosedRange<Int>) {
        let foreign = cache.shared.foreignIndexWrites(bucket: bucket)
        guard foreign != 0, !blocks.isEmpty, blocks.upperBound < format.blockCount else { return }
        let due = state.withLock { s -> (pages: [Int], drops: UInt64)? in
            guard s.caughtUpAt != foreign else { return nil }
            if s.lookedAtForeign != foreign {
                s.lookedAtForeign = foreign
                s.lookedAt.removeAll(keepingCapacity: true)
            }
            var pages: [Int] = []
            var b = blocks.lowerBound
            while b <= blocks.upperBound {
                let p = page(of: b)
                let end = min(blocks.upperBound + 1, blocksOf(page: p).upperBound)
                if !s.lookedAt.contains(p), (b..<end).contains(where: { !s.index.isPresent($0) }) { pages.append(p) }
                b = max(end, b + 1)
            }
            return pages.isEmpty ? nil : (pages, s.drops)
        }
        guard let due else { return }
        let t = cache.tick()
        _ = withFile { fd, _ in
            for p in due.pages {
                let range = blocksOf(page: p)
                guard !range.isEmpty, let disk = Self.readEntries(fd: fd, format: format, from: range.lowerBound, count: range.count) else { continue }
                state.withLock { s in
                    // A block dropped here meanwhile must not come back from a page read before.
                    guard s.drops == due.drops else { return }
                    for (i, e) in disk.enumerated() { takeIn(&s, block: range.lowerBound + i, disk: e, tick: t) }
                    if s.lookedAtForeign == foreign { s.lookedAt.insert(p) }
                }
            }
        }
    }

    /// The whole index is read again if another mount wrote an index of the file's bucket
    /// since this mount last did (an open, eviction's look at every file, `cachedBytes`):
    /// blocks stored there are taken in, blocks evicted there are forgotten.
    func catchUp() {
        let foreign = cache.shared.foreignIndexWrites(bucket: bucket)
        guard foreign != 0 else { return }
        guard let drops = state.withLock({ s -> UInt64? in s.caughtUpAt == foreign ? nil : s.drops }) else { return }
        let t = cache.tick()
        withAnyDescriptor { fd in
            guard let disk = Self.readIndex(fd: fd, format: format) else { return }
            state.withLock { s in
                guard s.drops == drops else { return }
                var mine: [Int] = []
                s.index.forEachPresent { b, _, _ in mine.append(b) }
                for b in mine where !disk.isPresent(b) { takeIn(&s, block: b, disk: .absent, tick: t) }
                disk.forEachPresent { b, e, _ in takeIn(&s, block: b, disk: e, tick: t) }
                s.caughtUpAt = foreign
            }
        }
    }

    /// Before the whole-object check finds the object incomplete in a shared cache: the pages
    /// of the missing blocks are looked at (`lookOnDisk`) when few are missing (another mount
    /// may hold them); far from complete, nothing is read.
    func lookForMissingBlocks() {
        let missing = state.withLock { s -> [Int]? in
            let count = s.index.count - s.index.present
            guard count > 0, count <= 16 * Self.entriesPerPage else { return nil }
            var out: [Int] = []
            for b in 0..<s.index.count where !s.index.isPresent(b) { out.append(b) }
            return out
        }
        guard let missing, let first = missing.first, let last = missing.last else { return }
        lookOnDisk(first...last)
    }
}
