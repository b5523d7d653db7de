import Foundation
import Glibc
import Synchronization

/// The start-up scan: every valid cache file an earlier mount (or, in a shared cache, another
/// mount) left is taken in, its blocks oldest first in the LRU order by the file's mtime, and
/// anything else under the version directory is removed (docs/cache.md, "Starting").
extension BlockCache {
    /// Start-up scan: reuse valid files (oldest first in LRU order), delete anything else.
    /// With other mounts live, a temporary file younger than `CacheDirectory.temporaryAge`
    /// stays (one of them may be about to rename it into place) and the count they keep stays;
    /// alone, the count is what the files hold.
    func loadExisting() {
        let sharing = shared.isShared
        var found: [(mtime: Int64, object: CachedObject)] = []
        files.scan(keepRecentTemporaries: sharing) { hex, fd, mtime in
            guard let object = load(fd: fd, hex: hex) else { return false }
            found.append((mtime, object))
            return true
        }
        var used: Int64 = 0
        state.withLock { s in
            for (mtime, o) in found {
                o.setTicks(UInt64(max(0, mtime)))
                s.objects[o.hex] = o
                used += o.overheadBytes + o.storedBytes
            }
        }
        if sharing {
            // The live mounts keep the count; killed ones' reservations are given back.
            shared.reclaimDead()
        } else {
            shared.setUsed(used)
        }
        if shared.used > capacity { evict(toMakeRoomFor: 0) }
        Log.debug("cache loaded objects=\(found.count) bytes=\(used) dir=\(directory) shared=\(sharing)")
    }

    /// The cached object in an open cache file, or nil when the file is not a valid one.
    func load(fd: Int32, hex: String) -> CachedObject? {
        var st = stat()
        guard fstat(fd, &st) == 0 else { return nil }
        var header = [UInt8](repeating: 0, count: CacheFileFormat.headerSize)
        guard header.withUnsafeMutableBytes({ pread(fd, $0.baseAddress, $0.count, 0) }) == header.count,
              let format = CacheFileFormat.decodeHeader(header), format.blockSize == blockSize,
              BlockCache.hex(format.keyHash) == hex,
              Int64(st.st_size) == format.dataOffset + format.objectSize,
              let index = CachedObject.readIndex(fd: fd, format: format) else { return nil }
        let object = CachedObject(cache: self, format: format, hex: hex, path: path(forHex: hex), index: index, inode: st.st_ino)
        object.setTicks(UInt64(max(0, Int64(st.st_mtim.tv_sec) * 1_000_000_000 + Int64(st.st_mtim.tv_nsec))))
        return object
    }
}
