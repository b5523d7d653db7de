import Glibc
import StorageClient

/// Builds a manifest's index (`ManifestIndexFormat`) without holding the manifest in memory
/// (docs/manifest.md, "The index"); over 500 lines because the three steps below share the
/// sort key's encoding and the scratch files' bounds:
///
/// 1. Rows are parsed one at a time; each name becomes a sort key: its path components
///    joined by a 0 byte, so that byte order of keys is the order of a depth-first walk in
///    which each directory's entries come in byte order of their names. A name with a
///    component that cannot be a path component (empty, `.`, `..`, over 255 bytes, a 0 byte)
///    is cut there: what remains is a placeholder of the directory it was in, which
///    therefore exists, as a listing shows it (`DirectoryListing.isRepresentable`).
/// 2. Keys are sorted in runs of `runLimit` entries; more than one run is written to
///    scratch files (unlinked at once) and merged.
/// 3. One pass over the sorted keys builds the tree: a stack of open directories, the names
///    appended to the blob, each child record tagged with its directory into a scratch file,
///    a count per directory. A file directly followed by entries under its own name is
///    hidden by that directory (logged), and of a name given twice the highest generation is
///    kept.
/// 4. The child records are placed by directory (each directory's range from the counts),
///    the directory table written, everything checksummed, and the file renamed into place.
///
/// Memory: one run (about 100 MiB at the default limit) and 16 bytes per directory.
public struct ManifestIndexBuilder {
    /// Entries sorted in memory at once.
    var runLimit = 1 << 20
    /// Key bytes of one run, at most.
    var runKeyBytes = 48 << 20
    /// Called now and then with the data-file bytes read so far.
    var progress: ((Int64) -> Void)? = nil

    /// What a build found.
    public struct Stats: Equatable, Sendable {
        /// Data rows read, and those skipped for their `timeDeleted`.
        public var rows = 0
        public var deleted = 0
        /// Files and directories in the index.
        public var files = 0
        public var directories = 0
        /// Names given more than once (the highest generation kept).
        public var duplicates = 0
        /// Files hidden by a directory of the same name, and the first few of them.
        public var shadowed = 0
        public var shadowedNames: [String] = []
        /// Names with a component that cannot be a path component (hidden, as listings do).
        public var hidden = 0
    }

    /// Shadowed names logged at most (the rest are counted).
    static let shadowedNamesShown = 32

    /// What is kept of a row once its name is a key.
    struct Payload {
        var size: Int64
        var generation: Int64
        var seconds: Int64
        var nanoseconds: Int32
        var crc32c: UInt32
        var hasCRC: Bool

        static let encodedSize = 33

        init(_ r: ManifestRecord) {
            size = r.size
            generation = r.generation
            seconds = r.modified.seconds
            nanoseconds = r.modified.nanoseconds
            crc32c = r.crc32c ?? 0
            hasCRC = r.crc32c != nil
        }

        init(size: Int64, generation: Int64, seconds: Int64, nanoseconds: Int32, crc32c: UInt32, hasCRC: Bool) {
            self.size = size
            self.generation = generation
            self.seconds = seconds
            self.nanoseconds = nanoseconds
            self.crc32c = crc32c
            self.hasCRC = hasCRC
        }
    }

    /// Builds the index of `source` into `directory` as `name`. Throws the manifest's first
    /// problem (nothing is left behind) or a write failure.
    func build(_ source: ManifestSource, parser: ManifestParser, identity: [UInt8], into directory: CacheDirectory,
               as name: String) throws(ManifestError) -> Stats {
        guard let (fd, temp) = directory.createTemporary(for: name) else {
            throw ManifestError("cannot create the manifest index in \(directory.versionPath): \(String(cString: strerror(errno)))")
        }
        var committed = false
        defer {
            close(fd)
            if !committed { directory.removePlainFile(temp) }
        }
        var stats = Stats()
        let tree = try TreeWriter(output: fd, scratch: Self.scratch(directory))
        var runs = RunSet(limit: runLimit, keyBytes: runKeyBytes, directory: directory)
        var key: [UInt8] = []
        let parsed = try parser.read(source, progress: progress) { (name, record) throws(ManifestError) in
            key.removeAll(keepingCapacity: true)
            switch Self.key(of: name, into: &key) {
            case .none: stats.hidden += 1; return
            case .cut: stats.hidden += 1
            case .whole: break
            }
            try runs.add(key, Payload(record))
        }
        stats.rows = parsed.rows
        stats.deleted = parsed.deleted
        try runs.merge { (k, p) throws(ManifestError) in try tree.add(k, p) }
        try tree.finish(identity: identity, in: directory.versionPath)
        stats.files = tree.files
        stats.directories = tree.directoryCount
        stats.duplicates = tree.duplicates
        stats.shadowed = tree.shadowed
        stats.shadowedNames = tree.shadowedNames
        guard fsync(fd) == 0, directory.commitTemporary(temp, as: name) else {
            throw ManifestError("cannot write the manifest index in \(directory.versionPath): \(String(cString: strerror(errno)))")
        }
        committed = true
        return stats
    }

    static func scratch(_ directory: CacheDirectory) throws(ManifestError) -> Int32 {
        guard let (fd, _) = directory.createTemporary(for: "scratch", unlinked: true) else {
            throw ManifestError("cannot create a scratch file in \(directory.versionPath): \(String(cString: strerror(errno)))")
        }
        return fd
    }

    enum KeyShape { case whole, cut, none }

    /// Appends the sort key of object `name` to `key`: its components, each followed by a 0
    /// byte except the last (a placeholder `dir/` ends in 0). `.cut` when a component could
    /// not be a path component (the key is then the placeholder of the directory before
    /// it), `.none` when nothing of the name shows (such a component at the top).
    static func key(of name: UnsafeRawBufferPointer, into key: inout [UInt8]) -> KeyShape {
        let slash = UInt8(ascii: "/")
        var start = 0
        let n = name.count
        while true {
            var end = start
            while end < n && name[end] != slash { end += 1 }
            let component = UnsafeRawBufferPointer(rebasing: name[start..<end])
            let last = end == n
            if last && component.isEmpty {
                return .whole  // `dir/`: the key already ends in the directory's 0
            }
            if !isRepresentable(component) { return key.isEmpty ? .none : .cut }
            key.append(contentsOf: component)
            if last { return .whole }
            key.append(0)
            start = end + 1
        }
    }

    /// `DirectoryListing.isRepresentable`, on bytes.
    static func isRepresentable(_ c: UnsafeRawBufferPointer) -> Bool {
        let dot = UInt8(ascii: ".")
        if c.isEmpty || c.count > DirectoryListing.maxNameBytes { return false }
        if c.count == 1 && c[0] == dot { return false }
        if c.count == 2 && c[0] == dot && c[1] == dot { return false }
        return !c.contains(0)
    }
}

// MARK: sorted runs

/// Keys and payloads in runs of bounded size; `merge` hands them all out in key order.
private struct RunSet {
    struct Item {
        /// The key's first 8 bytes, big-endian (most comparisons end here).
        var prefix: UInt64
        var keyStart: Int
        var keyLength: Int
        var payload: ManifestIndexBuilder.Payload
    }

    let limit: Int
    let keyBytes: Int
    let directory: CacheDirectory
    var keys: [UInt8] = []
    var items: [Item] = []
    /// Spilled runs: scratch descriptors, each a sorted run.
    var spilled: [Int32] = []

    init(limit: Int, keyBytes: Int, directory: CacheDirectory) {
        self.limit = max(1, limit)
        self.keyBytes = keyBytes
        self.directory = directory
    }

    static func prefix(_ key: UnsafeRawBufferPointer) -> UInt64 {
        var v: UInt64 = 0
        for i in 0..<8 { v = v << 8 | UInt64(i < key.count ? key[i] : 0) }
        return v
    }

    mutating func add(_ key: [UInt8], _ payload: ManifestIndexBuilder.Payload) throws(ManifestError) {
        let p = key.withUnsafeBytes { Self.prefix($0) }
        items.append(Item(prefix: p, keyStart: keys.count, keyLength: key.count, payload: payload))
        keys += key
        if items.count >= limit || keys.count >= keyBytes { try spill() }
    }

    private mutating func sort() {
        keys.withUnsafeBytes { k in
            items.sort { a, b in
                if a.prefix != b.prefix { return a.prefix < b.prefix }
                return RunSet.less(UnsafeRawBufferPointer(rebasing: k[a.keyStart..<(a.keyStart + a.keyLength)]),
                                   UnsafeRawBufferPointer(rebasing: k[b.keyStart..<(b.keyStart + b.keyLength)]))
            }
        }
    }

    static func less(_ a: UnsafeRawBufferPointer, _ b: UnsafeRawBufferPointer) -> Bool {
        let n = min(a.count, b.count)
        let c = n == 0 ? 0 : memcmp(a.baseAddress!, b.baseAddress!, n)
        return c != 0 ? c < 0 : a.count < b.count
    }

    /// Sorts the run in memory and writes it to a scratch file.
    private mutating func spill() throws(ManifestError) {
        guard !items.isEmpty else { return }
        sort()
        let fd = try ManifestIndexBuilder.scratch(directory)
        spilled.append(fd)
        let out = FileWriter(fd: fd, offset: 0)
        var record = [UInt8](repeating: 0, count: ManifestIndexBuilder.Payload.encodedSize)
        try keys.withBytes { k throws(ManifestError) in
            for item in items {
                try out.append([UInt8(item.keyLength & 0xFF), UInt8(item.keyLength >> 8)])
                try out.append(UnsafeRawBufferPointer(rebasing: k[item.keyStart..<(item.keyStart + item.keyLength)]))
                record.withUnsafeMutableBytes { r in Self.encode(item.payload, into: r.baseAddress!) }
                try out.append(record)
            }
        }
        try out.flush()
        items.removeAll()
        keys.removeAll()
    }

    static func encode(_ p: ManifestIndexBuilder.Payload, into r: UnsafeMutableRawPointer) {
        r.storeBytes(of: p.size.littleEndian, toByteOffset: 0, as: Int64.self)
        r.storeBytes(of: p.generation.littleEndian, toByteOffset: 8, as: Int64.self)
        r.storeBytes(of: p.seconds.littleEndian, toByteOffset: 16, as: Int64.self)
        r.storeBytes(of: p.nanoseconds.littleEndian, toByteOffset: 24, as: Int32.self)
        r.storeBytes(of: p.crc32c.littleEndian, toByteOffset: 28, as: UInt32.self)
        r.storeBytes(of: p.hasCRC ? UInt8(1) : 0, toByteOffset: 32, as: UInt8.self)
    }

    static func decode(_ r: UnsafeRawPointer) -> ManifestIndexBuilder.Payload {
        .init(size: Int64(littleEndian: r.loadUnaligned(fromByteOffset: 0, as: Int64.self)),
              generation: Int64(littleEndian: r.loadUnaligned(fromByteOffset: 8, as: Int64.self)),
              seconds: Int64(littleEndian: r.loadUnaligned(fromByteOffset: 16, as: Int64.self)),
              nanoseconds: Int32(littleEndian: r.loadUnaligned(fromByteOffset: 24, as: Int32.self)),
              crc32c: UInt32(littleEndian: r.loadUnaligned(fromByteOffset: 28, as: UInt32.self)),
              hasCRC: r.load(fromByteOffset: 32, as: UInt8.self) != 0)
    }

    /// Hands out every key in order: straight from memory when everything fit in one run,
    /// else by merging the runs (the last one spilled too).
    mutating func merge(_ body: (UnsafeRawBufferPointer, ManifestIndexBuilder.Payload) throws(ManifestError) -> Void) throws(ManifestError) {
        defer {
            for fd in spilled { close(fd) }
            spilled = []
        }
        if spilled.isEmpty {
            sort()
            try keys.withBytes { k throws(ManifestError) in
                for item in items {
                    try body(UnsafeRawBufferPointer(rebasing: k[item.keyStart..<(item.keyStart + item.keyLength)]), item.payload)
                }
            }
            items = []
            keys = []
            return
        }
        try spill()
        var readers: [RunReader] = []
        for fd in spilled {
            let r = RunReader(fd: fd)
            if try r.next() { readers.append(r) }
        }
        // A binary heap of readers by their current key.
        var heap = Array(readers.indices)
        func less(_ a: Int, _ b: Int) -> Bool {
            readers[a].key.withUnsafeBytes { ka in readers[b].key.withUnsafeBytes { kb in RunSet.less(ka, kb) } }
        }
        func siftDown(_ start: Int) {
            var i = start
            while true {
                let l = 2 * i + 1, r = l + 1
                var m = i
                if l < heap.count && less(heap[l], heap[m]) { m = l }
                if r < heap.count && less(heap[r], heap[m]) { m = r }
                if m == i { return }
                heap.swapAt(i, m)
                i = m
            }
        }
        for i in stride(from: heap.count / 2 - 1, through: 0, by: -1) { siftDown(i) }
        while let top = heap.first {
            let r = readers[top]
            try r.key.withBytes { k throws(ManifestError) in try body(k, r.payload) }
            if try r.next() {
                siftDown(0)
            } else {
                heap[0] = heap[heap.count - 1]
                heap.removeLast()
                if !heap.isEmpty { siftDown(0) }
            }
        }
    }
}

/// Reads one spilled run back, record by record, through a 1 MiB buffer.
private final class RunReader {
    let fd: Int32
    private var buffer = [UInt8](repeating: 0, count: 1 << 20)
    private var start = 0, end = 0
    private var offset: off_t = 0
    private(set) var key: [UInt8] = []
    private(set) var payload = ManifestIndexBuilder.Payload(size: 0, generation: 0, seconds: 0, nanoseconds: 0, crc32c: 0, hasCRC: false)

    init(fd: Int32) { self.fd = fd }

    /// Makes `need` bytes available at `start`; false at the end of the run.
    private func ensure(_ need: Int) throws(ManifestError) -> Bool {
        if end - start >= need { return true }
        if start > 0 {
            buffer.replaceSubrange(0..<(end - start), with: buffer[start..<end])
            end -= start
            start = 0
        }
        while end < need {
            let n = buffer.withUnsafeMutableBytes { b in pread(fd, b.baseAddress! + end, b.count - end, offset) }
            if n < 0 && errno == EINTR { continue }
            guard n >= 0 else { throw ManifestError("cannot read a scratch file of the index build: \(String(cString: strerror(errno)))") }
            if n == 0 { return false }
            end += n
            offset += off_t(n)
        }
        return true
    }

    func next() throws(ManifestError) -> Bool {
        guard try ensure(2) else { return false }
        let length = Int(UInt16(buffer[start]) | UInt16(buffer[start + 1]) << 8)
        let size = ManifestIndexBuilder.Payload.encodedSize
        guard try ensure(2 + length + size) else {
            throw ManifestError("a scratch file of the index build ends early (the disk is full?)")
        }
        key.removeAll(keepingCapacity: true)
        key.append(contentsOf: buffer[(start + 2)..<(start + 2 + length)])
        payload = buffer.withUnsafeBytes { RunSet.decode($0.baseAddress! + start + 2 + length) }
        start += 2 + length + size
        return true
    }
}

/// Buffered writes to a file at increasing offsets.
final class FileWriter {
    let fd: Int32
    private(set) var offset: off_t
    private var buffer: [UInt8] = []

    init(fd: Int32, offset: off_t) {
        self.fd = fd
        self.offset = offset
        buffer.reserveCapacity(1 << 20)
    }

    func append(_ bytes: UnsafeRawBufferPointer) throws(ManifestError) {
        buffer.append(contentsOf: bytes)
        if buffer.count >= 1 << 20 { try flush() }
    }

    func append(_ bytes: [UInt8]) throws(ManifestError) {
        buffer.append(contentsOf: bytes)
        if buffer.count >= 1 << 20 { try flush() }
    }

    func flush() throws(ManifestError) {
        var done = 0
        while done < buffer.count {
            let n = buffer.withUnsafeBytes { b in pwrite(fd, b.baseAddress! + done, b.count - done, offset) }
            if n < 0 && errno == EINTR { continue }
            guard n > 0 else { throw ManifestError("cannot write the manifest index: \(String(cString: strerror(errno)))") }
            done += n
            offset += off_t(n)
        }
        buffer.removeAll(keepingCapacity: true)
    }
}

// MARK: the tree

/// Turns sorted keys into the index file (steps 3 and 4 of `ManifestIndexBuilder`).
private final class TreeWriter {
    let output: Int32
    let scratch: Int32
    let blob: FileWriter
    let tagged: FileWriter
    private var blobLength: UInt64 = 0
    /// Per directory: parent and child count (directory 0 is the root).
    private var parents: [UInt32] = [0]
    private var counts: [UInt32] = [0]
    /// Open directories, deepest last: number, and how much of `openKey` leads to it.
    private var stack: [(dir: UInt32, depth: Int)] = [(0, 0)]
    private var openKey: [UInt8] = []
    /// The last file seen, held back until the next key shows whether a directory of its
    /// name hides it, or repeats it.
    private var pending: (key: [UInt8], name: Range<Int>, dir: UInt32, payload: ManifestIndexBuilder.Payload)?
    private var record = [UInt8](repeating: 0, count: 4 + ManifestIndexFormat.childSize)
    private(set) var files = 0
    private(set) var children: UInt64 = 0
    private(set) var duplicates = 0
    private(set) var shadowed = 0
    private(set) var shadowedNames: [String] = []

    var directoryCount: Int { parents.count }

    init(output: Int32, scratch: Int32) throws(ManifestError) {
        self.output = output
        self.scratch = scratch
        blob = FileWriter(fd: output, offset: off_t(ManifestIndexFormat.headerSize))
        tagged = FileWriter(fd: scratch, offset: 0)
    }

    deinit { close(scratch) }

    func add(_ key: UnsafeRawBufferPointer, _ payload: ManifestIndexBuilder.Payload) throws(ManifestError) {
        if let p = pending {
            if key.elementsEqual(p.key) {
                // The same name again (an inventory of a versioned bucket, shards that overlap):
                // the newest generation is the object.
                duplicates += 1
                if payload.generation > p.payload.generation { pending!.payload = payload }
                return
            }
            if key.count > p.key.count && key[p.key.count] == 0 && key.starts(with: p.key) {
                shadowed += 1
                if shadowedNames.count < ManifestIndexBuilder.shadowedNamesShown {
                    shadowedNames.append(String(decoding: p.key.map { $0 == 0 ? UInt8(ascii: "/") : $0 }, as: UTF8.self))
                }
            } else {
                try emit(p)
            }
            pending = nil
        }
        while stack.count > 1 && !key.starts(with: openKey[0..<stack[stack.count - 1].depth]) { stack.removeLast() }
        openKey.removeSubrange(stack[stack.count - 1].depth...)
        var i = stack[stack.count - 1].depth
        while let z = key[i...].firstIndex(of: 0) {
            let id = UInt32(parents.count)
            precondition(parents.count < Int(UInt32.max), "over four billion directories")
            let parent = stack[stack.count - 1].dir
            parents.append(parent)
            counts.append(0)
            try emitDirectory(name: UnsafeRawBufferPointer(rebasing: key[i..<z]), id: id, in: parent)
            openKey.append(contentsOf: key[i...z])
            stack.append((id, openKey.count))
            i = z + 1
        }
        if i < key.count {
            let k = Array(key)
            pending = (k, i..<k.count, stack[stack.count - 1].dir, payload)
        }
    }

    private func emitDirectory(name: UnsafeRawBufferPointer, id: UInt32, in dir: UInt32) throws(ManifestError) {
        let child = ManifestIndexFormat.Child(nameOffset: blobLength, nameLength: name.count, flags: ManifestIndexFormat.flagDirectory,
                                              value: UInt64(id), generation: 0, seconds: 0, nanoseconds: 0, crc32c: 0)
        try write(child, name: name, in: dir)
    }

    private func emit(_ file: (key: [UInt8], name: Range<Int>, dir: UInt32, payload: ManifestIndexBuilder.Payload)) throws(ManifestError) {
        try file.key.withBytes { k throws(ManifestError) in
            try emit(name: UnsafeRawBufferPointer(rebasing: k[file.name]), in: file.dir, file.payload)
        }
    }

    private func emit(name: UnsafeRawBufferPointer, in dir: UInt32, _ p: ManifestIndexBuilder.Payload) throws(ManifestError) {
        let child = ManifestIndexFormat.Child(nameOffset: blobLength, nameLength: name.count,
                                              flags: p.hasCRC ? ManifestIndexFormat.flagCRC : 0, value: UInt64(p.size),
                                              generation: UInt64(p.generation), seconds: p.seconds,
                                              nanoseconds: UInt32(bitPattern: p.nanoseconds), crc32c: p.crc32c)
        files += 1
        try write(child, name: name, in: dir)
    }

    private func write(_ child: ManifestIndexFormat.Child, name: UnsafeRawBufferPointer, in dir: UInt32) throws(ManifestError) {
        try blob.append(name)
        blobLength += UInt64(name.count)
        counts[Int(dir)] += 1
        children += 1
        record.withUnsafeMutableBytes { r in
            r.storeBytes(of: dir.littleEndian, toByteOffset: 0, as: UInt32.self)
            child.encode(into: r.baseAddress! + 4)
        }
        try tagged.append(record)
    }

    /// Writes the directory and child tables, the checksums and the header.
    func finish(identity: [UInt8], in place: String) throws(ManifestError) {
        if let p = pending {
            try emit(p)
            pending = nil
        }
        try blob.flush()
        try tagged.flush()
        var header = ManifestIndexFormat.Header(directories: UInt64(parents.count), children: children, files: UInt64(files),
                                                blobLength: blobLength, identity: identity, contentCRC: 0)
        let size = Int(header.fileSize)
        guard ftruncate(output, off_t(size)) == 0 else {
            throw ManifestError("cannot size the manifest index (\(size) bytes): \(String(cString: strerror(errno)))")
        }
        // The header and the tables are written through the map (the blob between them was
        // written already): their pages get their disk first (`MappedFile`).
        let tables = Int(header.directoriesOffset)
        if let why = MappedFile.allocate(output, 0, ManifestIndexFormat.headerSize, zeroFill: true)
            ?? MappedFile.allocate(output, tables, size - tables, zeroFill: true) {
            throw ManifestError("cannot allocate the manifest index (\(size) bytes) in \(place): \(why): free space there or give another cache_dir=")
        }
        guard let map = mmap(nil, size, PROT_READ | PROT_WRITE, MAP_SHARED, output, 0), map != MAP_FAILED else {
            throw ManifestError("cannot map the manifest index: \(String(cString: strerror(errno)))")
        }
        defer { munmap(map, size) }
        // Where each directory's children start; then, as cursors, where the next one goes.
        var next = [UInt64](repeating: 0, count: parents.count)
        var at: UInt64 = 0
        let dirs = map + Int(header.directoriesOffset)
        for d in 0..<parents.count {
            next[d] = at
            ManifestIndexFormat.Directory(firstChild: at, children: counts[d], parent: parents[d])
                .encode(into: dirs + d * ManifestIndexFormat.directorySize)
            at += UInt64(counts[d])
        }
        // Scatter the tagged child records to their directories' ranges (each directory's
        // records arrive in order, so each range fills in order).
        let table = map + Int(header.childrenOffset)
        let entry = 4 + ManifestIndexFormat.childSize
        var buffer = [UInt8](repeating: 0, count: entry * 16_384)
        var offset: off_t = 0
        var remaining = Int(children)
        while remaining > 0 {
            let want = min(remaining, 16_384) * entry
            var got = 0
            while got < want {
                let n = buffer.withUnsafeMutableBytes { b in pread(scratch, b.baseAddress! + got, want - got, offset + off_t(got)) }
                if n < 0 && errno == EINTR { continue }
                guard n > 0 else { throw ManifestError("cannot read back the index build's scratch file: \(String(cString: strerror(errno)))") }
                got += n
            }
            offset += off_t(want)
            buffer.withUnsafeBytes { b in
                for k in 0..<(want / entry) {
                    let e = b.baseAddress! + k * entry
                    let dir = Int(UInt32(littleEndian: e.loadUnaligned(as: UInt32.self)))
                    let slot = next[dir]
                    next[dir] += 1
                    (table + Int(slot) * ManifestIndexFormat.childSize).copyMemory(from: e + 4, byteCount: ManifestIndexFormat.childSize)
                }
            }
            remaining -= want / entry
        }
        let start = ManifestIndexFormat.headerSize
        header.contentCRC = Checksum.crc32c(UnsafeRawBufferPointer(start: map + start, count: size - start))
        let bytes = header.encode()
        bytes.withUnsafeBytes { map.copyMemory(from: $0.baseAddress!, byteCount: bytes.count) }
    }
}
