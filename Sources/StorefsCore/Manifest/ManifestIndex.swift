import Glibc
import Synchronization

/// A manifest's index, mapped read-only (`ManifestIndexFormat`): lookups are a binary search
/// among one directory's children, readdir a walk along them, nothing decoded ahead of use
/// and nothing kept as Swift objects. Shared by every thread; immutable once mapped.
///
/// The mapping is a file's: pages the walks touch count in the daemon's RSS until dropped,
/// and the kernel maps up to 16 pages around each one faulted in. So every `checkBytes` or
/// so read through it (an estimate: what was read, a lookup counted as `lookupBytes`), the
/// process's resident file-backed pages are read from /proc/self/statm, and once the mapping
/// holds more than `residentLimit` beyond what was resident when it was mapped (the binary,
/// libraries), its pages are dropped with MADV_DONTNEED (they stay in the page cache: the
/// next touch is a minor fault). A `find` of 10,000,000 names therefore does not leave the
/// whole index (~50 bytes a name) in RSS, nor pass through it (docs/manifest.md, "Memory").
/// And once nothing has used the index for a couple of seconds, its pages go too
/// (`releaseIfIdle`, called by MemoryReturn's trimming thread).
final class ManifestIndex: @unchecked Sendable {
    let header: ManifestIndexFormat.Header
    private let base: UnsafeRawPointer
    private let length: Int
    private let directories: UInt64
    private let children: UInt64
    private let blob: UnsafeRawPointer
    private let directoryTable: UnsafeRawPointer
    private let childTable: UnsafeRawPointer
    /// Bytes read through the mapping since RSS was last looked at (an estimate).
    private let touched = Atomic<Int>(0)
    /// /proc/self/statm (read with pread at 0), and its shared (file-backed resident) bytes
    /// when the index was mapped: -1 where it cannot be opened (then every check trims).
    private let statm: Int32
    private let residentBefore: Int
    /// Said when a bounds check fails (once).
    private let reportedDamage = Atomic<Bool>(false)
    private let onDamage: @Sendable () -> Void

    static let checkBytes = 4 << 20
    static let residentLimit = 24 << 20
    /// Calls of `noteTouched`, and their count when `releaseIfIdle` last looked and last let
    /// the pages go.
    private let uses = Atomic<Int>(0)
    private let usesSeen = Atomic<Int>(-1)
    private let usesReleased = Atomic<Int>(0)
    /// What one lookup is counted as: a binary search faults a few pages in, and the kernel
    /// maps up to 16 pages around each fault.
    static let lookupBytes = 1 << 20

    struct Damaged: Error {}

    /// Maps the index in `fd` (which the caller keeps or closes: the mapping stays) if it is a
    /// valid index of `identity`: header, sizes and the whole content's checksum. nil
    /// otherwise (the caller builds it again). `onDamage` is called once if a later bounds
    /// check fails.
    init?(fd: Int32, identity: [UInt8], onDamage: @escaping @Sendable () -> Void = {}) {
        var st = stat()
        guard fstat(fd, &st) == 0, st.st_size >= ManifestIndexFormat.headerSize, st.st_size < Int64(Int.max / 2) else { return nil }
        let size = Int(st.st_size)
        guard let map = mmap(nil, size, PROT_READ, MAP_SHARED, fd, 0), map != MAP_FAILED else { return nil }
        let bytes = UnsafeRawBufferPointer(start: map, count: size)
        guard let h = ManifestIndexFormat.Header.decode(bytes), h.identity == identity, h.fileSize == UInt64(size),
              Checksum.crc32c(UnsafeRawBufferPointer(rebasing: bytes[ManifestIndexFormat.headerSize...])) == h.contentCRC else {
            munmap(map, size)
            return nil
        }
        header = h
        base = UnsafeRawPointer(map)
        length = size
        directories = h.directories
        children = h.children
        blob = base + Int(h.blobOffset)
        directoryTable = base + Int(h.directoriesOffset)
        childTable = base + Int(h.childrenOffset)
        self.onDamage = onDamage
        // The checksum read every page: let them go.
        _ = madvise(map, size, MADV_DONTNEED)
        statm = open("/proc/self/statm", O_RDONLY | O_CLOEXEC)
        residentBefore = Self.sharedBytes(statm) ?? 0
    }

    deinit {
        munmap(UnsafeMutableRawPointer(mutating: base), length)
        if statm >= 0 { close(statm) }
    }

    /// The process's resident file-backed bytes (statm's third field, in pages).
    private static func sharedBytes(_ fd: Int32) -> Int? {
        guard fd >= 0 else { return nil }
        var buffer = [UInt8](repeating: 0, count: 128)
        let n = buffer.withUnsafeMutableBytes { pread(fd, $0.baseAddress, $0.count, 0) }
        guard n > 0 else { return nil }
        let fields = buffer[0..<n].split(separator: UInt8(ascii: " "))
        guard fields.count >= 3, let pages = Int(String(decoding: fields[2], as: UTF8.self)) else { return nil }
        return pages * Int(getpagesize())
    }

    /// The bytes of the whole file (tests).
    var bytes: UnsafeRawBufferPointer { UnsafeRawBufferPointer(start: base, count: length) }

    private func damaged() -> Damaged {
        if !reportedDamage.exchange(true, ordering: .relaxed) { onDamage() }
        return Damaged()
    }

    /// Counts bytes read through the mapping; every `checkBytes`, drops its pages from RSS
    /// if they hold more than `residentLimit`.
    func noteTouched(_ bytes: Int) {
        uses.add(1, ordering: .relaxed)
        guard touched.add(bytes, ordering: .relaxed).newValue > Self.checkBytes else { return }
        touched.store(0, ordering: .relaxed)
        if let shared = Self.sharedBytes(statm), shared - residentBefore <= Self.residentLimit { return }
        _ = madvise(UnsafeMutableRawPointer(mutating: base), length, MADV_DONTNEED)
    }

    /// Drops the mapping's pages from RSS if nothing used the index since the last call and
    /// something did since they were last dropped (MemoryReturn calls it every 2 s).
    /// True when it let the pages go.
    @discardableResult
    func releaseIfIdle() -> Bool {
        let now = uses.load(ordering: .relaxed)
        guard usesSeen.exchange(now, ordering: .relaxed) == now, usesReleased.exchange(now, ordering: .relaxed) != now else { return false }
        _ = madvise(UnsafeMutableRawPointer(mutating: base), length, MADV_DONTNEED)
        return true
    }

    /// The children of directory `id`: a range of child numbers.
    func children(of id: UInt32) throws(Damaged) -> Range<Int> {
        guard UInt64(id) < directories else { throw damaged() }
        let d = ManifestIndexFormat.Directory.decode(directoryTable + Int(id) * ManifestIndexFormat.directorySize)
        guard d.firstChild <= children, UInt64(d.children) <= children - d.firstChild else { throw damaged() }
        return Int(d.firstChild)..<(Int(d.firstChild) + Int(d.children))
    }

    /// Child number `i`, its name checked to lie in the blob and a directory's number to exist.
    func child(_ i: Int) throws(Damaged) -> ManifestIndexFormat.Child {
        guard i >= 0, UInt64(i) < children else { throw damaged() }
        let c = ManifestIndexFormat.Child.decode(childTable + i * ManifestIndexFormat.childSize)
        guard c.nameLength > 0, c.nameOffset <= header.blobLength, UInt64(c.nameLength) <= header.blobLength - c.nameOffset,
              !c.isDirectory || c.value < directories else { throw damaged() }
        return c
    }

    /// The name of a child returned by `child(_:)`.
    func name(_ c: ManifestIndexFormat.Child) -> UnsafeRawBufferPointer {
        UnsafeRawBufferPointer(start: blob + Int(c.nameOffset), count: c.nameLength)
    }

    /// The child of directory `dir` called `name` (bytes), by binary search.
    func find(_ name: UnsafeRawBufferPointer, in dir: UInt32) throws(Damaged) -> ManifestIndexFormat.Child? {
        let range = try children(of: dir)
        noteTouched(Self.lookupBytes)
        var lo = range.lowerBound, hi = range.upperBound
        while lo < hi {
            let mid = lo + (hi - lo) / 2
            let c = try child(mid)
            let n = self.name(c)
            let common = min(n.count, name.count)
            let cmp = common == 0 ? 0 : memcmp(n.baseAddress!, name.baseAddress!, common)
            if cmp == 0 && n.count == name.count { return c }
            if cmp < 0 || (cmp == 0 && n.count < name.count) { lo = mid + 1 } else { hi = mid }
        }
        return nil
    }

    /// The directory reached from `dir` through `components` (nil: no such directory).
    func directory(_ components: [String], from dir: UInt32) throws(Damaged) -> UInt32? {
        var d = dir
        for var component in components {
            let found = try component.withUTF8Bytes { u throws(Damaged) in try find(u, in: d) }
            guard let c = found, c.isDirectory else { return nil }
            d = UInt32(c.value)
        }
        return d
    }
}
