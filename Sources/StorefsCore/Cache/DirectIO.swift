import Glibc
internal import CBlockCache

/// How cache data reaches the disk (`cache_io=`).
public enum CacheIO: String, Sendable {
    /// Past the page cache where the filesystem allows (the default; `DirectIO`), but
    /// for objects of at most 4 MiB stored whole (files fetched whole); reads of one block
    /// not in memory too.
    case direct
    /// Through the page cache: the cache files' pages stay in memory for the next mount's
    /// reads, as long as the kernel keeps them, beside the mounted files' own.
    case buffered
}

/// Cache data written past the page cache (O_DIRECT), docs/architecture.md "Cache writes", and
/// single blocks read past it when they are not in memory ("Cached runs ahead").
///
/// A buffered write copies every downloaded byte into a new page-cache page of the cache file,
/// beside the page the kernel already keeps of the mounted file itself: each byte read cold
/// sat in memory twice, and the copy into freshly allocated pages was the daemon's largest
/// single cost on a cold read (a third of its CPU here). A direct write hands the download
/// buffer to the disk as it is. Where a write cannot go direct (the filesystem refuses
/// O_DIRECT, a buffer or offset is not aligned, the object's last partial block) it is
/// buffered as before: the bytes on disk are the same either way. An object of at most 4 MiB
/// stored whole in one call (a small file fetched whole) is written buffered on purpose: there
/// the direct write's wait for the disk and its allocation cost more than the copy
/// (`CachedObject.store`).
///
/// Reads: a block-cache hit of one block (a random read) whose pages the kernel let go is read
/// direct too. A buffered read of it waited for the disk as long and then some (page
/// allocation, the page cache's own bookkeeping: 16 KiB at random from a 256 MiB cache file,
/// p50 80 µs buffered against 62 µs direct here), and it put the block in memory a second
/// time beside the mounted file's page the kernel fills from it.
enum DirectIO {
    /// Offsets, lengths and buffer addresses of direct writes are multiples of this: a
    /// device's logical block (512 or 4096 bytes) divides it.
    static let alignment = 4096

    /// An O_DIRECT descriptor (reads and writes) of the file `fd` is open on, or nil where the
    /// filesystem does not allow one (tmpfs before Linux 6.6, some FUSE and network ones).
    static func reopen(_ fd: Int32) -> Int32? {
        let d = cblockcache_reopen_direct(fd)
        return d >= 0 ? d : nil
    }

    /// Writes `bytes` at `offset`: the aligned part through `direct` when it can, the rest
    /// through `buffered`. Direct writes to one file may run at once (`CachedObject.store`).
    /// False on a failed or short write (errno says why). `direct` is set to -1 if the
    /// filesystem turned the direct write down (the bytes then went buffered), so that the
    /// caller writes buffered from then on; the descriptor stays open (other writers may be
    /// using it) until the file is closed.
    static func write(_ bytes: UnsafeRawBufferPointer, at offset: Int64, buffered: Int32, direct: inout Int32) -> Bool {
        var done = 0
        if direct >= 0, let base = bytes.baseAddress, Int(bitPattern: base) % alignment == 0,
           offset % Int64(alignment) == 0, bytes.count >= alignment {
            let aligned = bytes.count / alignment * alignment
            // The caller allocated the range (`CachedObject.allocate`): the write is an
            // overwrite, which the filesystem lets run beside other writers of the file (ext4
            // takes its inode lock shared only for those).
            let n = pwrite(direct, base, aligned, off_t(offset))
            if n == aligned {
                done = aligned
            } else {
                // The range's allocation stays (not punched: another writer of the same blocks
                // may have filled it meanwhile); at most one run until the file goes.
                guard n < 0 && errno == EINVAL else { return false }
                // Alignment this device does not take: buffered from now on.
                direct = -1
            }
        }
        guard done < bytes.count else { return true }
        let rest = UnsafeRawBufferPointer(rebasing: bytes[done...])
        return pwrite(buffered, rest.baseAddress, rest.count, off_t(offset + Int64(done))) == rest.count
    }

    /// Reads `length` bytes of the file at `offset` into `buffer`: buffered when the page cache
    /// holds all of them, else through `direct`, so that the disk read fills no page of the
    /// cache file; buffered as any other read where that cannot be (`direct` -1, a kernel
    /// before 6.5 cannot tell what is in memory without reading, the filesystem refuses the
    /// direct read). `buffer` is aligned to `alignment` and has room for `length` rounded up to
    /// it. False on a failed or short read.
    ///
    /// Not `preadv2(RWF_NOWAIT)` to find out: on a miss it starts the kernel's read of those
    /// pages before it answers EAGAIN, and the direct read then waited behind it (p50 144
    /// against 104 µs buffered, docs/experiments.md, "2026-12-07, evening").
    static func read(into buffer: UnsafeMutableRawBufferPointer, length: Int, at offset: Int64, buffered: Int32, direct: Int32) -> Bool {
        guard let base = buffer.baseAddress else { return length == 0 }
        let rounded = (length + alignment - 1) / alignment * alignment
        if direct >= 0, buffer.count >= rounded, Int(bitPattern: base) % alignment == 0, offset % Int64(alignment) == 0,
           cblockcache_all_cached(buffered, off_t(offset), length) == 0 {
            // From the disk (a short read ends at the file's end, within the last block's rounding).
            let n = pread(direct, base, rounded, off_t(offset))
            if n >= length { return true }
            guard n < 0, errno == EINVAL else { return false }
            // No direct read of this here: buffered.
        }
        return pread(buffered, base, length, off_t(offset)) == length
    }
}
