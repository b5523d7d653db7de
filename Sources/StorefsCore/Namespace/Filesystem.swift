import Locking
import Foundation
import Glibc
import StorageClient
import Synchronization

/// The storefs namespace and read path, with no FUSE and no HTTP in sight.
///
/// The FUSE adapter calls these methods with inode and handle numbers and turns the answers
/// (or `FilesystemError`s, through `Errno`) into replies. Paths here are relative to the mount
/// root; `objectName(of:)` adds the mounted prefix. The state is split along what it owns,
/// one lock each (its level in the lock order), every one bounded (docs/architecture.md, "Metadata memory"):
///
/// - `InodeTable` (this file): the inodes the kernel references, ~100 bytes each;
/// - `MetadataCache` (this file): what the bucket said about paths the kernel forgot, and
///   missing names, bounded by `metadata_cache_size`;
/// - `ListingCache` (Filesystem+Directories.swift): directory listings, bounded in entries;
/// - `Handles` (Filesystem+Files.swift): open files and directories;
/// - `FullMetadataCache` (Filesystem+ExtendedAttributes.swift): whole object resources.
///
/// Metadata flow: `readdir` lists a directory once (all pages) and caches it for `list_ttl`;
/// `lookup` answers from that listing when it is fresh, from the inode table or the path
/// cache within `stat_ttl`, and otherwise probes the name directly (the "is it a directory?"
/// list request and the metadata GET side by side — directories win).
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
        /// Metadata GETs in flight at once when sizes are missing (Firebase v0 listings).
        public var metadataParallelism: Int
        /// Sub-directories listed ahead when a directory is opened (0: none).
        public var listingPrefetch: Int
        /// Records of names kept beyond what the kernel references: listing entries, and
        /// looked-up paths (each at most this many). `metadata_cache_size=`.
        public var metadataCacheSize: Int
        /// Honour `goog-reserved-posix-*` metadata (`posix_metadata=`).
        public var posixMetadata = true
        /// `file_mode=` was given: it masks the objects' POSIX modes.
        public var fileModeGiven = false
        /// `uid=`/`gid=` were given: they win over the objects' POSIX owners.
        public var ownerGiven = false
        /// Show gcsfuse's symlink objects as symlinks (`symlinks=`).
        public var symlinks = true
        /// Entries one directory listing may have; past it the listing is EIO (docs/security.md,
        /// "Local users on an allow_other mount").
        public var listingEntryLimit = 5_000_000
        /// Entries all listings being fetched at once may hold together (64 metadata and 4
        /// list-ahead threads can each be fetching one): the listing whose page passes it is EIO.
        public var listingEntriesInFlightLimit = 10_000_000

        public init(statTTL: Double = 60, listTTL: Double = 60, negativeTTL: Double = 5, uid: UInt32 = getuid(),
                    gid: UInt32 = getgid(), fileMode: UInt32 = 0o644, dirMode: UInt32 = 0o755,
                    downloadURL: DownloadURL = DownloadURL(ownerUID: getuid()), metadataParallelism: Int = 16,
                    listingPrefetch: Int = 0, metadataCacheSize: Int = Filesystem.defaultMetadataCacheSize) {
            self.downloadURL = downloadURL
            self.listingPrefetch = listingPrefetch
            self.metadataParallelism = metadataParallelism
            self.metadataCacheSize = metadataCacheSize
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
    /// Default `metadata_cache_size` (docs/architecture.md, "Metadata memory").
    public static let defaultMetadataCacheSize = 262_144

    public let config: Config
    public let reference: StorageReference
    let store: ObjectStore
    let reader: BlockReader
    /// Shared with the read path: an outage found by either is known to both.
    var health: BucketHealth { reader.health }
    let mountTime: Timestamp

    let table = OrderedMutex(.inodeTable, InodeTable())
    // Tables keyed by paths use ByteName: names are compared as bytes, never as Unicode.
    let known: OrderedMutex<MetadataCache>
    let listings: OrderedMutex<ListingCache>
    let fullMetadata = OrderedMutex(.fullMetadata, FullMetadataCache(capacity: 4096))
    let handles = Handles()
    let shadowLogged = OrderedMutex(.shadowLogged, Set<ByteName>())
    let listingFlights = OrderedMutex(.listingFlights, [ByteName: ListingFlight]())
    /// Entries held by listings being fetched (`Config.listingEntriesInFlightLimit`).
    let listingEntriesInFlight = Atomic<Int>(0)
    let firstPages = OrderedMutex(.firstPages, FirstPageCache())
    let nameChanged = OrderedMutex<(@Sendable (_ parent: UInt64, _ name: String) -> Void)?>(.nameChanged, nil)

    /// The namespace on disk (nil: none, as in tests without a cache).
    let stored: NamespaceStore?
    /// The manifest the mount was made from (`-o manifest=`), asked before anything else
    /// (Filesystem+Manifest.swift); nil: none.
    let manifest: ManifestNamespace?

    /// `reader` defaults to one with no disk cache (tests); the daemon passes one with its
    /// cache, and the namespace stored beside it, which is loaded here: what it holds answers
    /// only while the bucket cannot (`lastKnown`), as if learnt long ago.
    public init(store: ObjectStore, reference: StorageReference, config: Config, reader: BlockReader? = nil,
                namespace: NamespaceStore? = nil, manifest: ManifestNamespace? = nil) {
        self.manifest = manifest
        self.store = store
        self.reference = reference
        self.config = config
        self.reader = reader ?? BlockReader(store: store, cache: nil, endpoint: "", config: .init())
        self.stored = namespace
        var known = MetadataCache(capacity: config.metadataCacheSize)
        var listings = ListingCache(capacity: config.metadataCacheSize)
        if let loaded = namespace?.load() {
            for (path, record) in loaded.files {
                known.remember(ByteName(path), .file(record), at: -.infinity)
                var parent = Self.split(path).parent
                while !parent.isEmpty, known.last(ByteName(parent)) == nil {
                    known.remember(ByteName(parent), .directory, at: -.infinity)
                    parent = Self.split(parent).parent
                }
            }
            for (path, listing) in loaded.listings {
                listings.store(ByteName(path), ListingSnapshot(listing, fetched: -.infinity))
            }
            if !loaded.isEmpty {
                Log.debug("namespace loaded files=\(loaded.files.count) listings=\(loaded.listings.count)")
            }
        }
        self.known = OrderedMutex(.knownPaths, known)
        self.listings = OrderedMutex(.listings, listings)
        var now = timespec()
        clock_gettime(CLOCK_REALTIME, &now)
        mountTime = Timestamp(seconds: Int64(now.tv_sec), nanoseconds: Int32(now.tv_nsec))
    }

    /// Mounted while the bucket does not answer: everything answers from what is stored until
    /// it does (BucketHealth asks again after its hold).
    public func startOffline(_ error: StorageError) {
        health.note(error)
    }

    /// Called once the kernel is gone (unmount, signal): lets background work land on disk.
    public func finishPendingWork(timeout: Double = 10) {
        reader.finishPendingWork(timeout: timeout)
        stored?.flush(timeout: timeout)
    }

    // MARK: Names

    /// The object name (or listing prefix, without its trailing `/`) of a mount-relative path.
    public func objectName(of path: String) -> String {
        if reference.prefix.isEmpty { return path }
        return path.isEmpty ? reference.prefix : reference.prefix + "/" + path
    }

    func listingPrefix(of dirPath: String) -> String {
        let name = objectName(of: dirPath)
        return name.isEmpty ? "" : name + "/"
    }

    static func join(_ dir: String, _ name: String) -> String { dir.isEmpty ? name : dir + "/" + name }

    static func split(_ path: String) -> (parent: String, name: String) {
        let components = path.slashComponents
        return (components.dropLast().joined(separator: "/"), components.last ?? "")
    }

    // MARK: Lookup and attributes

    /// Resolves `name` in directory `parent` and counts one kernel reference to the result.
    public func lookup(parent: UInt64, name: String, network: Network = .allowed) throws(FilesystemError) -> FileAttributes {
        let parentPath = try directoryPath(parent)
        guard DirectoryListing.isRepresentable(name), !name.containsSlash else {
            if name.utf8.count > DirectoryListing.maxNameBytes {
                throw FilesystemError(.nameTooLong, "name longer than \(DirectoryListing.maxNameBytes) bytes")
            }
            throw FilesystemError(.noEntry, "name cannot be a path component")
        }
        let path = Self.join(parentPath, name)
        do throws(FilesystemError) {
            let (kind, fetched) = try resolve(path: path, parentPath: parentPath, name: name, network: network)
            return register(path: path, kind: kind, fetched: fetched, countLookup: true)
        } catch {
            if error.code == .wouldBlock { throw error }
            // The bucket is unreachable or failing: a path we already know keeps working from
            // what we know (its cached blocks stay readable). Missing and denied stay errors.
            guard case .storage(let code) = error.code, Self.isOutage(code),
                  let known = table.withLock({ t -> (UInt64, Node)? in
                      guard let ino = t.inode(of: ByteName(path)), var node = t.nodes[ino] else { return nil }
                      node.lookups += 1
                      t.nodes[ino] = node
                      return (ino, node)
                  }) else { throw error }
            Log.info("op=lookup path=\(path) serving known attributes while the bucket is unreachable")
            return attributes(known.0, known.1)
        }
    }

    /// Drops `count` kernel references. An inode nobody references leaves the table; what it
    /// said about its path moves to the bounded path cache (the kernel forgot it, we need not).
    public func forget(_ inode: UInt64, count: UInt64) {
        guard let gone = table.withLock({ $0.forget(inode, count: count) }) else { return }
        let known: MetadataCache.Known
        switch gone.kind {
        case .directory: known = .directory
        case .file(let r): known = .file(r)
        }
        self.known.withLock { $0.remember(ByteName(gone.path), known, at: gone.fetched) }
    }

    /// The attributes of an inode, refreshed from the bucket once older than `stat_ttl`. A
    /// refresh that finds a new generation does not change this inode (it keeps describing
    /// the generation its handles read): the path is let go, and the next lookup makes a new one.
    public func attributes(of inode: UInt64, network: Network = .allowed) throws(FilesystemError) -> FileAttributes {
        guard let node = table.withLock({ $0.nodes[inode] }) else {
            throw FilesystemError(.staleHandle, "unknown inode \(inode)")
        }
        guard case .file = node.kind, now() - node.fetched >= config.statTTL else {
            return attributes(inode, node)
        }
        // Stale: refresh from the parent listing if it is fresh, else from the object itself.
        let (parentPath, name) = Self.split(node.path)
        do throws(FilesystemError) {
            let (kind, _) = try resolve(path: node.path, parentPath: parentPath, name: name, network: network,
                                        skipInode: inode)
            guard case .file(let fresh) = kind else {
                forgetPath(node.path)
                throw FilesystemError(.noEntry, "\(node.path) is now a directory")
            }
            let updated = table.withLock { $0.refresh(inode, record: fresh, at: now()) }
            return attributes(inode, updated ?? node)
        } catch {
            if error.code == .wouldBlock { throw error }
            if case .storage(let code) = error.code, code != .notFound {
                Log.debug("op=getattr ino=\(inode) serving cached attributes: \(error.message)")
                return attributes(inode, node)
            }
            if error.code == .noEntry || error.code == .storage(.notFound) {
                table.withLock { t in if let n = t.nodes[inode] { t.supersede(inode, n) } }
            }
            throw error
        }
    }

    func attributes(_ inode: UInt64, _ node: Node) -> FileAttributes {
        switch node.kind {
        case .directory:
            return FileAttributes(inode: inode, kind: .directory, size: 4096, mode: config.dirMode, uid: config.uid,
                                  gid: config.gid, modified: mountTime, linkCount: 2)
        case .file(let record):
            if isSymlink(record) {
                return FileAttributes(inode: inode, kind: .symlink, size: record.symlinkSize, mode: 0o777, uid: config.uid,
                                      gid: config.gid, modified: record.modified, linkCount: 1)
            }
            var mode = config.fileMode, uid = config.uid, gid = config.gid
            // README, "Compatibility": the uploader's mode, masked by an explicit file_mode=; its
            // owner when root mounts and no uid=/gid= says otherwise.
            if config.posixMetadata {
                if let m = record.posixMode { mode = config.fileModeGiven ? UInt32(m) & config.fileMode : UInt32(m) }
                if !config.ownerGiven && getuid() == 0 {
                    uid = record.posixUID ?? uid
                    gid = record.posixGID ?? gid
                }
            }
            return FileAttributes(inode: inode, kind: .file, size: record.size, mode: mode & 0o777, uid: uid,
                                  gid: gid, modified: record.modified, linkCount: 1)
        }
    }

    func isSymlink(_ record: FileRecord) -> Bool { config.symlinks && record.symlink != nil }

    func directoryPath(_ inode: UInt64) throws(FilesystemError) -> String {
        guard let node = table.withLock({ $0.nodes[inode] }) else {
            throw FilesystemError(.staleHandle, "unknown inode \(inode)")
        }
        guard case .directory = node.kind else { throw FilesystemError(.notDirectory, "\(node.path) is a file") }
        return node.path
    }

    /// What `path` is, and when that was learnt: from a fresh listing of its parent, the
    /// inode table or the path cache within `stat_ttl`, and otherwise from the bucket.
    /// `skipInode` is the inode being refreshed (its own record is what is stale).
    func resolve(path: String, parentPath: String, name: String, network: Network,
                 skipInode: UInt64? = nil) throws(FilesystemError) -> (Node.Kind, Double) {
        if let answer = try manifestAnswer(path, parentPath: parentPath, name: name) { return answer }
        let t = now()
        let key = ByteName(path)
        if let snapshot = freshSnapshot(parentPath) {
            let (listing, fetched) = (snapshot.listing, snapshot.fetched)
            if let index = listing.index(of: name) {
                // A listing learnt beside a lookup vouches for its names for `stat_ttl` only.
                if t - fetched < presentTTL(learntByLookup: snapshot.learntByLookup) {
                    if let kind = listing.entries[index].nodeKind { return (kind, fetched) }
                    return try sized(path, in: listing, at: index, parentPath: parentPath, network: network)
                }
            } else if t - fetched < config.negativeTTL {
                // A listing says "absent" for `negative_ttl` only, as a missing name does: a name
                // that appeared since is found by a probe (README, "Namespace semantics").
                throw FilesystemError(.noEntry, "no \(path)")
            }
        }
        if let node = table.withLock({ tb -> Node? in
            guard let ino = tb.inode(of: key), ino != skipInode, let n = tb.nodes[ino], t - n.fetched < config.statTTL else { return nil }
            return n
        }) {
            return (node.kind, node.fetched)
        }
        if let record = known.withLock({ $0.last(key) }) {
            switch record.known {
            case .missing where t - record.fetched < config.negativeTTL:
                throw FilesystemError(.noEntry, "no \(path) (cached)")
            case .directory where t - record.fetched < config.statTTL: return (.directory, record.fetched)
            case .file(let r) where t - record.fetched < config.statTTL && skipInode == nil: return (.file(r), record.fetched)
            default: break
            }
        }
        // The first page of the parent, fetched beside an earlier lookup there, answers for
        // the names it reaches (docs/architecture.md, "Lookups in one round trip").
        if let answer = firstPageAnswer(parentPath, name: name, refreshing: skipInode != nil) { return try answer.get() }
        // The bucket is known not to answer: what we know answers at once, and of the rest one
        // operation at a time asks (BucketHealth).
        if health.outage != nil, let answer = lastKnown(path, parentPath: parentPath, name: name) { return try answer.get() }
        if let refused = health.refusal { throw FilesystemError(refused) }
        guard case .allowed(let isCancelled) = network else { throw FilesystemError(.wouldBlock, "lookup of \(path) needs the bucket") }
        let asking = try admitted()
        defer { asking?.end() }
        let objectName = objectName(of: path)
        let race = LookupRace()
        fetchFirstPage(parentPath, race: race)
        // Where listings carry no sizes (v0) nothing learnt before could answer this lookup, and
        // a read that follows would wait a round trip of its own: its first bytes are asked now,
        // unless the cache holds bytes of the generation last known (a file read before, on this
        // mount or an earlier one).
        if skipInode == nil, !store.listingsCarrySizes, !lastKnownIsCached(path, parentPath: parentPath, name: name) {
            reader.fetchFirstBytes(of: objectName, submit: probePool.submit)
        }
        do throws(StorageError) {
            let kind: Node.Kind
            switch try probe(objectName, race: race, isCancelled: isCancelled, orFromPage: { [self] in
                // The page landed first (its request went out on a warm connection while the
                // probe's may still be opening theirs): it answers as well as the probe would.
                if let snapshot = freshSnapshot(parentPath), let index = snapshot.listing.index(of: name),
                   now() - snapshot.fetched < presentTTL(learntByLookup: snapshot.learntByLookup) {
                    let (listing, fetched) = (snapshot.listing, snapshot.fetched)
                    // A refresh asks the bucket about a file: its own record is what is stale.
                    guard let kind = listing.entries[index].nodeKind, skipInode == nil || kind == .directory else { return nil }
                    return .success((kind, fetched))
                }
                return firstPageAnswer(parentPath, name: name, refreshing: skipInode != nil)
            }) {
            case .directory: kind = .directory
            case .file(let meta):
                fullMetadata.withLock { $0.remember(key, meta, at: now()) }
                kind = .file(FileRecord(meta))
            case .answered(.success(let answer)):
                health.noteSuccess()
                return answer
            case .answered(.failure):
                throw StorageError(.notFound, "no \(path) (as its directory's first page says)")
            }
            health.noteSuccess()
            return (kind, now())
        } catch {
            health.note(error)
            if error.code == .notFound {
                health.noteSuccess()
                if config.negativeTTL > 0 { known.withLock { $0.remember(key, .missing, at: now()) } }
                throw FilesystemError(.noEntry, "no \(path)")
            }
            // Unreachable or failing: what we last knew still holds, so cached files stay
            // reachable offline even after the kernel forgot them.
            if Self.isOutage(error.code), let answer = lastKnown(path, parentPath: parentPath, name: name) {
                Log.info("op=lookup path=\(path) answering from what was last known: \(error.message)")
                return try answer.get()
            }
            Log.warn("lookup failed", ["op": "lookup", "path": path, "error": error.message])
            throw FilesystemError(error)
        }
    }

    /// `path` was last known as a file of which the cache holds bytes.
    func lastKnownIsCached(_ path: String, parentPath: String, name: String) -> Bool {
        guard case .success((.file(let r), _))? = lastKnown(path, parentPath: parentPath, name: name) else { return false }
        return reader.hasCachedBytes(of: objectName(of: path), generation: r.generation, size: r.size)
    }

    /// What was last known about `path`, however old (for outages): the inode table, the
    /// path cache, or the last listing of its parent. nil when nothing is known.
    func lastKnown(_ path: String, parentPath: String, name: String) -> Result<(Node.Kind, Double), FilesystemError>? {
        let key = ByteName(path)
        if let node = table.withLock({ t in t.inode(of: key).flatMap { t.nodes[$0] } }) { return .success((node.kind, node.fetched)) }
        if let record = known.withLock({ $0.last(key) }) {
            switch record.known {
            case .directory: return .success((.directory, record.fetched))
            case .file(let r): return .success((.file(r), record.fetched))
            case .missing: break
            }
        }
        if let (listing, fetched) = staleListing(parentPath) {
            guard let entry = listing[name: name] else { return .failure(FilesystemError(.noEntry, "no \(path) (as last listed)")) }
            return entry.nodeKind.map { .success(($0, fetched)) }
        }
        return nil
    }

    /// What the first page of `parentPath` (or its listing, once complete) says about `name`:
    /// nil where it does not reach the name, holds a file without its size (v0), or the caller
    /// refreshes a file (its own record is what is stale).
    func firstPageAnswer(_ parentPath: String, name: String, refreshing: Bool) -> Result<(Node.Kind, Double), FilesystemError>? {
        let t = now()
        guard let page = firstPages.withLock({ $0.page(ByteName(parentPath)) }), t - page.fetched < config.listTTL,
              let answer = FirstPageCache.answer(page, name: name) else { return nil }
        // A page is fetched beside a lookup: it vouches for the names it holds for `stat_ttl`
        // only, as that lookup's own answer would be, and for an absence for `negative_ttl`.
        let present = t - page.fetched < presentTTL(learntByLookup: true)
        switch answer {
        case .directory? where present: return .success((.directory, page.fetched))
        case .file(let r)? where !refreshing && present: return .success((.file(r), page.fetched))
        case nil where t - page.fetched < config.negativeTTL:
            return .failure(FilesystemError(.noEntry, "no \(parentPath.isEmpty ? name : parentPath + "/" + name)"))
        default: return nil  // a size to fetch (v0), a refresh, or an old "absent": ask the bucket
        }
    }

    /// Is `objectName` a directory (a prefix with anything under it) or an object? Both are
    /// asked at once, on probe threads (one round trip of waiting, not two); a directory wins
    /// over a same-named object, as in listings, so a "yes, a directory" ends the wait at once.
    /// `orFromPage` is asked after each landing on `race` (the directory's first page, fetched
    /// beside the probe): where it answers first, that answer is the lookup's.
    func probe(_ objectName: String, race: LookupRace = LookupRace(), isCancelled: (@Sendable () -> Bool)?,
               orFromPage: () -> Result<(Node.Kind, Double), FilesystemError>? = { nil }) throws(StorageError) -> ProbeAnswer {
        // The requests may outlive this call; the caller's isCancelled reads a FUSE request
        // that is freed once the caller replies, so they ask it only while this call is on,
        // under a lock this call takes to leave. Once the call has its answer from elsewhere,
        // they are detached: they end on their own rather than abort on a warm connection.
        let caller = CallerCancellation(isCancelled)
        defer { caller.leave() }
        probePool.submit { [store] in
            race.finish(metadata: Result { () throws(StorageError) in try store.metadata(of: objectName, isCancelled: caller.check) })
        }
        probePool.submit { [store] in
            race.finish(hasChildren: Result { () throws(StorageError) in
                try store.hasChildren(prefix: objectName + "/", isCancelled: caller.check)
            })
        }
        let answer = race.wait(isCancelled: isCancelled) { metadata, hasChildren -> Result<ProbeAnswer, StorageError>? in
            if let page = orFromPage() { return .success(.answered(page)) }
            switch hasChildren {
            case .success(true)?: return .success(.directory)
            case .failure(let e)?: return .failure(e)
            case nil: return nil
            case .success(false)?: break
            }
            guard let metadata else { return nil }
            return metadata.map { .file($0) }
        }
        guard let answer else { throw StorageError(.cancelled, "lookup of \(objectName) interrupted") }
        switch answer {
        case .success(let a):
            caller.detach()
            return a
        case .failure(let e): throw e
        }
    }

    enum ProbeAnswer {
        case directory
        case file(ObjectMetadata)
        /// The directory's first page (or listing) answered before the probe did.
        case answered(Result<(Node.Kind, Double), FilesystemError>)
    }

    /// A lookup's probes and first page (`WorkerPools.probe`, shared with the read path).
    var probePool: WorkerPool { reader.pools.probe }

    /// Names remembered beyond the kernel's references (tests).
    var rememberedPathCount: Int { known.withLock { $0.count } }

    /// The bucket's object at `path` is not what we knew (a read found its generation gone,
    /// or a refresh found it replaced): forget what any cache says about it, so the next
    /// `open` and `stat` ask the bucket.
    func forgetPath(_ path: String) {
        let key = ByteName(path)
        let (parentPath, name) = Self.split(path)
        known.withLock { $0.forget(key) }
        fullMetadata.withLock { $0.forget(key) }
        listings.withLock { $0.invalidate(ByteName(parentPath)) }
        firstPages.withLock { $0.forget(ByteName(parentPath)) }
        let parent = table.withLock { t -> UInt64? in
            if let ino = t.inode(of: key) { t.expire(ino) }
            return t.inode(of: ByteName(parentPath))
        }
        // The kernel's entry for the name (and the attributes it caches for `stat_ttl`) must go
        // too, or `stat` keeps showing the old object.
        if let parent, let tell = nameChanged.withLock({ $0 }) { tell(parent, name) }
    }

    /// Installs who tells the kernel that a name no longer means what it was told (the FUSE
    /// adapter, which does so off the request's thread).
    public func onNameChanged(_ tell: @escaping @Sendable (_ parent: UInt64, _ name: String) -> Void) {
        nameChanged.withLock { $0 = tell }
    }

    func register(path: String, kind: Node.Kind, fetched: Double, countLookup: Bool) -> FileAttributes {
        let (inode, node) = table.withLock { $0.upsert(path: path, kind: kind, at: fetched, countLookup: countLookup) }
        return attributes(inode, node)
    }

    /// The inode number of a path: a hash of its bytes. readdir reports it for names not
    /// looked up yet and a lookup then gives the same number, so `d_ino` equals `st_ino`
    /// (`find -inum`, `du`, rsync). The top bit keeps it clear of the root (1). While the
    /// kernel still holds the inode of an older generation of the object, the new one takes
    /// the next free number (`InodeTable.upsert`): one inode per generation.
    static func inodeNumber(_ path: String) -> UInt64 {
        var h: UInt64 = 0xcbf2_9ce4_8422_2325
        for b in path.utf8 { h = (h ^ UInt64(b)) &* 0x100_0000_01b3 }
        return h | (1 << 63)
    }

    /// May this operation ask the bucket (`BucketHealth.admit`)? The probe it may be given is
    /// ended by the caller once it has noted what it found.
    func admitted() throws(FilesystemError) -> BucketHealth.Probe? {
        do throws(StorageError) { return try health.admit() } catch { throw FilesystemError(error) }
    }

    /// The bucket cannot answer right now (as opposed to answering "no").
    static func isOutage(_ code: StorageError.Code) -> Bool {
        code == .unreachable || code == .retryLimitExceeded
    }
}
