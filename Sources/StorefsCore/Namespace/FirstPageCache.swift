import StorageClient

/// First listing pages of directories that were not listed whole (docs/architecture.md,
/// "Lookups in one round trip"): when a lookup has to ask the bucket about a name, the first
/// page of its parent is fetched beside it, so the next name looked up in that directory is
/// answered without a request. A page that is the whole directory becomes an ordinary listing
/// (`ListingCache`); a partial one is kept here and answers only for names it covers.
///
/// Bounded: at most `maxPages` pages (each one server page, ≤1,000 entries on GCS), the
/// least recently stored go first.
struct FirstPageCache {
    static let maxPages = 64

    struct Page {
        let listing: DirectoryListing
        /// The greatest object name the page reached (relative to the directory, byte order,
        /// directories with their trailing `/`): every name up to it is in the page or absent.
        let reached: ByteName
        let fetched: Double
    }

    private var pages: [ByteName: (page: Page, sequence: UInt64)] = [:]
    private var nextSequence: UInt64 = 0
    /// Directories whose first page is being fetched.
    private(set) var inFlight = Set<ByteName>()

    var count: Int { pages.count }

    /// Claims the fetch of `dir`'s first page; false when it is under way already.
    mutating func begin(_ dir: ByteName) -> Bool { inFlight.insert(dir).inserted }

    mutating func end(_ dir: ByteName, _ page: Page?) {
        inFlight.remove(dir)
        guard let page else { return }
        if pages[dir] == nil, pages.count >= Self.maxPages,
           let oldest = pages.min(by: { $0.value.sequence < $1.value.sequence })?.key {
            pages.removeValue(forKey: oldest)
        }
        nextSequence += 1
        pages[dir] = (page, nextSequence)
    }

    func page(_ dir: ByteName) -> Page? { pages[dir]?.page }

    mutating func forget(_ dir: ByteName) { pages.removeValue(forKey: dir) }

    /// What the page says about `name`: its entry, `.some(nil)` for "absent", or nil when the
    /// page does not reach far enough to say (a same-named directory, `name/`, sorts after the
    /// file `name`, so both must be covered: a directory wins over a file).
    static func answer(_ page: Page, name: String) -> DirectoryListing.Entry?? {
        guard ByteName(name + "/") <= page.reached else { return nil }
        return .some(page.listing[name: name])
    }

    /// The greatest name a page reached, relative to `prefix`.
    static func reached(by page: ListPage, prefix: String) -> ByteName {
        var best = ByteName("")
        for name in page.items.map(\.name) + page.prefixes where name.hasBytePrefix(prefix) {
            let rel = ByteName(name.droppingBytes(prefix.utf8.count))
            if best < rel { best = rel }
        }
        return best
    }
}
