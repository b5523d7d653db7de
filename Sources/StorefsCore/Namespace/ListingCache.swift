import StorageClient

/// One listing of a directory: what every handle opened on it reads, shared and immutable.
final class ListingSnapshot: Sendable {
    let listing: DirectoryListing
    /// Monotonic time the listing's first page was asked for.
    let fetched: Double
    /// Fetched beside a lookup (a first page that was the whole directory), not because
    /// someone listed the directory: its names are vouched for `stat_ttl` only, as the
    /// lookup's own answer would be (README, "Namespace semantics": what is remembered).
    let learntByLookup: Bool

    init(_ listing: DirectoryListing, fetched: Double, learntByLookup: Bool = false) {
        self.listing = listing
        self.fetched = fetched
        self.learntByLookup = learntByLookup
    }

    var names: [String] { listing.names }
}

/// Directory listings kept for `list_ttl` (docs/architecture.md, "Metadata memory"), bounded
/// by the entries they hold (`metadata_cache_size`) and by their number; the least recently
/// stored go first. An open directory handle keeps its own snapshot alive whatever happens
/// here, so eviction never changes what a `readdir` in progress sees.
struct ListingCache {
    /// Bound on cached listings, whatever their size.
    static let maxListings = 4096

    let capacity: Int
    private var listings: [ByteName: (snapshot: ListingSnapshot, sequence: UInt64)] = [:]
    /// Listings of open directories: while a handle is open its listing answers lookups even
    /// if the cache evicted it (`du` and `ls -l` look up every name of the directory they
    /// read). Costs nothing: the handles hold these snapshots anyway.
    private var pinned: [ByteName: (snapshot: ListingSnapshot?, count: Int)] = [:]
    private(set) var entryCount = 0
    private var nextSequence: UInt64 = 0

    init(capacity: Int) { self.capacity = max(1024, capacity) }

    var count: Int { listings.count }

    /// The listing of `dir`, however old.
    func last(_ dir: ByteName) -> ListingSnapshot? { listings[dir]?.snapshot ?? pinned[dir]?.snapshot }

    /// Whether the cache has room for listings fetched ahead of need (a quarter is kept free
    /// for the listings a walker opens, so fetching ahead never evicts what is in use).
    var hasRoomForPrefetch: Bool { entryCount < capacity * 3 / 4 }

    /// A handle is open on `dir`, reading `snapshot` (nil: a listing still arriving, which
    /// `store` pins when it is whole).
    mutating func pin(_ dir: ByteName, _ snapshot: ListingSnapshot?) {
        let count = (pinned[dir]?.count ?? 0) + 1
        pinned[dir] = (newest(pinned[dir]?.snapshot, snapshot), count)
    }

    private func newest(_ a: ListingSnapshot?, _ b: ListingSnapshot?) -> ListingSnapshot? {
        guard let a else { return b }
        guard let b else { return a }
        return a.fetched > b.fetched ? a : b
    }

    mutating func unpin(_ dir: ByteName) {
        guard let p = pinned[dir] else { return }
        pinned[dir] = p.count > 1 ? (p.snapshot, p.count - 1) : nil
    }

    mutating func store(_ dir: ByteName, _ snapshot: ListingSnapshot) {
        if let p = pinned[dir] { pinned[dir] = (newest(p.snapshot, snapshot), p.count) }
        if let old = listings.removeValue(forKey: dir) { entryCount -= old.snapshot.listing.count }
        // A listing larger than the whole budget is not kept (its handles still have it).
        guard snapshot.listing.count <= capacity else { return }
        while !listings.isEmpty && (entryCount + snapshot.listing.count > capacity || listings.count >= Self.maxListings) {
            evictOldest()
        }
        nextSequence += 1
        listings[dir] = (snapshot, nextSequence)
        entryCount += snapshot.listing.count
    }

    mutating func invalidate(_ dir: ByteName) {
        if let old = listings.removeValue(forKey: dir) { entryCount -= old.snapshot.listing.count }
        if let p = pinned[dir] { pinned[dir] = (nil, p.count) }
    }

    /// Drops the oldest eighth of the listings (at least one).
    private mutating func evictOldest() {
        let drop = max(1, listings.count / 8)
        let cutoff = listings.values.map(\.sequence).sorted()[drop - 1]
        for (dir, value) in listings where value.sequence <= cutoff {
            listings.removeValue(forKey: dir)
            entryCount -= value.snapshot.listing.count
        }
    }
}
