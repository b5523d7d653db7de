import Glibc
import Locking
import Synchronization
import StorageClient

/// Files: open (pinning a generation), read through the block reader, release.
extension Filesystem {
    public struct OpenResult: Sendable {
        public var handle: UInt64
        /// The kernel may keep its page cache: the generation is the one it cached last time.
        public var keepCache: Bool
    }

    /// Opens a file for reading; any write intent is EROFS. The generation is pinned here.
    public func open(_ inode: UInt64, flags: Int32, network: Network = .allowed) throws(FilesystemError) -> OpenResult {
        if flags & O_ACCMODE != O_RDONLY || flags & O_TRUNC != 0 || flags & O_CREAT != 0 {
            throw FilesystemError(.readOnly, "storefs is read-only")
        }
        _ = try attributes(of: inode, network: network)  // refreshes stale metadata
        // One look at the inode table: the node, whether it is current, and (for a file that
        // opens) the generation the kernel cached last.
        let (looked, current, keep) = table.withLock { t -> (Node?, Bool, Bool) in
            guard let node = t.nodes[inode] else { return (nil, false, false) }
            let current = t.isCurrent(inode)
            guard case .file(let record) = node.kind, !isSymlink(record), current else { return (node, current, false) }
            // The kernel drops an inode's pages at an open that does not keep them, waiting for
            // every page other readers are reading in: the first open (no pages yet, or none
            // since the kernel forgot the inode) keeps them too (docs/architecture.md,
            // "Overwrites").
            let previous = t.lastOpenedGeneration.updateValue(record.generation, forKey: inode)
            return (node, true, previous == nil || previous == record.generation)
        }
        guard let node = looked else { throw FilesystemError(.staleHandle, "unknown inode \(inode)") }
        guard case .file(let record) = node.kind else { throw FilesystemError(.isDirectory, "\(node.path) is a directory") }
        if isSymlink(record) { throw FilesystemError(.isSymlink, "\(node.path) is a symbolic link") }
        // An inode whose object was replaced or deleted opens nothing: ESTALE makes the kernel
        // look the name up again (LOOKUP_REVAL) and open what the bucket holds now, within
        // this same open(2) (README, "Namespace semantics": overwrites).
        guard current else {
            throw FilesystemError(.storage(.generationChanged), "\(node.path): the object was replaced or deleted")
        }
        let meta = record.objectMetadata(name: objectName(of: node.path), bucket: reference.bucket)
        let stream = reader.openStream(meta)
        stored?.recordFile(node.path, record)
        let handle = handles.add(.file(OpenFile(path: node.path, meta: meta, stream: stream)))
        // Pages of an object that once served wrong bytes are not kept (docs/integrity.md).
        return OpenResult(handle: handle, keepCache: keep && !stream.everServedWrong)
    }

    func openFile(_ handle: UInt64) throws(FilesystemError) -> OpenFile {
        guard case .file(let file)? = handles[handle] else {
            throw FilesystemError(.staleHandle, "unknown file handle \(handle)")
        }
        return file
    }

    /// The part of `buffer` that the object has bytes for at `offset`; nil at or past the end.
    func clamp(_ meta: ObjectMetadata, _ offset: Int64, _ buffer: UnsafeMutableRawBufferPointer) throws(FilesystemError) -> UnsafeMutableRawBufferPointer? {
        guard offset >= 0 else { throw FilesystemError(.invalidArgument, "negative offset") }
        guard offset < meta.size, buffer.count > 0 else { return nil }
        let count = Int(min(Int64(buffer.count), meta.size - offset))
        return UnsafeMutableRawBufferPointer(rebasing: buffer[0..<count])
    }

    /// Reads up to `buffer.count` bytes at `offset` of an open file: the read path's one entry
    /// point (`BlockReader.read`). With `Network.never` (a FUSE thread) only what is here
    /// serves it, and a miss answers `.miss` at once; with `.allowed` (a thread that may wait)
    /// missing bytes are downloaded and the answer is always `.reply`. A reply at or past the
    /// end of the file holds no bytes. The caller replies with its bytes, then finishes it.
    public func read(_ handle: UInt64, at offset: Int64, into buffer: UnsafeMutableRawBufferPointer,
                     network: Network) throws(FilesystemError) -> ReadAnswer {
        let file = try openFile(handle)
        let meta = file.meta
        guard let window = try clamp(meta, offset, buffer) else { return .reply(.empty) }
        do throws(StorageError) {
            let answer = try reader.read(file.stream, at: offset, into: window, network: network)
            // Counted before the caller replies: whoever reads the stats after its read returned
            // finds it counted.
            if case .never = network {
                if answer.isReply { Metrics.shared.cacheRead(hit: true, bytes: window.count) }
            } else {
                Metrics.shared.cacheRead(hit: false, bytes: window.count)
            }
            return answer
        } catch {
            if error.code == .generationChanged || error.code == .notFound {
                // The object was replaced or deleted: this handle keeps failing (it never mixes
                // generations), but the next open and stat must see what the bucket holds now.
                // (forgetPath expires its inode: the next open refreshes it, finds it
                // replaced or gone, and answers ESTALE or ENOENT.)
                forgetPath(file.path)
            }
            if error.code == .cancelled {
                Log.debug("op=read object=\(meta.name) offset=\(offset) interrupted")
            } else if let manifest, error.code == .generationChanged || error.code == .notFound {
                manifest.noteGone(meta.name, generation: meta.generation)  // once per object
            } else {
                Log.warn("read failed", ["op": "read", "object": meta.name, "gen": String(meta.generation),
                                         "offset": String(offset), "error": error.message])
            }
            throw FilesystemError(error)
        }
    }

    /// The target of a symbolic link (gcsfuse's two forms, `FileRecord.SymlinkStyle`): from
    /// the object's custom metadata, or its bytes (at most 4096: PATH_MAX).
    public func readLink(_ inode: UInt64, network: Network = .allowed) throws(FilesystemError) -> String {
        _ = try attributes(of: inode, network: network)
        guard let node = table.withLock({ $0.nodes[inode] }) else { throw FilesystemError(.staleHandle, "unknown inode \(inode)") }
        guard case .file(let record) = node.kind, isSymlink(record) else {
            throw FilesystemError(.invalidArgument, "\(node.path) is not a symbolic link")
        }
        switch record.symlink {
        case .targetInMetadata?:
            guard let target = try fullObject(node.path, record, network: network).custom[FileRecord.legacySymlinkKey] else {
                throw FilesystemError(.storage(.generationChanged), "\(node.path): no longer a symbolic link")
            }
            return target
        default:
            guard record.size <= 4096 else {
                throw FilesystemError(.storage(.invalidResponse), "\(node.path): symbolic link target longer than 4096 bytes")
            }
            guard case .allowed(let isCancelled) = network else {
                throw FilesystemError(.wouldBlock, "target of \(node.path) needs the bucket")
            }
            var bytes = [UInt8](repeating: 0, count: Int(record.size))
            let name = objectName(of: node.path)
            let result = bytes.withUnsafeMutableBytes { b in
                Result { () throws(StorageError) in
                    if b.count > 0 { try store.read(name, generation: record.generation, offset: 0, into: b, isCancelled: isCancelled) }
                }
            }
            if case .failure(let error) = result { throw FilesystemError(error) }
            return String(decoding: bytes, as: UTF8.self)
        }
    }

    public func release(_ handle: UInt64) {
        let closed = handles.remove(handle)
        switch closed {
        case .file(let file)?: reader.closeStream(file.stream)
        case .directory(let path, _, _)?: listings.withLock { $0.unpin(ByteName(path)) }
        case nil: break
        }
    }
}

struct OpenFile {
    /// The mount-relative path it was opened at (to forget it if its object is replaced).
    var path: String
    var meta: ObjectMetadata
    var stream: BlockReader.Stream
}

/// Open files and directories by handle number, in `stripeCount` tables each under its own
/// lock, chosen by the number: every read looks its handle up, and with 16 readers at once one
/// table's lock was the daemon's most contended (docs/architecture.md, "Locks"). Numbers come
/// from one counter, so consecutive opens land in different stripes. A thread holds at most
/// one stripe's lock, and nothing else under it.
final class Handles: Sendable {
    enum Open {
        case file(OpenFile)
        case directory(path: String, inode: UInt64, source: DirectorySource)
    }

    static let stripeCount = 16
    private let next = Atomic<UInt64>(1)
    private final class Stripe: Sendable {
        let open = OrderedMutex(.handles, [UInt64: Open]())
    }
    private let stripes = (0..<Handles.stripeCount).map { _ in Stripe() }

    static func stripe(of handle: UInt64) -> Int { Int(handle % UInt64(stripeCount)) }

    /// Adds `o` under a new handle number, never 0 and never reused.
    func add(_ o: Open) -> UInt64 {
        let h = next.add(1, ordering: .relaxed).oldValue
        stripes[Self.stripe(of: h)].open.withLock { $0[h] = o }
        return h
    }

    subscript(handle: UInt64) -> Open? {
        stripes[Self.stripe(of: handle)].open.withLock { $0[handle] }
    }

    func remove(_ handle: UInt64) -> Open? {
        stripes[Self.stripe(of: handle)].open.withLock { $0.removeValue(forKey: handle) }
    }

    /// Handles open now (tests).
    var count: Int { stripes.reduce(0) { n, s in n + s.open.withLock { $0.count } } }
}
