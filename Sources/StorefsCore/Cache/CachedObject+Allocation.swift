import Foundation
import Glibc
import Synchronization

/// Allocating a cache file's data ahead of direct writes into it (so each is an overwrite,
/// which ext4 runs beside the file's other writers), and letting go of what was allocated and
/// never written: at close (`letAllocationGo`) and after a killed daemon (`trimAllocation`).
/// docs/architecture.md, "Cache writes". In a shared cache what is punched is decided only
/// while no other mount has the file open (they may be writing into it) and by its index on
/// disk (docs/cache.md, "Allocation").
extension CachedObject {
    /// Read-ahead's data is allocated this much at a time: allocating takes the file's inode
    /// lock exclusively and waits for every direct write under way, so one `fallocate` per run
    /// (2–4 MiB) queued 8 readers' writers behind each other (docs/architecture.md, "Cache
    /// writes"). What a chunk holds beyond the blocks written is disk the cap does not count,
    /// so a chunk is at most 1/64 of the cap, none below 4 MiB (then each run allocates its
    /// own range), an allocation (with the chunks taken ahead) at most 1/64 of the cap too,
    /// and the rest of a file's chunks is let go when its last user closes it. The cap here is
    /// this mount's own `cache_size` (fixed for its life: a chunk's blocks stay those blocks).
    private var allocationChunk: Int64 {
        let chunk = min(16 << 20, cache.ownCapacity / 64) / Int64(format.blockSize) * Int64(format.blockSize)
        return chunk >= 4 << 20 ? chunk : 0
    }

    /// Chunks one allocation may take at most: itself and those allocated ahead with it, within
    /// 128 MiB and 1/64 of the cap (`allocate`).
    private var allocationRunChunks: Int {
        let chunk = allocationChunk
        return chunk > 0 ? max(1, Int(min(128 << 20, cache.ownCapacity / 64) / chunk)) : 1
    }

    /// The blocks of allocation chunk `c`.
    func chunkBlocks(_ c: Int) -> Range<Int> {
        let perChunk = Int(allocationChunk / Int64(format.blockSize))
        return min(format.blockCount, c * perChunk)..<min(format.blockCount, (c + 1) * perChunk)
    }

    /// Punches every run of absent blocks in `blocks` (under the state lock, with the file open).
    func punchAbsent(_ s: inout State, in blocks: Range<Int>) {
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

    /// The last user closes the file (under the state lock, the file open): what the chunks
    /// this mount allocated ahead hold beyond the blocks written goes. In a shared cache only
    /// if no other mount has the file open, and then everything beyond the blocks the disk's
    /// index holds (other mounts' chunks and a killed mount's too, `trimAllocation`).
    func letAllocationGo(_ s: inout State) {
        guard !s.allocatedChunks.isEmpty else { return }
        guard cache.shared.isShared else {
            for c in s.allocatedChunks { punchAbsent(&s, in: chunkBlocks(c)) }
            return
        }
        guard CacheDirectory.tryAlone(s.fd) else { return }
        defer { CacheDirectory.share(s.fd) }
        guard let disk = Self.readIndex(fd: s.fd, format: format) else { return }
        trimAllocation(fd: s.fd, index: disk)
    }

    /// A file that holds more disk than the blocks of `index` and its own index (chunks
    /// allocated ahead by a daemon killed before it closed the file, data written by one killed
    /// before its index entry) lets the rest go. Called when no other mount has the file open
    /// (the first time a mount opens it, `prepare`; the last close, `letAllocationGo`).
    func trimAllocation(fd: Int32, index: BlockIndex) {
        var st = stat()
        guard fstat(fd, &st) == 0 else { return }
        var stored: Int64 = 0
        index.forEachPresent { _, e, _ in stored += Self.diskBytes(Int(e.length)) }
        guard Int64(st.st_blocks) * 512 > overheadBytes + stored + (1 << 20) else { return }
        var present: [Int] = []
        index.forEachPresent { b, _, _ in present.append(b) }
        present.sort()
        var next = 0
        for b in present + [format.blockCount] {
            if b > next {
                let from = Int64(next) * Int64(format.blockSize)
                let to = min(format.objectSize, Int64(b) * Int64(format.blockSize))
                _ = SparseFile.punchHole(fd, offset: format.dataOffset + from, length: to - from)
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
    func allocate(blocks: Range<Int>, direct: Int32, ahead: Bool) {
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
}
