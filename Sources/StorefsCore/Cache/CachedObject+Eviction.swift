import Foundation
import Glibc
import Synchronization

/// Dropping a cache file's blocks: the least recently used ones when the cache needs room
/// (`BlockCache.evict` collects them from every object), a block that failed its CRC32C, and
/// every block of an object whose whole-object check failed. The entry goes from memory under
/// the state lock, and from the disk (the entry, then the block's disk space) outside it,
/// under the index pages' lock (`lockRange`). In a shared cache what is freed is what the disk
/// held: an entry another mount already dropped frees nothing twice, and one it wrote while
/// this mount had its own unwritten is freed with it (both were counted).
extension CachedObject {
    /// Drops every block (index and disk) at once, other mounts' too; returns the disk bytes
    /// freed.
    func evictAll() -> Int64 {
        // Under `indexWriting`: an index page built before this and written after it would
        // bring the entries back (their blocks then fail their checks: refetched, but untidy).
        indexWriting.lock()
        defer { letGoOfIndexWriting() }
        let sharing = cache.shared.isShared
        let (mine, pendingBytes) = state.withLock { s -> (Int64, Int64) in
            var freed: Int64 = 0
            s.index.forEachPresent { _, e, _ in freed += Self.diskBytes(Int(e.length)) }
            let pending = s.pending.values.reduce(Int64(0)) { $0 + Self.diskBytes(Int($1.length)) }
            s.index.removeAll()
            s.verified = false
            s.allocatedChunks.removeAll()
            s.indexAllocated = false
            // Nothing set so far is left to write: every entry is gone.
            s.dirtyPages.removeAll()
            s.pending.removeAll()
            s.setsWritten = s.setsMade
            s.drops &+= 1
            return (freed, pending)
        }
        // In a shared cache what is freed is what the file holds (read below); nothing of a
        // file another mount removed meanwhile but this mount's own unwritten blocks.
        var freed = sharing ? pendingBytes : mine
        // The index first (a punched hole reads as zeros: every block absent), then the data's
        // disk space; outside the state lock, so readers meanwhile see the blocks gone.
        withAnyDescriptor { fd in
            let (from, to) = Self.pageRange(Int64(CacheFileFormat.headerSize), format.dataOffset)
            Self.lockRange(fd, from, to)
            defer { Self.unlockRange(fd, from, to) }
            if sharing, let disk = Self.readIndex(fd: fd, format: format) {
                var onDisk: Int64 = 0
                disk.forEachPresent { _, e, _ in onDisk += Self.diskBytes(Int(e.length)) }
                freed = onDisk + pendingBytes
            }
            _ = SparseFile.punchHole(fd, offset: Int64(CacheFileFormat.headerSize),
                                     length: Int64(CacheFileFormat.entrySize * format.blockCount))
            _ = SparseFile.punchHole(fd, offset: format.dataOffset, length: format.objectSize)
            cache.shared.noteIndexWrite(bucket: bucket)
        }
        return freed
    }

    /// Every present block with its recency: this mount's last use of it, or another mount's
    /// later use of the file (its mtime, `noteFileTime`).
    func collectBlocks(into out: inout [(tick: UInt64, object: CachedObject, block: Int)]) {
        let foreign = foreignUse.load(ordering: .relaxed)
        state.withLock { s in
            s.index.forEachPresent { block, _, tick in out.append((max(tick, foreign), self, block)) }
        }
    }

    /// Drops a block from the index and the disk; returns the disk bytes freed. The entry goes
    /// from memory under the state lock, then from the disk outside it (`withAnyDescriptor`
    /// keeps the descriptor from being closed and its number reused under these writes), under
    /// `indexWriting` throughout so that no index page built before the change is written
    /// after it.
    func evict(block: Int) -> Int64 {
        indexWriting.lock()  // as in `evictAll`
        defer { letGoOfIndexWriting() }
        let sharing = cache.shared.isShared
        let (entry, wasPending) = state.withLock { s -> (CacheFileFormat.Entry, Bool) in
            let entry = s.index[block]
            guard entry.length != 0 else { return (entry, false) }
            s.index.set(block, .absent, tick: 0)
            s.verified = false  // complete again later: checked again then
            s.drops &+= 1
            return (entry, s.pending.removeValue(forKey: block) != nil)
        }
        guard entry.length != 0 else { return 0 }
        // In a shared cache what is freed is what the disk held (read below): nothing when the
        // file is not there any more (another mount removed it, and counted that).
        var freed = sharing ? (wasPending ? Self.diskBytes(Int(entry.length)) : 0) : Self.diskBytes(Int(entry.length))
        withAnyDescriptor { fd in
            let at = format.entryOffset(block)
            let (from, to) = Self.pageRange(at, at + Int64(CacheFileFormat.entrySize))
            Self.lockRange(fd, from, to)
            defer { Self.unlockRange(fd, from, to) }
            if sharing {
                // What the disk holds there now: the entry (this mount's, or another's of the
                // same block), nothing (another mount evicted it, or this mount's was not
                // written yet), or another entry (never for right bytes: left to its checks).
                let disk = Self.readEntries(fd: fd, format: format, from: block, count: 1)?.first ?? .absent
                freed = (wasPending ? Self.diskBytes(Int(entry.length)) : 0) + (disk == entry ? Self.diskBytes(Int(disk.length)) : 0)
                guard disk == entry || wasPending else { return }
                if disk == entry { Self.writeAbsent(fd: fd, at: at) }
            } else {
                Self.writeAbsent(fd: fd, at: at)
            }
            _ = SparseFile.punchHole(fd, offset: format.blockOffset(block), length: Int64(entry.length))
            cache.shared.noteIndexWrite(bucket: bucket)
        }
        return freed
    }

    private static func writeAbsent(fd: Int32, at offset: Int64) {
        let zero = CacheFileFormat.encode(.absent)
        _ = zero.withUnsafeBytes { pwrite(fd, $0.baseAddress, $0.count, off_t(offset)) }
    }

    /// A block that failed verification is removed, unless a writer replaced it meanwhile.
    func dropIfUnchanged(block: Int, entry: CacheFileFormat.Entry) -> Int64 {
        let same = state.withLock { $0.index[block] == entry }
        guard same else { return 0 }
        let freed = evict(block: block)
        cache.unreserve(freed)
        return freed
    }
}
