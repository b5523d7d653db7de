import Foundation
import Glibc
import Synchronization

/// Dropping a cache file's blocks: the least recently used ones when the cache needs room
/// (`BlockCache.evict` collects them from every object), a block that failed its CRC32C, and
/// every block of an object whose whole-object check failed. The entry goes from memory under
/// the state lock, and from the disk (the entry, then the block's disk space) outside it.
extension CachedObject {
    /// Drops every block (index and disk) at once; returns the disk bytes freed.
    func evictAll() -> Int64 {
        // Under `indexWriting`: an index page built before this and written after it would
        // bring the entries back (their blocks then fail their checks: refetched, but untidy).
        indexWriting.lock()
        defer { letGoOfIndexWriting() }
        let freed = state.withLock { s -> Int64 in
            var freed: Int64 = 0
            s.index.forEachPresent { _, e, _ in freed += Self.diskBytes(Int(e.length)) }
            s.index.removeAll()
            s.verified = false
            s.allocatedChunks.removeAll()
            s.indexAllocated = false
            // Nothing set so far is left to write: every entry is gone.
            s.dirtyPages.removeAll()
            s.setsWritten = s.setsMade
            return freed
        }
        // The index first (a punched hole reads as zeros: every block absent), then the data's
        // disk space; outside the state lock, so readers meanwhile see the blocks gone.
        withAnyDescriptor { fd in
            _ = SparseFile.punchHole(fd, offset: Int64(CacheFileFormat.headerSize),
                                     length: Int64(CacheFileFormat.entrySize * format.blockCount))
            _ = SparseFile.punchHole(fd, offset: format.dataOffset, length: format.objectSize)
        }
        return freed
    }

    func collectBlocks(into out: inout [(tick: UInt64, object: CachedObject, block: Int)]) {
        state.withLock { s in
            s.index.forEachPresent { block, _, tick in out.append((tick, self, block)) }
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
        let entry = state.withLock { s -> CacheFileFormat.Entry in
            let entry = s.index[block]
            guard entry.length != 0 else { return entry }
            s.index.set(block, .absent, tick: 0)
            s.verified = false  // complete again later: checked again then
            return entry
        }
        guard entry.length != 0 else { return 0 }
        withAnyDescriptor { fd in
            let zero = CacheFileFormat.encode(.absent)
            _ = zero.withUnsafeBytes { pwrite(fd, $0.baseAddress, $0.count, off_t(format.entryOffset(block))) }
            _ = SparseFile.punchHole(fd, offset: format.blockOffset(block), length: Int64(entry.length))
        }
        return Self.diskBytes(Int(entry.length))
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
