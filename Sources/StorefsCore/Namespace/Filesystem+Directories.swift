import StorageClient

/// Directories: listings (fetched once, shared by every handle, cached for `list_ttl`),
/// readdir, readdirplus, listing ahead, and the sizes Firebase v0 listings leave out. Over
/// 500 lines because a listing's life (fetched page by page, shared by handles, cached,
/// listed ahead) is one piece of state each of these steps reads and changes.
extension Filesystem {
    /// Opens a directory: from its cached listing when fresh, else as its listing arrives
    /// (docs/architecture.md, "Listings as they arrive"). It returns as soon as readdir can
    /// start: at once for a cached listing or one already under way, after the first page for
    /// one this call fetches, whose other pages the returned value fetches when the caller
    /// finishes it (the adapter does, on the same worker, once it has replied). It throws only
    /// before it returns (a failure later reaches the handle's readdir). A listing is shared,
    /// never copied, by every handle on it: a local user opening a directory many times costs
    /// one listing.
    public func openDirectory(_ inode: UInt64, network: Network = .allowed) throws(FilesystemError) -> OpenedDirectory {
        let path = try directoryPath(inode)
        if let handle = try manifestDirectoryHandle(path, inode) { return OpenedDirectory(handle: handle) }
        var cached = freshSnapshot(path)
        if cached == nil, health.outage != nil { cached = try fullListing(path, network: network) }
        if let snapshot = cached {
            prefetchListings(under: path, snapshot.listing)
            return OpenedDirectory(handle: addDirectoryHandle(path, inode, .snapshot(snapshot)))
        }
        let dir = ByteName(path)
        guard case .allowed(let isCancelled) = network else {
            // On a FUSE thread: a listing under way that has its first page can be read now.
            guard let running = listingFlights.withLock({ $0[dir] }), running.hasStarted else {
                throw FilesystemError(.wouldBlock, "listing \(path) needs the bucket")
            }
            return OpenedDirectory(handle: attach(running, path, inode))
        }
        let (stream, mine) = listingFlights.withLock { f -> (ListingStream, Bool) in
            if let running = f[dir] { return (running, false) }
            let created = ListingStream(prefix: listingPrefix(of: path))
            f[dir] = created
            return (created, true)
        }
        if !mine {
            guard try stream.waitForStart(isCancelled: isCancelled) else {
                throw FilesystemError(.storage(.cancelled), "listing of \(path) interrupted")
            }
            return OpenedDirectory(handle: attach(stream, path, inode))
        }
        // This call fetches. The opener's interruption may end the listing until it has its
        // handle; after that its request is answered, and the listing goes on for the handle.
        let caller = CallerCancellation(isCancelled)
        let fetch: ListingFetch
        do throws(FilesystemError) {
            fetch = try ListingFetch(self, path, into: stream, isCancelled: caller.check)
            let whole: ListingSnapshot?
            do throws(FilesystemError) {
                whole = try fetch.nextPage() ? fetch.keep() : nil
            } catch {
                whole = try fetch.recover(from: error)
            }
            if let whole {
                let snapshot = try endListing(path, stream, .success(whole))
                return OpenedDirectory(handle: addDirectoryHandle(path, inode, .snapshot(snapshot)))
            }
        } catch {
            _ = try? endListing(path, stream, .failure(error))
            throw error
        }
        caller.detach()
        _ = stream.listChildrenWhenDone()
        let handle = addDirectoryHandle(path, inode, .stream(stream))
        return OpenedDirectory(handle: handle) { [self] in
            _ = try? endListing(path, stream, Result { () throws(FilesystemError) in try fetch.rest() })
        }
    }

    /// Opens a directory whose listing is whole when this returns (tests, tools).
    public func openListedDirectory(_ inode: UInt64, network: Network = .allowed) throws(FilesystemError) -> UInt64 {
        let opened: OpenedDirectory = try openDirectory(inode, network: network)
        let handle = opened.handle
        opened.finishListing()
        if case .directory(_, _, .stream(let stream))? = handles[handle] { _ = stream.wait() }
        return handle
    }

    private func attach(_ stream: ListingStream, _ path: String, _ inode: UInt64) -> UInt64 {
        if let snapshot = stream.snapshot {
            prefetchListings(under: path, snapshot.listing)
            return addDirectoryHandle(path, inode, .snapshot(snapshot))
        }
        if stream.listChildrenWhenDone(), let snapshot = stream.snapshot { prefetchListings(under: path, snapshot.listing) }
        return addDirectoryHandle(path, inode, .stream(stream))
    }

    private func addDirectoryHandle(_ path: String, _ inode: UInt64, _ source: DirectorySource) -> UInt64 {
        listings.withLock { l in
            if case .snapshot(let s) = source { l.pin(ByteName(path), s) } else { l.pin(ByteName(path), nil) }
        }
        return handles.add(.directory(path: path, inode: inode, source: source))
    }

    /// At most `limit` entries of an open directory from `offset` on (offsets are positions in
    /// the listing, `.` and `..` first). Work is proportional to the entries returned. While
    /// the listing is arriving, what is settled is returned; with `Network.never`, `.wouldBlock`
    /// when nothing is yet (the adapter asks again from a worker, which waits).
    public func readDirectory(_ handle: UInt64, from offset: Int, limit: Int = Int.max,
                              network: Network = .allowed) throws(FilesystemError) -> [DirectoryEntry] {
        let (path, inode, source) = try directorySource(handle)
        let start = max(0, offset)
        let wanted = max(0, limit)
        var listed: [(String, DirectoryListing.Entry)] = []
        switch source {
        case .snapshot(let snapshot):
            let names = snapshot.listing.names
            let from = max(0, start - 2)
            if from < names.count {
                let n = min(names.count - from, max(0, wanted - max(0, 2 - start)))
                listed = (from..<(from + n)).map { (names[$0], snapshot.listing.entries[$0]) }
            }
        case .manifest(let dir):
            listed = try dir.entries(from: max(0, start - 2), limit: max(0, wanted - max(0, 2 - start)))
        case .stream(let stream):
            let dots = max(0, 2 - start)
            if wanted > dots {
                let waits: Bool
                let isCancelled: (@Sendable () -> Bool)?
                switch network {
                case .never: (waits, isCancelled) = (false, nil)
                case .allowed(let c): (waits, isCancelled) = (dots == 0, c)
                }
                if let got = try stream.entries(from: max(0, start - 2), limit: wanted - dots, wait: waits, isCancelled: isCancelled) {
                    listed = got
                } else if dots == 0 {
                    throw FilesystemError(.wouldBlock, "the listing of \(path) has not got there yet")
                }
            }
        }
        var out: [DirectoryEntry] = []
        out.reserveCapacity(listed.count + 2)
        if start < 2 && wanted > 0 {
            // `..` is the parent (the root's own parent is itself), as a directory's `..`
            // should be for tools that compare inode numbers.
            let parent = path.isEmpty ? inode : table.withLock { $0.inode(of: ByteName(Self.split(path).parent)) } ?? inode
            for i in start..<min(2, start + wanted) {
                out.append(DirectoryEntry(name: i == 0 ? "." : "..", inode: i == 0 ? inode : parent, kind: .directory,
                                          nextOffset: i + 1))
            }
        }
        let paths = listed.map { ByteName(Self.join(path, $0.0)) }
        let known = table.withLock { t in paths.map { t.inode(of: $0) } }
        var next = max(2, start)
        for (k, (name, entry)) in listed.enumerated() {
            let kind: FileAttributes.Kind
            switch entry {
            case .directory: kind = .directory
            case .file(let r): kind = isSymlink(r) ? .symlink : .file
            case .unsizedFile: kind = .file
            }
            next += 1
            out.append(DirectoryEntry(name: name, inode: known[k] ?? Self.inodeNumber(paths[k].string), kind: kind, nextOffset: next))
        }
        return out
    }

    /// readdirplus: the attributes of the entries at `offsets` of an open directory, each
    /// counted as a lookup (the kernel then needs no LOOKUP per name: `ls -l` costs the one
    /// listing). Called only for the entries that fit in the reply, all at once (one lock).
    /// nil for `.`/`..` and for entries whose size is not known without a request (v0
    /// listings): the kernel gets the name alone and looks it up if it needs more, so no
    /// reference is made that nobody asked for.
    public func lookupListed(_ handle: UInt64, offsets: Range<Int>) throws(FilesystemError) -> [FileAttributes?] {
        let (path, _, source) = try directorySource(handle)
        let t = now()
        var wanted: [(Int, String, Node.Kind)] = []
        wanted.reserveCapacity(offsets.count)
        for offset in offsets where offset >= 2 {
            guard let (name, entry) = source.entry(at: offset - 2) else { continue }
            let childPath = Self.join(path, name)
            switch entry {
            case .directory: wanted.append((offset, childPath, .directory))
            case .file(let r): wanted.append((offset, childPath, .file(r)))
            case .unsizedFile:
                if case .file(let r)? = known.withLock({ $0.lookup(ByteName(childPath), now: t, ttl: config.statTTL)?.known }) {
                    wanted.append((offset, childPath, .file(r)))
                }
            }
        }
        let fetched = source.fetched ?? t
        let registered = table.withLock { tb in
            wanted.map { (offset, childPath, kind) in
                (offset, tb.upsert(path: childPath, kind: kind, at: fetched > -.infinity ? fetched : t, countLookup: true))
            }
        }
        var out = [FileAttributes?](repeating: nil, count: offsets.count)
        for (offset, (inode, node)) in registered { out[offset - offsets.lowerBound] = attributes(inode, node) }
        return out
    }

    /// readdirplus of one entry (see `lookupListed(_:offsets:)`).
    public func lookupListed(_ handle: UInt64, at offset: Int) throws(FilesystemError) -> FileAttributes? {
        try lookupListed(handle, offsets: offset..<(offset + 1))[0]
    }

    func directorySource(_ handle: UInt64) throws(FilesystemError) -> (String, UInt64, DirectorySource) {
        guard case .directory(let path, let inode, let source)? = handles[handle] else {
            throw FilesystemError(.staleHandle, "unknown directory handle \(handle)")
        }
        return (path, inode, source)
    }

    /// The last listing of a directory, however old (for outages), and when it was fetched.
    func staleListing(_ dirPath: String) -> (DirectoryListing, Double)? {
        listings.withLock { $0.last(ByteName(dirPath)) }.map { ($0.listing, $0.fetched) }
    }

    func freshSnapshot(_ dirPath: String) -> ListingSnapshot? {
        guard let s = listings.withLock({ $0.last(ByteName(dirPath)) }), now() - s.fetched < config.listTTL else { return nil }
        return s
    }

    func freshListing(_ dirPath: String) -> (DirectoryListing, Double)? {
        freshSnapshot(dirPath).map { ($0.listing, $0.fetched) }
    }

    /// How long a listing says a name it holds is there: `list_ttl` for a directory someone
    /// listed; `stat_ttl` (at most) for names learnt beside a lookup, whose own answer would
    /// have been trusted that long (issue 49, item 8: gcsfuse's dentry-cache tests).
    func presentTTL(learntByLookup: Bool) -> Double {
        learntByLookup ? min(config.statTTL, config.listTTL) : config.listTTL
    }

    /// Cached listings and the entries they hold (tests).
    var cachedListingCounts: (listings: Int, entries: Int) { listings.withLock { ($0.count, $0.entryCount) } }

    /// The whole listing of a directory: every page, prefixes de-duplicated, cached for list_ttl.
    func fullListing(_ dirPath: String, network: Network = .allowed) throws(FilesystemError) -> ListingSnapshot {
        if let l = freshSnapshot(dirPath) { return l }
        if let outage = health.outage, let old = listings.withLock({ $0.last(ByteName(dirPath)) }) {
            Log.info("op=readdir path=\(dirPath) answering from a stale listing (the bucket is unreachable: \(outage.message))")
            return old
        }
        if let refused = health.refusal { throw FilesystemError(refused) }
        guard case .allowed(let isCancelled) = network else { throw FilesystemError(.wouldBlock, "listing \(dirPath) needs the bucket") }
        // One listing of a directory at a time: later askers wait for the one under way.
        let (flight, mine) = listingFlights.withLock { f -> (ListingFlight, Bool) in
            if let running = f[ByteName(dirPath)] { return (running, false) }
            let created = ListingFlight(prefix: listingPrefix(of: dirPath))
            f[ByteName(dirPath)] = created
            return (created, true)
        }
        if !mine {
            guard let shared = flight.wait(isCancelled: isCancelled) else {
                throw FilesystemError(.storage(.cancelled), "listing of \(dirPath) interrupted")
            }
            return try shared.get()
        }
        return try runListing(dirPath, flight, isCancelled: isCancelled).get()
    }

    /// Fetches a listing into its `stream` (registered in `listingFlights` by the caller), then
    /// ends the flight.
    func runListing(_ dirPath: String, _ stream: ListingStream,
                    isCancelled: (@Sendable () -> Bool)?) -> Result<ListingSnapshot, FilesystemError> {
        let result = Result { () throws(FilesystemError) in try ListingFetch(self, dirPath, into: stream, isCancelled: isCancelled).rest() }
        return Result { () throws(FilesystemError) in try endListing(dirPath, stream, result) }
    }

    /// A listing this process fetched has ended: its flight goes, its stream's readers get the
    /// outcome, and its sub-directories are listed ahead. Returns the outcome.
    @discardableResult
    func endListing(_ dirPath: String, _ stream: ListingStream,
                    _ result: Result<ListingSnapshot, FilesystemError>) throws(FilesystemError) -> ListingSnapshot {
        listingFlights.withLock { _ = $0.removeValue(forKey: ByteName(dirPath)) }
        if stream.finish(result), case .success(let snapshot) = result { prefetchListings(under: dirPath, snapshot.listing) }
        return try result.get()
    }

    /// After a directory is opened, its sub-directories are listed ahead on a few threads of
    /// their own, so `find` and `ls -R` find the next listing ready (one level ahead of the
    /// walker, at most `listingPrefetch` directories).
    func prefetchListings(under dirPath: String, _ listing: DirectoryListing) {
        guard config.listingPrefetch > 0, config.listTTL > 0, listings.withLock({ $0.hasRoomForPrefetch }) else { return }
        var queued = 0
        for (i, name) in listing.names.enumerated() where listing.entries[i] == .directory {
            if queued == config.listingPrefetch { break }
            let child = Self.join(dirPath, name)
            if freshSnapshot(child) != nil || listingFlights.withLock({ $0[ByteName(child)] != nil }) { continue }
            queued += 1
            listingPool.submit { [self] in
                // Fetched ahead only while the cache has room: evicting listings in use to make
                // room for ones not yet needed costs more requests than it saves.
                guard listings.withLock({ $0.hasRoomForPrefetch }) else { return }
                _ = try? self.fullListing(child, network: .allowed)
            }
        }
    }

    /// Listings ahead (`WorkerPools.listing`).
    var listingPool: WorkerPool { reader.pools.listing }

    /// All pages of a directory. `isCancelled` is the caller's: an interrupted `ls` ends the
    /// listing (others waiting on it then get the interruption too and ask again).
    func fetchListing(_ dirPath: String, isCancelled: (@Sendable () -> Bool)?) throws(FilesystemError) -> ListingSnapshot {
        try ListingFetch(self, dirPath, into: ListingStream(prefix: listingPrefix(of: dirPath)), isCancelled: isCancelled).rest()
    }

    /// A whole listing just fetched: logged shadows, cached for list_ttl (unless a newer one
    /// is there already), stored for offline use.
    @discardableResult
    func keepListing(_ dirPath: String, _ listing: DirectoryListing, fetched: Double,
                     learntByLookup: Bool = false) -> ListingSnapshot {
        let snapshot = ListingSnapshot(listing, fetched: fetched, learntByLookup: learntByLookup)
        for name in listing.shadowedFiles {
            let full = Self.join(dirPath, name)
            if shadowLogged.withLock({ $0.count < 65_536 && $0.insert(ByteName(full)).inserted }) {
                Log.info("object \(objectName(of: full)) is hidden by the directory of the same name")
            }
        }
        if config.listTTL > 0 {
            listings.withLock { l in
                if let current = l.last(ByteName(dirPath)), current.fetched > fetched { return }
                l.store(ByteName(dirPath), snapshot)
            }
        }
        firstPages.withLock { $0.forget(ByteName(dirPath)) }
        stored?.recordListing(dirPath, listing)
        return snapshot
    }

    /// Fetches the first listing page of `dirPath` in the background, beside a lookup that
    /// has to ask the bucket about a name in it: the next name looked up there is then
    /// answered from that page, with no request (docs/architecture.md, "Lookups in one round
    /// trip"). One page only, never a whole large directory for one name; a page that is the
    /// whole directory becomes its listing.
    @discardableResult
    func fetchFirstPage(_ dirPath: String, race: LookupRace? = nil) -> Bool {
        // Where listings give names only (Firebase v0), a page would answer little and its
        // names' sizes would cost a GET each: not worth a request per lookup.
        guard config.listTTL > 0, store.listingsCarrySizes else { return false }
        let dir = ByteName(dirPath)
        if freshSnapshot(dirPath) != nil || listingFlights.withLock({ $0[dir] != nil }) { return false }
        if let page = firstPages.withLock({ $0.page(dir) }), now() - page.fetched < config.listTTL { return false }
        guard firstPages.withLock({ $0.begin(dir) }) else { return false }
        // Beside a lookup, the page takes the warm connection now, before the lookup's probes
        // (sent next) can: they open connections of their own, and on a new mount the page,
        // which alone answers for every name it reaches, does not wait for a set-up.
        let claim = race == nil ? nil : (store as? any ConnectionTuning)?.claimIdleConnection()
        probePool.submit { [self] in
            let started = now()
            var kept: FirstPageCache.Page? = nil
            defer {
                firstPages.withLock { $0.end(dir, kept) }
                race?.pageLanded()
            }
            // No caller waits for it: a failure only means the next lookup asks for itself.
            guard let page = try? store.list(prefix: listingPrefix(of: dirPath), pageToken: nil, isCancelled: nil,
                                             connection: claim) else { return }
            kept = firstPage(dirPath, page, fetched: started)
        }
        return true
    }

    /// Keeps the first listing page of `dirPath`, fetched elsewhere (the mount's access
    /// check fetches the root's): it answers lookups there from now on.
    public func keepFirstPage(_ dirPath: String, _ page: ListPage) {
        guard config.listTTL > 0 else { return }
        let kept = firstPage(dirPath, page, fetched: now())
        firstPages.withLock { $0.end(ByteName(dirPath), kept) }
    }

    /// A page that is the whole directory becomes its listing (nil); a partial one is what
    /// to keep as its first page.
    private func firstPage(_ dirPath: String, _ page: ListPage, fetched: Double) -> FirstPageCache.Page? {
        let prefix = listingPrefix(of: dirPath)
        var builder = DirectoryListing.Builder(prefix: prefix)
        builder.add(page)
        if page.nextPageToken == nil {
            keepListing(dirPath, builder.build(), fetched: fetched, learntByLookup: true)
            return nil
        }
        return .init(listing: builder.build(), reached: FirstPageCache.reached(by: page, prefix: prefix), fetched: fetched)
    }

    /// The size of a listed file whose listing gave only its name (Firebase v0): from the path
    /// cache, else a metadata GET — with the next few unsized names of the same listing beside
    /// it, in parallel, since `ls -l` asks for them next (docs/protocol.md §2.4: a v0 listing
    /// costs one request per 1,000 names; sizes cost a GET each, only when asked for).
    func sized(_ path: String, in listing: DirectoryListing, at index: Int, parentPath: String,
               network: Network) throws(FilesystemError) -> (Node.Kind, Double) {
        let t = now()
        let key = ByteName(path)
        if let r = known.withLock({ $0.lookup(key, now: t, ttl: config.statTTL) }) {
            switch r.known {
            case .file(let record): return (.file(record), r.fetched)
            case .directory: return (.directory, r.fetched)
            case .missing: break
            }
        }
        if let node = table.withLock({ tb in tb.inode(of: key).flatMap { tb.nodes[$0] } }), t - node.fetched < config.statTTL {
            return (node.kind, node.fetched)
        }
        if health.outage != nil, case .success(let answer)? = lastKnown(path, parentPath: parentPath, name: listing.names[index]) {
            return answer
        }
        if let refused = health.refusal { throw FilesystemError(refused) }
        guard case .allowed(let isCancelled) = network else { throw FilesystemError(.wouldBlock, "size of \(path) needs the bucket") }
        let asking = try admitted()
        defer { asking?.end() }
        var batch = [index]
        var i = index + 1
        while batch.count < max(1, config.metadataParallelism), i < listing.count {
            if listing.entries[i] == .unsizedFile {
                let p = ByteName(Self.join(parentPath, listing.names[i]))
                if known.withLock({ $0.lookup(p, now: t, ttl: config.statTTL) }) == nil { batch.append(i) }
            }
            i += 1
        }
        let names = batch.map { objectName(of: Self.join(parentPath, listing.names[$0])) }
        let results = ParallelMap.run(names, width: config.metadataParallelism) { name -> Result<ObjectMetadata, StorageError> in
            do throws(StorageError) { return .success(try self.store.metadata(of: name, isCancelled: isCancelled)) } catch { return .failure(error) }
        }
        let fetched = now()
        for (k, result) in results.enumerated() where k > 0 {
            if case .success(let meta) = result {
                known.withLock { $0.remember(ByteName(Self.join(parentPath, listing.names[batch[k]])), .file(FileRecord(meta)), at: fetched) }
            }
        }
        switch results[0] {
        case .success(let meta):
            health.noteSuccess()
            fullMetadata.withLock { $0.remember(key, meta, at: fetched) }
            return (.file(FileRecord(meta)), fetched)
        case .failure(let error):
            health.note(error)
            if error.code == .notFound {
                if config.negativeTTL > 0 { known.withLock { $0.remember(key, .missing, at: fetched) } }
                throw FilesystemError(.noEntry, "no \(path) (it vanished after the listing)")
            }
            Log.warn("lookup failed", ["op": "lookup", "path": path, "error": error.message])
            throw FilesystemError(error)
        }
    }
}

/// A directory listing under way, which later askers wait for and open handles read as it
/// arrives.
typealias ListingFlight = ListingStream

/// What an open directory handle reads: a whole listing, one still arriving, or a
/// directory of the manifest's index.
enum DirectorySource: Sendable {
    case snapshot(ListingSnapshot)
    case stream(ListingStream)
    case manifest(ManifestDirectory)

    func entry(at index: Int) -> (String, DirectoryListing.Entry)? {
        switch self {
        case .snapshot(let s): return index < s.listing.count ? (s.listing.names[index], s.listing.entries[index]) : nil
        case .stream(let st): return st.entry(at: index)
        case .manifest(let dir): return dir.entry(at: index)
        }
    }

    /// When the listing's first page was asked for (nil while it is arriving; for the
    /// manifest, never too long ago: it does not expire).
    var fetched: Double? {
        switch self {
        case .snapshot(let s): return s.fetched
        case .stream(let st): return st.snapshot?.fetched
        case .manifest: return .infinity
        }
    }
}

/// What `openDirectory` returns: the handle readdir reads, and, for a listing the opener
/// fetches, the rest of its pages, fetched when the caller finishes it (after its reply, on
/// its thread). Dropped unfinished, it finishes as it goes: a listing is never left half done.
public struct OpenedDirectory: ~Copyable {
    public let handle: UInt64
    private let rest: ListingRest?

    init(handle: UInt64, rest: (@Sendable () -> Void)? = nil) {
        self.handle = handle
        self.rest = rest.map(ListingRest.init)
    }

    /// Fetches the rest of the listing (nothing when it was whole already).
    public consuming func finishListing() {}

    deinit { rest?.run() }
}

/// The rest of a listing, run once.
private final class ListingRest: @unchecked Sendable {
    private var work: (@Sendable () -> Void)?

    init(_ work: @escaping @Sendable () -> Void) { self.work = work }

    func run() {
        let w = work
        work = nil
        w?()
    }
}

/// One directory's listing fetched page by page into its stream: the pages are bounded (a
/// server that loops, or sends more than `listingEntryLimit` entries, or more than all
/// listings together may hold, is refused), the bucket's health hears of it, and the whole
/// listing is kept (`keepListing`). During an outage one operation at a time asks
/// (`BucketHealth`): the fetch holds that turn until it ends.
final class ListingFetch: @unchecked Sendable {
    private let fs: Filesystem
    private let dirPath: String
    private let prefix: String
    private let stream: ListingStream
    private let isCancelled: (@Sendable () -> Bool)?
    private let asking: BucketHealth.Probe?
    private let started = now()
    private var token: String? = nil
    private var seenTokens = Set<String>()
    private var entries = 0
    private var pages = 0

    init(_ fs: Filesystem, _ dirPath: String, into stream: ListingStream,
         isCancelled: (@Sendable () -> Bool)?) throws(FilesystemError) {
        self.fs = fs
        self.dirPath = dirPath
        self.prefix = fs.listingPrefix(of: dirPath)
        self.stream = stream
        self.isCancelled = isCancelled
        asking = try fs.admitted()
    }

    deinit {
        fs.listingEntriesInFlight.subtract(entries, ordering: .relaxed)
        asking?.end()
    }

    /// Fetches the next page into the stream: true when it was the last.
    func nextPage() throws(FilesystemError) -> Bool {
        do throws(StorageError) {
            let page = try fs.store.list(prefix: prefix, pageToken: token, isCancelled: isCancelled)
            let added = page.items.count + page.prefixes.count
            entries += added
            let inFlight = fs.listingEntriesInFlight.add(added, ordering: .relaxed).newValue
            token = page.nextPageToken
            stream.add(page, last: token == nil)
            pages += 1
            // A hostile or broken server must not hold `ls` forever, nor fill memory.
            if let t = token, !seenTokens.insert(t).inserted {
                throw StorageError(.invalidResponse, "list gs://\(fs.reference.bucket)/\(prefix): the server repeated a page token (the listing loops)")
            }
            if entries > fs.config.listingEntryLimit {
                throw StorageError(.invalidResponse, "list gs://\(fs.reference.bucket)/\(prefix): more than \(fs.config.listingEntryLimit) entries in one directory")
            }
            if inFlight > fs.config.listingEntriesInFlightLimit {
                throw StorageError(.invalidResponse,
                                   "list gs://\(fs.reference.bucket)/\(prefix): the listings being fetched at once hold more than \(fs.config.listingEntriesInFlightLimit) entries")
            }
            return token == nil
        } catch {
            throw failed(error)
        }
    }

    /// Fetches every page left and keeps the listing; during an outage an expired listing of
    /// the directory answers instead of an error.
    func rest() throws(FilesystemError) -> ListingSnapshot {
        do throws(FilesystemError) {
            while pages == 0 || token != nil {
                if try nextPage() { break }
            }
        } catch {
            return try recover(from: error)
        }
        return keep()
    }

    /// A page failed: while the bucket is unreachable an expired listing of the directory
    /// answers, if there is one; otherwise the error stands.
    func recover(from error: FilesystemError) throws(FilesystemError) -> ListingSnapshot {
        guard case .storage(let code) = error.code, Filesystem.isOutage(code),
              let old = fs.listings.withLock({ $0.last(ByteName(dirPath)) }) else { throw error }
        Log.info("op=readdir prefix=\(prefix) answering from an expired listing: \(error.message)")
        return old
    }

    /// The listing is whole: kept and returned.
    func keep() -> ListingSnapshot {
        fs.health.noteSuccess()
        return fs.keepListing(dirPath, stream.listing(), fetched: started)
    }

    private func failed(_ error: StorageError) -> FilesystemError {
        fs.health.note(error)
        Log.warn("listing failed", ["op": "readdir", "prefix": prefix, "error": error.message])
        return FilesystemError(error)
    }
}
