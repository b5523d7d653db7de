import Foundation
import Glibc
import StorageClient
import Synchronization

/// The storefs namespace and read path, with no FUSE and no HTTP in sight.
///
/// The FUSE adapter calls these methods with inode and handle numbers and turns the answers
/// (or `FilesystemError`s, through `Errno`) into replies. Paths here are relative to the mount
/// root; `objectName(of:)` adds the mounted prefix. State lives in one `Mutex` per structure:
/// the inode table, the listing cache, the negative cache, and the open handles.
///
/// Metadata flow: `readdir` lists a directory once (all pages) and caches it for `list_ttl`;
/// `lookup` answers from that listing when it is fresh, and otherwise probes the name
/// directly (one list call to see whether it is a directory — directories win — then one
/// metadata GET). Missing names are remembered for `negative_ttl`.
public final class Filesystem: Sendable {
    public struct Config: Sendable {
        public var statTTL: Double
        public var listTTL: Double
        public var negativeTTL: Double
        public var uid: UInt32
        public var gid: UInt32
        public var fileMode: UInt32
        public var dirMode: UInt32
        public var downloadURL: DownloadURL
        /// Metadata GETs in flight at once when a listing lacks sizes (Firebase v0).
        public var metadataParallelism: Int
        /// Sub-directories listed ahead when a directory is opened (0: none).
        public var listingPrefetch: Int

        public init(statTTL: Double = 60, listTTL: Double = 60, negativeTTL: Double = 5, uid: UInt32 = getuid(),
                    gid: UInt32 = getgid(), fileMode: UInt32 = 0o444, dirMode: UInt32 = 0o555,
                    downloadURL: DownloadURL = DownloadURL(ownerUID: getuid()), metadataParallelism: Int = 16,
                    listingPrefetch: Int = 0) {
            self.downloadURL = downloadURL
            self.listingPrefetch = listingPrefetch
            self.metadataParallelism = metadataParallelism
            self.statTTL = statTTL
            self.listTTL = listTTL
            self.negativeTTL = negativeTTL
            self.uid = uid
            self.gid = gid
            self.fileMode = fileMode
            self.dirMode = dirMode
        }
    }

    public static let rootInode: UInt64 = 1
    /// Bound on cached directory listings; the oldest go first past it.
    static let maxCachedListings = 4096
    /// Entries one directory listing may have (docs/security.md): past it the listing is EIO.
    static let maxListingEntries = 5_000_000

    public let config: Config
    public let reference: StorageReference
    let store: ObjectStore
    let reader: BlockReader
    /// Shared with the read path: an outage found by either is known to both.
    var health: BucketHealth { reader.health }
    private let mountTime: Timestamp

    private let table = Mutex(InodeTable())
    // Tables keyed by paths use ByteName: names are compared as bytes, never as Unicode.
    private let listings = Mutex([ByteName: CachedListing]())
    private let negatives = Mutex([ByteName: Double]())
    private let handles = Mutex(Handles())
    private let shadowLogged = Mutex(Set<ByteName>())
    private let listingFlights = Mutex([ByteName: ListingFlight]())
    private let listingPoolSlot = Mutex<WorkerPool?>(nil)
    private let probePoolSlot = Mutex<WorkerPool?>(nil)

    /// `reader` defaults to one with no disk cache (tests); the daemon passes one with its cache.
    public init(store: ObjectStore, reference: StorageReference, config: Config, reader: BlockReader? = nil) {
        self.store = store
        self.reference = reference
        self.config = config
        self.reader = reader ?? BlockReader(store: store, cache: nil, endpoint: "", config: .init())
        var now = timespec()
        clock_gettime(CLOCK_REALTIME, &now)
        mountTime = Timestamp(seconds: Int64(now.tv_sec), nanoseconds: Int32(now.tv_nsec))
    }

    /// Called once the kernel is gone (unmount, signal): lets background work land on disk.
    public func finishPendingWork(timeout: Double = 10) {
        reader.finishPendingWork(timeout: timeout)
    }

    // MARK: Names

    /// The object name (or listing prefix, without its trailing `/`) of a mount-relative path.
    public func objectName(of path: String) -> String {
        if reference.prefix.isEmpty { return path }
        return path.isEmpty ? reference.prefix : reference.prefix + "/" + path
    }

    private func listingPrefix(of dirPath: String) -> String {
        let name = objectName(of: dirPath)
        return name.isEmpty ? "" : name + "/"
    }

    private static func join(_ dir: String, _ name: String) -> String { dir.isEmpty ? name : dir + "/" + name }

    // MARK: Lookup and attributes

    /// Resolves `name` in directory `parent` and counts one kernel reference to the result.
    public func lookup(parent: UInt64, name: String, network: Network = .allowed) throws(FilesystemError) -> FileAttributes {
        let parentPath = try directoryPath(parent)
        guard DirectoryListing.isRepresentable(name), !name.containsSlash else {
            if name.utf8.count > 255 { throw FilesystemError(.nameTooLong, "name longer than 255 bytes") }
            throw FilesystemError(.noEntry, "name cannot be a path component")
        }
        let path = Self.join(parentPath, name)
        do throws(FilesystemError) {
            let entry = try resolve(path: path, parentPath: parentPath, name: name, network: network)
            return register(path: path, entry: entry, countLookup: true)
        } catch {
            if error.code == .wouldBlock { throw error }
            // The bucket is unreachable or failing: a path we already know keeps working from
            // what we know (its cached blocks stay readable). Missing and denied stay errors.
            guard case .storage(let code) = error.code, Self.isOutage(code),
                  let known = table.withLock({ t -> (UInt64, Node)? in
                      guard let ino = t.byPath[ByteName(path)], var node = t.nodes[ino] else { return nil }
                      node.lookups += 1
                      t.nodes[ino] = node
                      return (ino, node)
                  }) else { throw error }
            Log.info("op=lookup path=\(path) serving known attributes while the bucket is unreachable")
            return attributes(known.0, known.1)
        }
    }

    /// Drops `count` kernel references; an inode nobody references is forgotten.
    public func forget(_ inode: UInt64, count: UInt64) {
        table.withLock { $0.forget(inode, count: count) }
    }

    /// The attributes of an inode, refreshed from the bucket once older than `stat_ttl`. A
    /// refresh that finds a new generation does not change this inode (it keeps describing
    /// the generation its handles read): the path is let go, and the next lookup makes a new one.
    public func attributes(of inode: UInt64, network: Network = .allowed) throws(FilesystemError) -> FileAttributes {
        guard let node = table.withLock({ $0.nodes[inode] }) else {
            throw FilesystemError(.staleHandle, "unknown inode \(inode)")
        }
        guard case .file(let meta, let fetched) = node.kind, now() - fetched >= config.statTTL else {
            return attributes(inode, node)
        }
        // Stale: refresh from the parent listing if it is fresh, else from the object itself.
        let components = node.path.slashComponents
        let parentPath = components.dropLast().joined(separator: "/")
        let name = components.last ?? ""
        do throws(FilesystemError) {
            let entry = try resolve(path: node.path, parentPath: parentPath, name: name, network: network)
            guard case .file(let fresh) = entry else { throw FilesystemError(.noEntry, "\(node.path) is now a directory") }
            let updated = table.withLock { $0.refresh(inode, meta: fresh, at: now()) }
            return attributes(inode, updated ?? node)
        } catch {
            if error.code == .wouldBlock { throw error }
            if case .storage(let code) = error.code, code != .notFound {
                Log.debug("op=getattr ino=\(inode) serving cached attributes: \(error.message)")
                return attributes(inode, Node(path: node.path, kind: .file(meta, fetched), lookups: node.lookups))
            }
            throw error
        }
    }

    private func attributes(_ inode: UInt64, _ node: Node) -> FileAttributes {
        switch node.kind {
        case .directory:
            return FileAttributes(inode: inode, kind: .directory, size: 4096, mode: config.dirMode, uid: config.uid,
                                  gid: config.gid, modified: mountTime, linkCount: 2)
        case .file(let meta, _):
            return FileAttributes(inode: inode, kind: .file, size: meta.size, mode: config.fileMode, uid: config.uid,
                                  gid: config.gid, modified: meta.modificationTime, linkCount: 1)
        }
    }

    private func directoryPath(_ inode: UInt64) throws(FilesystemError) -> String {
        guard let node = table.withLock({ $0.nodes[inode] }) else {
            throw FilesystemError(.staleHandle, "unknown inode \(inode)")
        }
        guard case .directory = node.kind else { throw FilesystemError(.notDirectory, "\(node.path) is a file") }
        return node.path
    }

    private func resolve(path: String, parentPath: String, name: String, network: Network) throws(FilesystemError) -> DirectoryListing.Entry {
        if let listing = freshListing(parentPath) {
            guard let entry = listing[name: name] else { throw FilesystemError(.noEntry, "no \(path)") }
            return entry
        }
        if let until = negatives.withLock({ $0[ByteName(path)] }), until > now() {
            throw FilesystemError(.noEntry, "no \(path) (cached)")
        }
        // The bucket is known not to answer: what we know answers at once (BucketHealth).
        if let outage = health.outage {
            if let known = knownEntry(path) ?? staleListing(parentPath)?[name: name] { return known }
            if staleListing(parentPath) != nil { throw FilesystemError(.noEntry, "no \(path) (as last listed)") }
            throw FilesystemError(outage)
        }
        guard case .allowed(let isCancelled) = network else { throw FilesystemError(.wouldBlock, "lookup of \(path) needs the bucket") }
        let objectName = objectName(of: path)
        do throws(StorageError) {
            let entry = try probe(objectName, isCancelled: isCancelled)
            health.noteSuccess()
            return entry
        } catch {
            health.note(error)
            if error.code == .notFound {
                health.noteSuccess()
                if config.negativeTTL > 0 { rememberMissing(path) }
                throw FilesystemError(.noEntry, "no \(path)")
            }
            // Unreachable or failing: what the last listing of the parent said still holds,
            // so cached files stay reachable offline even after the kernel forgot them.
            if Self.isOutage(error.code), let old = staleListing(parentPath) {
                Log.info("op=lookup path=\(path) answering from an expired listing: \(error.message)")
                guard let entry = old[name: name] else { throw FilesystemError(.noEntry, "no \(path)") }
                return entry
            }
            Log.warn("op=lookup path=\(path) error=\(error.message)")
            throw FilesystemError(error)
        }
    }

    /// Is `objectName` a directory (a prefix with anything under it) or an object? Both are
    /// asked at once (one round trip of waiting, not two); a directory wins over a same-named
    /// object, as in listings.
    private func probe(_ objectName: String, isCancelled: (@Sendable () -> Bool)?) throws(StorageError) -> DirectoryListing.Entry {
        let object = ProbeResult()
        // The metadata GET may outlive this call (when it is interrupted); the caller's
        // isCancelled reads a FUSE request that is freed once the caller replies, so the GET
        // asks it only while this call is on, under a lock this call takes to leave.
        let caller = CallerCancellation(isCancelled)
        defer { caller.leave() }
        probePool.submit { [store] in
            do throws(StorageError) {
                object.finish(.success(try store.metadata(of: objectName, isCancelled: caller.check)))
            } catch {
                object.finish(.failure(error))
            }
        }
        let isDirectory = Result { () throws(StorageError) in try store.hasChildren(prefix: objectName + "/", isCancelled: isCancelled) }
        // Both answers are awaited (they ran side by side: the wait is one round trip), so no
        // request of this lookup outlives it.
        guard let result = object.wait(isCancelled: isCancelled) else {
            throw StorageError(.cancelled, "lookup of \(objectName) interrupted")
        }
        if try isDirectory.get() { return .directory }
        return .file(try result.get())
    }

    private var probePool: WorkerPool {
        probePoolSlot.withLock { p in
            if p == nil { p = WorkerPool(threads: 16, name: "storefs-probe") }
            return p!
        }
    }

    /// Bound on remembered missing names: a flood of lookups of names that do not exist (any
    /// local user can make one) prunes the expired ones, then starts afresh.
    static let maxNegatives = 16_384

    /// Missing names remembered now (tests).
    var rememberedMissingCount: Int { negatives.withLock { $0.count } }

    private func rememberMissing(_ path: String) {
        let t = now()
        negatives.withLock { n in
            if n.count >= Self.maxNegatives {
                n = n.filter { $0.value > t }
                if n.count >= Self.maxNegatives { n.removeAll() }
            }
            n[ByteName(path)] = t + config.negativeTTL
        }
    }

    /// What the inode table says `path` is (the kernel, or an open file, still knows it).
    private func knownEntry(_ path: String) -> DirectoryListing.Entry? {
        table.withLock { t in
            guard let ino = t.byPath[ByteName(path)], let node = t.nodes[ino] else { return nil }
            switch node.kind {
            case .directory: return .directory
            case .file(let meta, _): return .file(meta)
            }
        }
    }

    private func register(path: String, entry: DirectoryListing.Entry, countLookup: Bool) -> FileAttributes {
        let t = now()
        let (inode, node) = table.withLock { $0.upsert(path: path, entry: entry, at: t, countLookup: countLookup) }
        return attributes(inode, node)
    }

    // MARK: Directories

    /// Lists a directory (from cache when fresh) and pins its snapshot for readdir offsets. The
    /// snapshot is shared with the listing cache and other handles: a handle costs a
    /// reference, not a copy of the directory (a local user may open many).
    public func openDirectory(_ inode: UInt64, network: Network = .allowed) throws(FilesystemError) -> UInt64 {
        let path = try directoryPath(inode)
        let snapshot = try fullListing(path, network: network)
        prefetchListings(under: path, snapshot.listing)
        return handles.withLock { $0.add(.directory(path: path, inode: inode, snapshot: snapshot)) }
    }

    /// At most `limit` entries of an open directory from `offset` on (offsets are positions in
    /// the snapshot, `.` and `..` first). Work is proportional to the entries returned.
    public func readDirectory(_ handle: UInt64, from offset: Int, limit: Int = Int.max) throws(FilesystemError) -> [DirectoryEntry] {
        let (path, inode, snapshot) = try directorySnapshot(handle)
        let start = max(0, offset)
        guard start < snapshot.names.count + 2 else { return [] }
        let end = start + min(snapshot.names.count + 2 - start, max(0, limit))
        guard start < end else { return [] }
        var out: [DirectoryEntry] = []
        out.reserveCapacity(end - start)
        var paths: [ByteName] = []
        for i in start..<end where i >= 2 { paths.append(ByteName(Self.join(path, snapshot.names[i - 2]))) }
        let parentPath = ByteName(path.slashComponents.dropLast().joined(separator: "/"))
        let (known, parent) = table.withLock { t in (paths.map { t.byPath[$0] }, path.isEmpty ? inode : t.byPath[parentPath]) }
        for i in start..<end {
            if i < 2 {
                // `..` is the parent (the root's own parent is itself), as a directory's
                // `..` should be for tools that compare inode numbers.
                out.append(DirectoryEntry(name: i == 0 ? "." : "..", inode: i == 0 ? inode : parent ?? inode, kind: .directory,
                                          nextOffset: i + 1))
                continue
            }
            let name = snapshot.names[i - 2]
            let entry = snapshot.listing[name: name] ?? .directory
            let kind: FileAttributes.Kind = entry == .directory ? .directory : .file
            let k = i - max(2, start)
            out.append(DirectoryEntry(name: name, inode: known[k] ?? Self.inodeNumber(paths[k].string, entry), kind: kind,
                                      nextOffset: i + 1))
        }
        return out
    }

    /// readdirplus: the attributes of entry `offset` of an open directory, counted as a lookup
    /// (the kernel then needs no LOOKUP per name: `ls -l` costs the one listing). nil for `.`/`..`.
    public func lookupListed(_ handle: UInt64, at offset: Int) throws(FilesystemError) -> FileAttributes? {
        let (path, _, snapshot) = try directorySnapshot(handle)
        guard offset >= 2, offset - 2 < snapshot.names.count else { return nil }
        let name = snapshot.names[offset - 2]
        guard let entry = snapshot.listing[name: name] else { return nil }
        return register(path: Self.join(path, name), entry: entry, countLookup: true)
    }

    private func directorySnapshot(_ handle: UInt64) throws(FilesystemError) -> (String, UInt64, ListingSnapshot) {
        guard case .directory(let path, let inode, let snapshot)? = handles.withLock({ $0.open[handle] }) else {
            throw FilesystemError(.staleHandle, "unknown directory handle \(handle)")
        }
        return (path, inode, snapshot)
    }

    public func release(_ handle: UInt64) {
        let closed = handles.withLock { $0.open.removeValue(forKey: handle) }
        if case .file(let file)? = closed { reader.closeStream(file.stream) }
    }

    /// The inode number of a path's entry: a hash of its bytes and, for a file, its generation
    /// (a new generation is a new inode). readdir reports it for names not looked up yet and
    /// a lookup then gives the same number, so `d_ino` equals `st_ino` (`find -inum`, `du`,
    /// rsync). The top bit keeps it clear of the root (1); a collision takes the next free
    /// number (`InodeTable.upsert`).
    static func inodeNumber(_ path: String, _ entry: DirectoryListing.Entry) -> UInt64 {
        var h: UInt64 = 0xcbf2_9ce4_8422_2325
        for b in path.utf8 { h = (h ^ UInt64(b)) &* 0x100_0000_01b3 }
        if case .file(let meta) = entry {
            h ^= UInt64(bitPattern: meta.generation)
            h = h &* 0x100_0000_01b3
        }
        return h | (1 << 63)
    }

    /// The bucket cannot answer right now (as opposed to answering "no").
    static func isOutage(_ code: StorageError.Code) -> Bool {
        code == .unreachable || code == .retryLimitExceeded
    }

    /// The last listing of a directory, however old (for outages).
    private func staleListing(_ dirPath: String) -> DirectoryListing? {
        listings.withLock { $0[ByteName(dirPath)]?.snapshot.listing }
    }

    private func freshSnapshot(_ dirPath: String) -> ListingSnapshot? {
        listings.withLock { l in
            guard let c = l[ByteName(dirPath)], c.expires > now() else { return nil }
            return c.snapshot
        }
    }

    private func freshListing(_ dirPath: String) -> DirectoryListing? { freshSnapshot(dirPath)?.listing }

    /// The whole listing of a directory: every page, prefixes de-duplicated, cached for list_ttl.
    func fullListing(_ dirPath: String, network: Network = .allowed) throws(FilesystemError) -> ListingSnapshot {
        if let l = freshSnapshot(dirPath) { return l }
        if let outage = health.outage {
            guard let old = listings.withLock({ $0[ByteName(dirPath)]?.snapshot }) else { throw FilesystemError(outage) }
            return old
        }
        guard case .allowed(let isCancelled) = network else { throw FilesystemError(.wouldBlock, "listing \(dirPath) needs the bucket") }
        // One listing of a directory at a time: later askers wait for the one under way.
        let (flight, mine) = listingFlights.withLock { f -> (ListingFlight, Bool) in
            if let running = f[ByteName(dirPath)] { return (running, false) }
            let created = ListingFlight()
            f[ByteName(dirPath)] = created
            return (created, true)
        }
        if !mine {
            guard let shared = flight.wait(isCancelled: isCancelled) else {
                throw FilesystemError(.storage(.cancelled), "listing of \(dirPath) interrupted")
            }
            return try shared.get()
        }
        let result: Result<ListingSnapshot, FilesystemError>
        do throws(FilesystemError) { result = .success(try fetchListing(dirPath, isCancelled: isCancelled)) } catch { result = .failure(error) }
        listingFlights.withLock { _ = $0.removeValue(forKey: ByteName(dirPath)) }
        flight.finish(result)
        return try result.get()
    }

    /// After a directory is opened, its sub-directories are listed ahead on a few threads of
    /// their own, so `find` and `ls -R` find the next listing ready (one level ahead of the
    /// walker, at most `listingPrefetch` directories, only where listings carry metadata).
    private func prefetchListings(under dirPath: String, _ listing: DirectoryListing) {
        guard config.listingPrefetch > 0, config.listTTL > 0 else { return }
        var queued = 0
        for name in listing.sortedNames where listing[name: name] == .directory {
            if queued == config.listingPrefetch { break }
            let child = Self.join(dirPath, name)
            if freshListing(child) != nil || listingFlights.withLock({ $0[ByteName(child)] != nil }) { continue }
            queued += 1
            listingPool.submit { [self] in _ = try? self.fullListing(child, network: .allowed) }
        }
    }

    private var listingPool: WorkerPool {
        listingPoolSlot.withLock { p in
            if p == nil { p = WorkerPool(threads: 4, name: "storefs-list") }
            return p!
        }
    }

    /// All pages of a directory. `isCancelled` is the caller's: an interrupted `ls` ends the
    /// listing (others waiting on it then get the interruption too and ask again).
    private func fetchListing(_ dirPath: String, isCancelled: (@Sendable () -> Bool)?) throws(FilesystemError) -> ListingSnapshot {
        let prefix = listingPrefix(of: dirPath)
        var pages: [ListPage] = []
        var token: String? = nil
        var seenTokens = Set<String>()
        var entries = 0
        do throws(StorageError) {
            repeat {
                let page = try store.list(prefix: prefix, pageToken: token, isCancelled: isCancelled)
                pages.append(page)
                entries += page.items.count + page.prefixes.count
                token = page.nextPageToken
                // A hostile or broken server must not hold `ls` forever, nor fill memory.
                if let t = token, !seenTokens.insert(t).inserted {
                    throw StorageError(.invalidResponse, "list gs://\(reference.bucket)/\(prefix): the server repeated a page token (the listing loops)")
                }
                if entries > Self.maxListingEntries {
                    throw StorageError(.invalidResponse, "list gs://\(reference.bucket)/\(prefix): more than \(Self.maxListingEntries) entries in one directory")
                }
            } while token != nil
            health.noteSuccess()
        } catch {
            health.note(error)
            if Self.isOutage(error.code), let old = listings.withLock({ $0[ByteName(dirPath)]?.snapshot }) {
                Log.info("op=readdir prefix=\(prefix) answering from an expired listing: \(error.message)")
                return old
            }
            Log.warn("op=readdir prefix=\(prefix) error=\(error.message)")
            throw FilesystemError(error)
        }
        if pages.contains(where: { !$0.metadataComplete }) { pages = try completeMetadata(pages) }
        let listing = DirectoryListing(prefix: prefix, pages: pages)
        let snapshot = ListingSnapshot(listing)
        for name in listing.shadowedFiles {
            let full = Self.join(dirPath, name)
            if shadowLogged.withLock({ $0.insert(ByteName(full)).inserted }) {
                Log.info("object \(objectName(of: full)) is hidden by the directory of the same name")
            }
        }
        if config.listTTL > 0 {
            let expires = now() + config.listTTL
            listings.withLock { l in
                if l.count >= Self.maxCachedListings {
                    let t = now()
                    l = l.filter { $0.value.expires > t }
                    if l.count >= Self.maxCachedListings { l.removeAll() }
                }
                l[ByteName(dirPath)] = CachedListing(snapshot: snapshot, expires: expires)
            }
        }
        return snapshot
    }

    /// Fills in sizes and times of name-only list items (Firebase v0) with metadata GETs, a
    /// bounded number at a time. Items gone meanwhile are dropped.
    private func completeMetadata(_ pages: [ListPage]) throws(FilesystemError) -> [ListPage] {
        let names = pages.flatMap { $0.items.map(\.name) }.filter {
            DirectoryListing.isRepresentable($0.slashComponents.last ?? "")
        }
        let results = ParallelMap.run(names, width: config.metadataParallelism) { name -> Result<ObjectMetadata, StorageError> in
            do throws(StorageError) { return .success(try self.store.metadata(of: name)) } catch { return .failure(error) }
        }
        var complete: [ObjectMetadata] = []
        for (name, result) in zip(names, results) {
            switch result {
            case .success(let m): complete.append(m)
            case .failure(let e) where e.code == .notFound: Log.debug("op=readdir object=\(name) vanished while listing")
            case .failure(let e):
                Log.warn("op=readdir object=\(name) error=\(e.message)")
                throw FilesystemError(e)
            }
        }
        var merged = pages.map { ListPage(items: [], prefixes: $0.prefixes, nextPageToken: $0.nextPageToken) }
        if merged.isEmpty { return [] }
        merged[0].items = complete
        return merged
    }

    // MARK: Files

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
        guard let node = table.withLock({ $0.nodes[inode] }) else {
            throw FilesystemError(.staleHandle, "unknown inode \(inode)")
        }
        guard case .file(let meta, _) = node.kind else { throw FilesystemError(.isDirectory, "\(node.path) is a directory") }
        let keep = table.withLock { t in
            let previous = t.lastOpenedGeneration[inode]
            t.lastOpenedGeneration[inode] = meta.generation
            return previous == meta.generation
        }
        let stream = reader.openStream(meta)
        let handle = handles.withLock { $0.add(.file(OpenFile(meta: meta, stream: stream))) }
        // Pages of an object that once served wrong bytes are not kept (docs/integrity.md).
        return OpenResult(handle: handle, keepCache: keep && !stream.everServedWrong)
    }

    /// Serves a read only if every byte is in the block cache (no network): for the FUSE thread.
    /// nil means "call `read` from a worker"; `read` then knows the read was already noted.
    public func readCached(_ handle: UInt64, at offset: Int64, into buffer: UnsafeMutableRawBufferPointer) throws(FilesystemError) -> Int? {
        let file = try openFile(handle)
        guard let window = try clamp(file.meta, offset, buffer) else { return 0 }
        return reader.readCached(file.stream, at: offset, into: window) ? window.count : nil
    }

    private func openFile(_ handle: UInt64) throws(FilesystemError) -> OpenFile {
        guard case .file(let file)? = handles.withLock({ $0.open[handle] }) else {
            throw FilesystemError(.staleHandle, "unknown file handle \(handle)")
        }
        return file
    }

    /// The part of `buffer` that the object has bytes for at `offset`; nil at or past the end.
    private func clamp(_ meta: ObjectMetadata, _ offset: Int64, _ buffer: UnsafeMutableRawBufferPointer) throws(FilesystemError) -> UnsafeMutableRawBufferPointer? {
        guard offset >= 0 else { throw FilesystemError(.invalidArgument, "negative offset") }
        guard offset < meta.size, buffer.count > 0 else { return nil }
        let count = Int(min(Int64(buffer.count), meta.size - offset))
        return UnsafeMutableRawBufferPointer(rebasing: buffer[0..<count])
    }

    /// Reads up to `buffer.count` bytes at `offset` of an open file into `buffer`; returns the
    /// count (0 at or past the end). Blocks on the network on a miss: call from a worker.
    /// `afterReply`, when given, collects work (the cache copy of a download) that the caller
    /// runs once it has replied, on the same thread: no hand-off in front of the reply or after it.
    public func read(_ handle: UInt64, at offset: Int64, into buffer: UnsafeMutableRawBufferPointer,
                     alreadyNoted: Bool = false, isCancelled: (@Sendable () -> Bool)? = nil,
                     afterReply: AfterReply? = nil) throws(FilesystemError) -> Int {
        let file = try openFile(handle)
        let meta = file.meta
        guard let window = try clamp(meta, offset, buffer) else { return 0 }
        do throws(StorageError) {
            try reader.read(file.stream, at: offset, into: window, observed: alreadyNoted, isCancelled: isCancelled,
                            afterReply: afterReply)
        } catch {
            if error.code == .cancelled {
                Log.debug("op=read object=\(meta.name) offset=\(offset) interrupted")
            } else {
                Log.warn("op=read object=\(meta.name) gen=\(meta.generation) offset=\(offset) error=\(error.message)")
            }
            throw FilesystemError(error)
        }
        return window.count
    }

    // MARK: Extended attributes

    static let xattrPrefix = "user.storefs."

    static let downloadURLAttribute = xattrPrefix + "download_url"

    /// The attribute names `uid` may see.
    public func extendedAttributeNames(_ inode: UInt64, requester uid: UInt32 = 0,
                                       network: Network = .allowed) throws(FilesystemError) -> [String] {
        let names = try xattrs(inode, withURL: false, network: network).map(\.0)
        guard try isFile(inode), config.downloadURL.allows(uid) else { return names }
        return [Self.downloadURLAttribute] + names
    }

    public func extendedAttribute(_ inode: UInt64, name: String, requester uid: UInt32 = 0,
                                  network: Network = .allowed) throws(FilesystemError) -> [UInt8] {
        // ls -l asks every file for security.selinux and POSIX ACLs: answer those without work.
        guard name.hasPrefix(Self.xattrPrefix) else { throw FilesystemError(.noAttribute, "no attribute \(name)") }
        if name == Self.downloadURLAttribute, try isFile(inode) {
            switch config.downloadURL.access {
            case .off: throw FilesystemError(.noAttribute, "download_url is turned off (url_xattr=off)")
            case .owner where !config.downloadURL.allows(uid):
                throw FilesystemError(.permissionDenied, "download_url is readable by the mounting user only (url_xattr=owner)")
            default: break
            }
        }
        guard let value = try xattrs(inode, withURL: name == Self.downloadURLAttribute, network: network).first(where: { $0.0 == name })?.1 else {
            throw FilesystemError(.noAttribute, "no attribute \(name)")
        }
        return Array(value.utf8)
    }

    private func isFile(_ inode: UInt64) throws(FilesystemError) -> Bool {
        guard let node = table.withLock({ $0.nodes[inode] }) else {
            throw FilesystemError(.staleHandle, "unknown inode \(inode)")
        }
        if case .file = node.kind { return true }
        return false
    }

    private func xattrs(_ inode: UInt64, withURL: Bool, network: Network) throws(FilesystemError) -> [(String, String)] {
        _ = try attributes(of: inode, network: network)
        guard let node = table.withLock({ $0.nodes[inode] }) else {
            throw FilesystemError(.staleHandle, "unknown inode \(inode)")
        }
        let p = Self.xattrPrefix
        guard case .file(let m, _) = node.kind else {
            let name = listingPrefix(of: node.path)
            return [(p + "gs_uri", "gs://\(reference.bucket)/\(name)")]
        }
        var out: [(String, String)] = [
            (p + "gs_uri", "gs://\(m.bucket)/\(m.name)"),
            (p + "generation", String(m.generation)),
        ]
        if let v = m.contentType { out.append((p + "content_type", v)) }
        if let v = m.md5Hash { out.append((p + "md5", v)) }
        if let v = m.crc32c { out.append((p + "crc32c", v)) }
        if let v = m.contentEncoding { out.append((p + "content_encoding", v)) }
        if let v = m.cacheControl { out.append((p + "cache_control", v)) }
        // Download tokens are capabilities: they appear only inside download_url.
        for key in m.custom.keys.sorted() where key != "firebaseStorageDownloadTokens" {
            out.append((p + "meta." + key, m.custom[key]!))
        }
        if withURL { out.append((Self.downloadURLAttribute, config.downloadURL.url(for: m))) }
        return out
    }
}

func now() -> Double {
    var ts = timespec()
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return Double(ts.tv_sec) + Double(ts.tv_nsec) / 1e9
}

/// Whether a metadata operation may ask the bucket. FUSE threads pass `.never` first, so
/// that anything the daemon already knows is answered without a thread hop and no FUSE thread
/// ever waits on the network; what needs the bucket throws `.wouldBlock` and is asked again
/// from a metadata worker with `.allowed(isCancelled:)` (the FUSE request's interrupt flag).
public enum Network: Sendable {
    case never
    case allowed(isCancelled: (@Sendable () -> Bool)?)

    public static let allowed = Network.allowed(isCancelled: nil)
}

/// A result one thread produces and another waits for, giving up when its caller is interrupted.
final class Awaited<Value>: @unchecked Sendable {
    private let condition = NSCondition()
    private var result: Value?

    func finish(_ r: Value) {
        condition.lock()
        result = r
        condition.broadcast()
        condition.unlock()
    }

    /// nil when `isCancelled` said so first (checked every 50 ms).
    func wait(isCancelled: (@Sendable () -> Bool)? = nil) -> Value? {
        condition.lock()
        defer { condition.unlock() }
        while result == nil {
            if let isCancelled {
                if isCancelled() { return nil }
                _ = condition.wait(until: Date().addingTimeInterval(0.05))
            } else {
                condition.wait()
            }
        }
        return result
    }
}

/// A caller's cancellation check, handed to work that may outlive the call: once the caller
/// has left, the work is cancelled and the caller's check (which may read a FUSE request freed
/// by the caller's reply) is never called again.
final class CallerCancellation: @unchecked Sendable {
    private let lock = NSLock()
    private var left = false
    private let isCancelled: (@Sendable () -> Bool)?

    init(_ isCancelled: (@Sendable () -> Bool)?) { self.isCancelled = isCancelled }

    var check: @Sendable () -> Bool {
        { [self] in
            lock.lock()
            defer { lock.unlock() }
            return left || (isCancelled?() ?? false)
        }
    }

    func leave() {
        lock.lock()
        left = true
        lock.unlock()
    }
}

/// A directory listing under way, which later askers wait for.
typealias ListingFlight = Awaited<Result<ListingSnapshot, FilesystemError>>
/// The metadata GET of a lookup, made beside its "is it a directory?" list request.
typealias ProbeResult = Awaited<Result<ObjectMetadata, StorageError>>

struct CachedListing {
    var snapshot: ListingSnapshot
    var expires: Double
}

/// One listing of a directory with its names in byte order: what every handle opened on it
/// reads, shared (immutable).
final class ListingSnapshot: Sendable {
    let listing: DirectoryListing
    let names: [String]

    init(_ listing: DirectoryListing) {
        self.listing = listing
        names = listing.sortedNames
    }
}

struct OpenFile {
    var meta: ObjectMetadata
    var stream: BlockReader.Stream
}

struct Handles {
    enum Open {
        case file(OpenFile)
        case directory(path: String, inode: UInt64, snapshot: ListingSnapshot)
    }

    var open: [UInt64: Open] = [:]
    var next: UInt64 = 1

    mutating func add(_ o: Open) -> UInt64 {
        let h = next
        next += 1
        open[h] = o
        return h
    }
}
