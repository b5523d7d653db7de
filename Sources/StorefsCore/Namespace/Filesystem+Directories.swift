import StorageClient

/// Directories: listings (fetched once, shared by every handle, cached for `list_ttl`),
/// readdir, readdirplus, listing ahead, and the sizes Firebase v0 listings leave out.
extension Filesystem {
    /// Lists a directory (from cache when fresh) and pins its snapshot for readdir offsets. The
    /// snapshot is shared with the listing cache and other handles: a handle costs a
    /// reference, not a copy of the directory (a local user may open many).
    public func openDirectory(_ inode: UInt64, network: Network = .allowed) throws(FilesystemError) -> UInt64 {
        let path = try directoryPath(inode)
        let snapshot = try fullListing(path, network: network)
        prefetchListings(under: path, snapshot.listing)
        listings.withLock { $0.pin(ByteName(path), snapshot) }
        return handles.withLock { $0.add(.directory(path: path, inode: inode, snapshot: snapshot)) }
    }

    /// At most `limit` entries of an open directory from `offset` on (offsets are positions in
    /// the snapshot, `.` and `..` first). Work is proportional to the entries returned.
    public func readDirectory(_ handle: UInt64, from offset: Int, limit: Int = Int.max) throws(FilesystemError) -> [DirectoryEntry] {
        let (path, inode, snapshot) = try directorySnapshot(handle)
        let names = snapshot.listing.names
        let start = max(0, offset)
        guard start < names.count + 2 else { return [] }
        let end = start + min(names.count + 2 - start, max(0, limit))
        guard start < end else { return [] }
        var out: [DirectoryEntry] = []
        out.reserveCapacity(end - start)
        var paths: [ByteName] = []
        for i in start..<end where i >= 2 { paths.append(ByteName(Self.join(path, names[i - 2]))) }
        let parentPath = ByteName(Self.split(path).parent)
        let (known, parent) = table.withLock { t in (paths.map { t.inode(of: $0) }, path.isEmpty ? inode : t.inode(of: parentPath)) }
        for i in start..<end {
            if i < 2 {
                // `..` is the parent (the root's own parent is itself), as a directory's
                // `..` should be for tools that compare inode numbers.
                out.append(DirectoryEntry(name: i == 0 ? "." : "..", inode: i == 0 ? inode : parent ?? inode, kind: .directory,
                                          nextOffset: i + 1))
                continue
            }
            let kind: FileAttributes.Kind
            switch snapshot.listing.entries[i - 2] {
            case .directory: kind = .directory
            case .file(let r): kind = isSymlink(r) ? .symlink : .file
            case .unsizedFile: kind = .file
            }
            let k = i - max(2, start)
            out.append(DirectoryEntry(name: names[i - 2], inode: known[k] ?? Self.inodeNumber(paths[k].string), kind: kind,
                                      nextOffset: i + 1))
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
        let (path, _, snapshot) = try directorySnapshot(handle)
        let listing = snapshot.listing
        let t = now()
        var wanted: [(Int, String, Node.Kind)] = []
        wanted.reserveCapacity(offsets.count)
        for offset in offsets where offset >= 2 && offset - 2 < listing.count {
            let childPath = Self.join(path, listing.names[offset - 2])
            switch listing.entries[offset - 2] {
            case .directory: wanted.append((offset, childPath, .directory))
            case .file(let r): wanted.append((offset, childPath, .file(r)))
            case .unsizedFile:
                if case .file(let r)? = known.withLock({ $0.lookup(ByteName(childPath), now: t, ttl: config.statTTL)?.known }) {
                    wanted.append((offset, childPath, .file(r)))
                }
            }
        }
        let registered = table.withLock { tb in
            wanted.map { (offset, childPath, kind) in
                (offset, tb.upsert(path: childPath, kind: kind, at: snapshot.fetched > -.infinity ? snapshot.fetched : t,
                                   countLookup: true))
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

    func directorySnapshot(_ handle: UInt64) throws(FilesystemError) -> (String, UInt64, ListingSnapshot) {
        guard case .directory(let path, let inode, let snapshot)? = handles.withLock({ $0.open[handle] }) else {
            throw FilesystemError(.staleHandle, "unknown directory handle \(handle)")
        }
        return (path, inode, snapshot)
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

    /// Cached listings and the entries they hold (tests).
    var cachedListingCounts: (listings: Int, entries: Int) { listings.withLock { ($0.count, $0.entryCount) } }

    /// The whole listing of a directory: every page, prefixes de-duplicated, cached for list_ttl.
    func fullListing(_ dirPath: String, network: Network = .allowed) throws(FilesystemError) -> ListingSnapshot {
        if let l = freshSnapshot(dirPath) { return l }
        if let outage = health.outage {
            guard let old = listings.withLock({ $0.last(ByteName(dirPath)) }) else { throw FilesystemError(outage) }
            Log.info("op=readdir path=\(dirPath) answering from a stale listing (the bucket is unreachable: \(outage.message))")
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

    var listingPool: WorkerPool {
        listingPoolSlot.withLock { p in
            if p == nil { p = WorkerPool(threads: 4, name: "storefs-list") }
            return p!
        }
    }

    /// All pages of a directory. `isCancelled` is the caller's: an interrupted `ls` ends the
    /// listing (others waiting on it then get the interruption too and ask again).
    func fetchListing(_ dirPath: String, isCancelled: (@Sendable () -> Bool)?) throws(FilesystemError) -> ListingSnapshot {
        let prefix = listingPrefix(of: dirPath)
        let started = now()
        var builder = DirectoryListing.Builder(prefix: prefix)
        var token: String? = nil
        var seenTokens = Set<String>()
        var entries = 0
        do throws(StorageError) {
            repeat {
                let page = try store.list(prefix: prefix, pageToken: token, isCancelled: isCancelled)
                builder.add(page)
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
            if Self.isOutage(error.code), let old = listings.withLock({ $0.last(ByteName(dirPath)) }) {
                Log.info("op=readdir prefix=\(prefix) answering from an expired listing: \(error.message)")
                return old
            }
            Log.warn("listing failed", ["op": "readdir", "prefix": prefix, "error": error.message])
            throw FilesystemError(error)
        }
        return keepListing(dirPath, builder.build(), fetched: started)
    }

    /// A whole listing just fetched: logged shadows, cached for list_ttl (unless a newer one
    /// is there already), stored for offline use.
    @discardableResult
    func keepListing(_ dirPath: String, _ listing: DirectoryListing, fetched: Double) -> ListingSnapshot {
        let snapshot = ListingSnapshot(listing, fetched: fetched)
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
        probePool.submit { [self] in
            let started = now()
            var kept: FirstPageCache.Page? = nil
            defer {
                firstPages.withLock { $0.end(dir, kept) }
                race?.pageLanded()
            }
            race?.pageSent()
            // No caller waits for it: a failure only means the next lookup asks for itself.
            guard let page = try? store.list(prefix: listingPrefix(of: dirPath), pageToken: nil, isCancelled: nil) else { return }
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
            keepListing(dirPath, builder.build(), fetched: fetched)
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
        if let outage = health.outage {
            if case .success(let answer)? = lastKnown(path, parentPath: parentPath, name: listing.names[index]) { return answer }
            throw FilesystemError(outage)
        }
        guard case .allowed(let isCancelled) = network else { throw FilesystemError(.wouldBlock, "size of \(path) needs the bucket") }
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

/// A directory listing under way, which later askers wait for.
typealias ListingFlight = Awaited<Result<ListingSnapshot, FilesystemError>>
