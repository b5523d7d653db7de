import Foundation
import Glibc
import Synchronization

/// The cap and LRU eviction (docs/cache.md, "One cap" and "Eviction"). The bytes the cache
/// holds are counted in `SharedCache`, one count for every mount of the directory: a store
/// reserves its bytes there before it writes, and eviction frees down to a low-water mark.
/// One mount evicts at a time (the evictor lock); in a shared cache it first gives back what
/// killed mounts reserved and never wrote (`SharedCache.reclaimDead`), then looks at every
/// file on disk (other mounts' too, their indexes as they are now) for what to evict.
extension BlockCache {
    /// Makes room for `bytes` more (evicting least recently used blocks); false if it cannot.
    /// The bytes are counted as in flight until `landed`.
    func reserve(_ bytes: Int64) -> Bool {
        let cap = capacity
        if bytes > cap { return false }
        if shared.used + bytes > cap { evict(toMakeRoomFor: bytes) }
        return shared.reserve(bytes, capacity: cap)
    }

    /// Returns counted bytes that hold nothing (a failed write, a block stored twice, evicted
    /// blocks).
    func unreserve(_ bytes: Int64) {
        shared.add(-bytes)
    }

    /// Reserved bytes whose index entries are now set (or that were given back).
    func landed(_ bytes: Int64) {
        shared.landed(bytes)
    }

    /// Evicts least recently used blocks down to a low-water mark (`everything`: all blocks,
    /// `storefs cache clear --force`); files left empty and unused go too.
    func evict(toMakeRoomFor bytes: Int64, everything: Bool = false) {
        evicting.lock()
        shared.beginEviction()
        defer {
            shared.endEviction()
            evicting.unlock()
        }
        let cap = capacity
        // Another evictor (in this mount or another) may have made the room meanwhile.
        guard everything || shared.used + bytes > cap else { return }
        if shared.isShared {
            shared.reclaimDead()
            rescanHoldingEvictor()
        }
        let lowWater = everything ? 0 : cap - cap / 10 - bytes
        let objects = state.withLock { Array($0.objects.values) }
        var candidates: [(tick: UInt64, object: CachedObject, block: Int)] = []
        for o in objects { o.collectBlocks(into: &candidates) }
        candidates.sort { $0.tick < $1.tick }
        var freed: Int64 = 0
        var blocks = 0
        let over = everything ? Int64.max : shared.used - max(0, lowWater)
        for c in candidates where freed < over {
            let f = c.object.evict(block: c.block)
            freed += f
            if f > 0 { blocks += 1 }
        }
        Metrics.shared.evicted(blocks: blocks, bytes: freed)
        // Files with nothing left and nobody using them (in any mount) go entirely.
        var removed: Int64 = 0
        let files = self.files
        state.withLock { s in
            for o in objects where o.isEmptyAndUnused && s.objects[o.hex] === o {
                if files.removeFileIfUnused(o.hex, isEmpty: { CachedObject.readIndex(fd: $0, format: o.format)?.present == 0 }) {
                    s.objects.removeValue(forKey: o.hex)
                    removed += o.overheadBytes
                }
            }
        }
        shared.add(-(freed + removed))
        Log.debug("cache eviction freed=\(freed + removed) used=\(usedBytes) cap=\(cap)")
    }

    /// Counts the bytes the cache holds again from what is on disk (after `rm -rf v1`: what
    /// the deleted files held is gone).
    func recount() {
        evicting.lock()
        shared.beginEviction()
        defer {
            shared.endEviction()
            evicting.unlock()
        }
        if shared.isShared {
            let before = shared.used
            rescanHoldingEvictor()
            let objects = state.withLock { $0.objects.values }
            shared.recount(onDisk: objects.reduce(0) { $0 + $1.overheadBytes + $1.storedBytes }, before: before)
        } else {
            let objects = state.withLock { Array($0.objects.values) }
            shared.setUsed(objects.reduce(0) { $0 + $1.overheadBytes + $1.storedBytes })
        }
    }

    /// Looks at every cache file on disk (the evictor lock held): files other mounts made are
    /// taken in, files they removed are forgotten (unless in use here), every index is read
    /// again where another mount wrote one of its bucket since, and each file's mtime is
    /// noted (other mounts' recent use, `CachedObject.noteFileTime`).
    func rescanHoldingEvictor() {
        var onDisk: [String: (mtime: Int64, inode: ino_t)] = [:]
        files.listFiles { hex, mtime, inode in onDisk[hex] = (mtime, inode) }
        let known = state.withLock { $0.objects }
        // Files removed or replaced by another mount: forgotten unless in use here.
        let gone = known.filter { hex, o in onDisk[hex]?.inode != o.inode }
        if !gone.isEmpty {
            state.withLock { s in
                for (hex, o) in gone where s.objects[hex] === o && o.isUnused { s.objects.removeValue(forKey: hex) }
            }
        }
        for (hex, info) in onDisk {
            if let o = known[hex], o.inode == info.inode {
                o.catchUp()
                o.noteFileTime(info.mtime)
            } else if let o = adopt(hex) {
                o.noteFileTime(info.mtime)
            }
        }
    }

    /// Takes in (unless known already) the cache file of `hex` that another mount made, as it
    /// is on disk; the known object, the new one, or nil when there is no valid file.
    /// `insert` false: loaded, not added (a creator checks it first).
    @discardableResult
    func adopt(_ hex: String, insert: Bool = true) -> CachedObject? {
        guard let fd = files.openFile(hex) else { return nil }
        let loaded = load(fd: fd, hex: hex)
        Glibc.close(fd)
        guard let loaded, insert else { return loaded }
        return state.withLock { s -> CachedObject in
            if let known = s.objects[hex] { return known }
            s.objects[hex] = loaded
            return loaded
        }
    }
}
