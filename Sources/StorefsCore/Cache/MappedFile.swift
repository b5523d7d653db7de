import Glibc

/// Files under `cache_dir` that storefs changes through a `MAP_SHARED` mapping (the shared
/// cache's state, `SharedCache`; a manifest index being built, `ManifestIndexBuilder`).
///
/// A store into a page of a mapped file that has no disk block yet must get one from the
/// filesystem, and on a full filesystem it cannot: the process gets SIGBUS, not an error (a
/// 2 MiB tmpfs cache_dir filled with blocks killed the daemon at an index write,
/// docs/experiments.md, "2026-12-07, late morning"). So every range is allocated before the
/// first store into it, and a failure is an error the caller reports.
enum MappedFile {
    /// Gives `length` bytes of `fd` at `offset` their disk blocks; nil when done, else why
    /// not. Where the filesystem has no `fallocate`, a range only the caller writes
    /// (`zeroFill`) is written with zeros where it reads as zeros, which allocates it as well;
    /// a range others write was written so by whoever laid it out.
    static func allocate(_ fd: Int32, _ offset: Int, _ length: Int, zeroFill: Bool) -> String? {
        if SparseFile.allocate(fd, offset: Int64(offset), length: Int64(length)) { return nil }
        let err = errno
        guard err == EOPNOTSUPP || err == ENOSYS else { return String(cString: strerror(err)) }
        guard zeroFill else { return nil }
        var page = [UInt8](repeating: 0, count: 4096)
        var at = offset
        while at < offset + length {
            let n = min(page.count, offset + length - at)
            let got = page.withUnsafeMutableBytes { pread(fd, $0.baseAddress, n, off_t(at)) }
            guard got == n else { return got < 0 ? String(cString: strerror(errno)) : "short read" }
            if page[0..<n].allSatisfy({ $0 == 0 }) {
                let put = page.withUnsafeBytes { pwrite(fd, $0.baseAddress, n, off_t(at)) }
                guard put == n else { return put < 0 ? String(cString: strerror(errno)) : "short write" }
            }
            at += n
        }
        return nil
    }
}
