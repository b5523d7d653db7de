import Locking
import Foundation
import Glibc
import StorageClient
import Synchronization

/// The namespace of a mount from a manifest (`-o manifest=`, docs/manifest.md): names,
/// sizes, generations and times come from the manifest's index, with no list request. The
/// Filesystem asks it first (`Filesystem+Manifest.swift`); with `manifest_refresh=never`
/// (the default) its answers are final: a name it lacks does not exist in the mount, and what
/// it says never expires. With `manifest_refresh=list`, a directory follows the bucket from
/// the first time it is opened (its listing, as in a mount without a manifest); until then
/// the manifest answers lookups of the names it has, and the bucket the rest.
public final class ManifestNamespace: Sendable {
    public enum Refresh: String, Sendable {
        case never
        case list
    }

    let index: ManifestIndex
    /// The mount's root in the index (the prefix's directory); nil when the manifest has
    /// nothing under the prefix.
    let root: UInt32?
    public let refresh: Refresh
    // The three locks below are leaf locks: each guards its own table, and nothing else is
    // taken or called while one is held.
    /// Directory numbers of mount-relative paths looked up lately (a walk from the root is a
    /// binary search per component): bounded, emptied when full.
    private let directoryNumbers = OrderedMutex(.manifestDirectories, [ByteName: UInt32]())
    /// `manifest_refresh=list`: directories opened (now served from their listings).
    private let listed = OrderedMutex(.manifestListed, Set<UInt32>())
    /// Objects whose manifest generation was found gone (each logged once), bounded.
    private let goneLogged = OrderedMutex(.manifestGoneLogged, Set<ByteName>())

    static let directoryNumbersKept = 4096
    static let goneLoggedKept = 65_536
    /// Indexes kept in the cache directory: the newest by use (the one in use is never removed).
    static let indexesKept = 8

    /// What the index holds (logs, tests).
    public var fileCount: Int { Int(index.header.files) }
    public var directoryCount: Int { Int(index.header.directories) }
    /// Bytes of the index file.
    public var indexBytes: Int { Int(index.header.fileSize) }

    init(index: ManifestIndex, prefix: String, refresh: Refresh) {
        self.index = index
        self.refresh = refresh
        let components = prefix.isEmpty ? [] : prefix.slashComponents
        root = (try? index.directory(components, from: 0)) ?? nil
    }

    /// What opening a manifest did, for the mount's log line.
    public struct Opened: Sendable {
        public var namespace: ManifestNamespace
        /// The index was built now (nil: an existing one was used), and what the build found.
        public var built: ManifestIndexBuilder.Stats?
        public var indexPath: String
        public var seconds: Double
    }

    /// Opens the index of `source` for a mount of `bucket`/`prefix`, building it first when
    /// the cache directory has none for this manifest (or a damaged one). Everything that can
    /// be wrong with the manifest is thrown here, before the mount exists.
    public static func open(_ source: ManifestSource, cacheDirectory: String, bucket: String, prefix: String, refresh: Refresh,
                            progress: ((Int64) -> Void)? = nil, runLimit: Int? = nil) throws(ManifestError) -> Opened {
        let started = now()
        let directory: CacheDirectory
        do throws(CacheDirectory.Refused) {
            directory = try CacheDirectory(directory: cacheDirectory, versionName: ManifestIndexFormat.versionName)
        } catch {
            throw ManifestError(error.message)
        }
        directory.removeTemporaryPlainFiles()
        let identity = Self.identity(source, bucket: bucket)
        let name = identity.map { String($0, radix: 16).leftPadded(2) }.joined() + ".idx"
        let shownPath = directory.versionPath + "/" + name
        let damaged: @Sendable () -> Void = {
            Log.error("the manifest index is damaged: reads of its names fail with EIO; it is removed, and the next mount builds it again",
                      ["index": shownPath])
            directory.removePlainFile(name)
        }
        var built: ManifestIndexBuilder.Stats? = nil
        var index = Self.map(directory, name, identity, damaged)
        if index == nil {
            if directory.plainFiles(endingWith: ".idx").contains(where: { $0.name == name }) {
                Log.warn("the manifest index is damaged or of another version: building it again", ["index": shownPath])
            }
            var builder = ManifestIndexBuilder()
            if let runLimit { builder.runLimit = runLimit }
            builder.progress = progress
            built = try builder.build(source, parser: ManifestParser(bucket: bucket), identity: identity, into: directory, as: name)
            index = Self.map(directory, name, identity, damaged)
        }
        guard let index else { throw ManifestError("the manifest index \(shownPath) cannot be read back after it was built") }
        removeOldIndexes(directory, keeping: name)
        MemoryReturn.register { [weak index] _ in index?.releaseIfIdle() ?? false }
        let namespace = ManifestNamespace(index: index, prefix: prefix, refresh: refresh)
        return Opened(namespace: namespace, built: built, indexPath: shownPath, seconds: now() - started)
    }

    /// The index file's name for a manifest: the SHA-256 of the format, the bucket and the
    /// manifest's identity (`ManifestSource.identity`).
    static func identity(_ source: ManifestSource, bucket: String) -> [UInt8] {
        var key = Array("storefs manifest index \(ManifestIndexFormat.version)\u{0}\(bucket)\u{0}".utf8)
        key += source.identity
        return Checksum.sha256(key)
    }

    private static func map(_ directory: CacheDirectory, _ name: String, _ identity: [UInt8],
                            _ damaged: @escaping @Sendable () -> Void) -> ManifestIndex? {
        guard let fd = directory.openPlainFile(name, flags: O_RDONLY) else { return nil }
        defer { close(fd) }
        guard let index = ManifestIndex(fd: fd, identity: identity, onDamage: damaged) else { return nil }
        // Used now: the newest are kept (removeOldIndexes).
        _ = futimens(fd, nil)
        return index
    }

    private static func removeOldIndexes(_ directory: CacheDirectory, keeping name: String) {
        let old = directory.plainFiles(endingWith: ".idx").filter { $0.name != name }.sorted { $0.mtime > $1.mtime }
        for stale in old.dropFirst(indexesKept - 1) { directory.removePlainFile(stale.name) }
    }

    /// The mount-relative path of a file under the mount's root (the first of a depth-first
    /// walk that looks at 10,000 entries at most): the start-up check reads its metadata.
    public func firstFile() -> String? {
        guard let root else { return nil }
        var stack: [(dir: UInt32, path: [String])] = [(root, [])]
        var visited = 0
        while let (dir, path) = stack.popLast() {
            guard let range = try? index.children(of: dir) else { return nil }
            var subdirectories: [(UInt32, [String])] = []
            for i in range {
                visited += 1
                guard visited <= 10_000, let c = try? index.child(i) else { return nil }
                let name = String(decoding: index.name(c), as: UTF8.self)
                if !c.isDirectory { return (path + [name]).joined(separator: "/") }
                subdirectories.append((UInt32(c.value), path + [name]))
            }
            stack += subdirectories.reversed()
        }
        return nil
    }

    // MARK: answers for the Filesystem

    enum Answer {
        case found(Node.Kind)
        /// Not in the manifest: no such name (`never`).
        case absent
        /// The manifest does not answer this: ask the bucket (`list`).
        case bucket
    }

    /// What `name` in directory `parentPath` (mount-relative) is.
    func lookup(parentPath: String, name: String) throws(FilesystemError) -> Answer {
        guard let dir = try directoryNumber(parentPath) else { return refresh == .never ? .absent : .bucket }
        if refresh == .list, listed.withLock({ $0.contains(dir) }) { return .bucket }
        var name = name
        do throws(ManifestIndex.Damaged) {
            guard let c = try name.withUTF8Bytes({ u throws(ManifestIndex.Damaged) in try index.find(u, in: dir) }) else {
                return refresh == .never ? .absent : .bucket
            }
            return .found(Self.kind(c))
        } catch {
            throw Self.damagedError()
        }
    }

    /// The entries of directory `path` to read, for a directory the manifest serves; nil for one
    /// the bucket serves (`list`: it is listed from now on, and the manifest no longer answers
    /// in it).
    func directory(_ path: String) throws(FilesystemError) -> ManifestDirectory? {
        let dir = try directoryNumber(path)
        if refresh == .list {
            if let dir { listed.withLock { _ = $0.insert(dir) } }
            return nil
        }
        guard let dir else { return ManifestDirectory(index: index, range: 0..<0) }
        do throws(ManifestIndex.Damaged) {
            return ManifestDirectory(index: index, range: try index.children(of: dir))
        } catch {
            throw Self.damagedError()
        }
    }

    /// A read found the manifest's generation of `objectName` gone (deleted or overwritten
    /// since the manifest was made): logged once per object.
    func noteGone(_ objectName: String, generation: Int64) {
        let first = goneLogged.withLock { g -> Bool in
            if g.count >= Self.goneLoggedKept { return false }
            return g.insert(ByteName(objectName)).inserted
        }
        guard first else { return }
        Log.warn("the manifest's generation of this object is gone from the bucket (deleted or overwritten since the manifest was made): reads of it fail with ESTALE until the manifest is made again",
                 ["object": objectName, "gen": String(generation)])
    }

    private func directoryNumber(_ path: String) throws(FilesystemError) -> UInt32? {
        guard let root else { return nil }
        if path.isEmpty { return root }
        let key = ByteName(path)
        if let d = directoryNumbers.withLock({ $0[key] }) { return d }
        let found: UInt32?
        do throws(ManifestIndex.Damaged) {
            found = try index.directory(path.slashComponents, from: root)
        } catch {
            throw Self.damagedError()
        }
        if let found {
            directoryNumbers.withLock { m in
                if m.count >= Self.directoryNumbersKept { m.removeAll(keepingCapacity: true) }
                m[key] = found
            }
        }
        return found
    }

    static func damagedError() -> FilesystemError {
        FilesystemError(.storage(.invalidResponse), "the manifest index is damaged (remount to build it again)")
    }

    static func kind(_ c: ManifestIndexFormat.Child) -> Node.Kind {
        if c.isDirectory { return .directory }
        return .file(FileRecord(size: Int64(bitPattern: c.value), generation: Int64(bitPattern: c.generation),
                                modified: Timestamp(seconds: c.seconds, nanoseconds: Int32(bitPattern: c.nanoseconds)),
                                crc32cValue: c.hasCRC ? c.crc32c : nil))
    }
}

/// An open directory of a manifest mount: a range of the index's children, read as readdir
/// asks (nothing is copied at open: a directory of 10,000,000 names costs what is read).
struct ManifestDirectory: Sendable {
    let index: ManifestIndex
    let range: Range<Int>

    var count: Int { range.count }

    /// Up to `limit` entries from position `from`.
    func entries(from: Int, limit: Int) throws(FilesystemError) -> [(String, DirectoryListing.Entry)] {
        guard from < range.count, limit > 0 else { return [] }
        let n = min(limit, range.count - from)
        var out: [(String, DirectoryListing.Entry)] = []
        out.reserveCapacity(n)
        var bytes = 0
        do throws(ManifestIndex.Damaged) {
            for i in (range.lowerBound + from)..<(range.lowerBound + from + n) {
                let c = try index.child(i)
                bytes += ManifestIndexFormat.childSize + c.nameLength
                out.append((String(decoding: index.name(c), as: UTF8.self), ManifestNamespace.kind(c).entry))
            }
        } catch {
            throw ManifestNamespace.damagedError()
        }
        index.noteTouched(bytes + 128 << 10)
        return out
    }

    /// The entry at position `i` (nil past the end, or where the index is damaged).
    func entry(at i: Int) -> (String, DirectoryListing.Entry)? {
        guard i >= 0, i < range.count, let c = try? index.child(range.lowerBound + i) else { return nil }
        index.noteTouched(4096)
        return (String(decoding: index.name(c), as: UTF8.self), ManifestNamespace.kind(c).entry)
    }
}

private extension String {
    func leftPadded(_ n: Int) -> String { String(repeating: "0", count: max(0, n - count)) + self }
}
