import Locking
import Foundation
import StorageClient

/// A directory listing while its pages arrive (docs/architecture.md, "Listings as they
/// arrive"): the one fetch of a directory that every asker shares. Lookups wait for the whole
/// listing (`wait`); open directory handles read its entries as soon as they are settled, so
/// `find` or `ls -f` of a 100,000-entry directory gets its first names after one page, not
/// after a hundred.
///
/// Entries are handed out in byte order of their names, the order of the finished listing, so
/// a handle's offsets mean the same before and after the last page. A page's names are not
/// all settled when it lands: pages come in byte order of *keys*, and a directory's key is its
/// name plus `/`. A file `a-b` (key `a-b`) comes before the directory `a` (key `a/`, since `-`
/// sorts before `/`) but is listed after it, and a file `a` is hidden if `a/` follows. A name
/// is therefore held back while some prefix of it, followed by `/`, could still come: while
/// the last key seen starts with that prefix and continues with a byte below `/` or ends
/// there. In practice only names that share such a prefix with a page's last key wait.
///
/// A server whose pages are out of order (a later page with keys before an earlier page's
/// last) breaks that reasoning: the stream then hands out nothing more until the listing is
/// whole (built by `DirectoryListing.Builder` from then on), and then the rest of it.
final class ListingStream: @unchecked Sendable {
    private let condition = OrderedCondition(.listingStream)
    private let prefix: String
    private let skip: Int
    private var wantChildren = false

    /// Settled entries, in byte order of names: readdir offset 2 + i is entry i.
    private var names: [String] = []
    private var entries: [DirectoryListing.Entry] = []
    /// Seen, not yet settled, in byte order of names.
    private var pending: [(name: ByteName, entry: DirectoryListing.Entry)] = []
    /// Files hidden by a directory of the same name.
    private var shadowed: [String] = []
    /// The largest key (relative to the directory) of the pages so far.
    private var lastKey: [UInt8] = []
    private var pagesSeen = 0
    /// Set when the pages came out of order: from then on the listing is built the way a
    /// whole listing is (`DirectoryListing.Builder`), and handed out when whole.
    private var unordered: DirectoryListing.Builder?
    private var result: Result<ListingSnapshot, FilesystemError>?

    /// `prefix`: the directory's listing prefix (`""` or ending in `/`).
    init(prefix: String) {
        self.prefix = prefix
        skip = prefix.utf8.count
    }

    // MARK: the fetch

    /// Adds a page (whose names all start with the prefix); `last` when no page follows.
    func add(_ page: ListPage, last: Bool) {
        var found: [(name: ByteName, entry: DirectoryListing.Entry)] = []
        found.reserveCapacity(page.items.count + page.prefixes.count)
        var maxKey: [UInt8] = []
        for p in page.prefixes where p.utf8.count > skip && p.hasBytePrefix(prefix) {
            let key = Array(p.utf8.dropFirst(skip))
            if maxKey.lexicographicallyPrecedes(key) { maxKey = key }
            guard key.last == UInt8(ascii: "/") else { continue }
            let rel = String(decoding: key.dropLast(), as: UTF8.self)
            if !rel.containsSlash, DirectoryListing.isRepresentable(rel) { found.append((ByteName(rel), .directory)) }
        }
        for item in page.items where item.name.utf8.count > skip && item.name.hasBytePrefix(prefix) {
            let key = Array(item.name.utf8.dropFirst(skip))
            if maxKey.lexicographicallyPrecedes(key) { maxKey = key }
            let rel = String(decoding: key, as: UTF8.self)
            if rel.containsSlash {
                // A trailing-slash item (`x/` under includeTrailingDelimiter) marks a directory.
                let parts = rel.slashComponents
                if parts.count == 2, parts[1].isEmpty, DirectoryListing.isRepresentable(parts[0]) {
                    found.append((ByteName(parts[0]), .directory))
                }
            } else if DirectoryListing.isRepresentable(rel) {
                found.append((ByteName(rel), page.metadataComplete ? .file(FileRecord(item)) : .unsizedFile))
            }
        }
        found.sort { $0.name < $1.name }
        condition.lock()
        defer { condition.unlock() }
        pagesSeen += 1
        if unordered == nil { merge(found) }
        if var builder = unordered {
            unordered = nil
            for (name, entry) in found { builder.add(name, entry) }
            unordered = builder
        } else {
            if lastKey.lexicographicallyPrecedes(maxKey) { lastKey = maxKey }
            settle(all: last)
        }
        condition.broadcast()
    }

    /// The whole listing, once the last page is in: the entries handed out, in order (or,
    /// out of order, what the builder made of every page).
    func listing() -> DirectoryListing {
        condition.lock()
        defer { condition.unlock() }
        if let builder = unordered { return builder.build() }
        settle(all: true)
        return DirectoryListing(names: names, entries: entries, shadowedFiles: shadowed.sorted { ByteName($0) < ByteName($1) })
    }

    /// The listing is whole (or failed). In order, what was handed out is exactly the
    /// listing's beginning; out of order, the rest of the listing follows what was. Returns
    /// whether a reader asked for the sub-directories to be listed ahead (`listChildrenWhenDone`).
    @discardableResult
    func finish(_ r: Result<ListingSnapshot, FilesystemError>) -> Bool {
        condition.lock()
        defer { condition.unlock() }
        if case .success(let snapshot) = r {
            let listing = snapshot.listing
            if listing.names.count == names.count, zip(listing.names, names).allSatisfy({ $0.utf8.elementsEqual($1.utf8) }) {
                // The same entries (what `listing()` made of them): share its arrays.
                names = listing.names
                entries = listing.entries
            } else {
                var given = Set(names.map(ByteName.init))
                for (i, name) in listing.names.enumerated() where given.insert(ByteName(name)).inserted {
                    names.append(name)
                    entries.append(listing.entries[i])
                }
            }
            pending = []
            unordered = nil
        }
        result = r
        condition.broadcast()
        return wantChildren
    }

    // MARK: readers

    /// A walker opened the directory before its listing was whole: its sub-directories should
    /// be listed ahead once it is. True when it is whole already (the caller does it then).
    func listChildrenWhenDone() -> Bool {
        condition.lock()
        defer { condition.unlock() }
        if result != nil { return true }
        wantChildren = true
        return false
    }

    /// Whether the first page (or the end) has been seen.
    var hasStarted: Bool {
        condition.lock()
        defer { condition.unlock() }
        return pagesSeen > 0 || result != nil
    }

    /// Waits for the first page or the end; false when `isCancelled` said so first. A failure
    /// before any page is thrown.
    func waitForStart(isCancelled: (@Sendable () -> Bool)?) throws(FilesystemError) -> Bool {
        condition.lock()
        defer { condition.unlock() }
        while pagesSeen == 0 && result == nil {
            if !pause(isCancelled) { return false }
        }
        if pagesSeen == 0, case .failure(let e)? = result { throw e }
        return true
    }

    /// The whole listing; nil when `isCancelled` said so first.
    func wait(isCancelled: (@Sendable () -> Bool)? = nil) -> Result<ListingSnapshot, FilesystemError>? {
        condition.lock()
        defer { condition.unlock() }
        while result == nil {
            if !pause(isCancelled) { return nil }
        }
        return result
    }

    /// Up to `limit` settled entries from `index` on: some as soon as there are any, `[]` at
    /// the end. `wait: false` returns nil instead of waiting; a wait `isCancelled` ended is
    /// `.cancelled`. A listing that failed gives its error once its entries are read.
    func entries(from index: Int, limit: Int, wait: Bool,
                 isCancelled: (@Sendable () -> Bool)?) throws(FilesystemError) -> [(String, DirectoryListing.Entry)]? {
        condition.lock()
        defer { condition.unlock() }
        while index >= names.count && result == nil {
            if !wait { return nil }
            if !pause(isCancelled) { throw FilesystemError(.storage(.cancelled), "listing interrupted") }
        }
        if index >= names.count {
            if case .failure(let e)? = result { throw e }
            return []
        }
        let end = index + min(limit, names.count - index)
        return (index..<end).map { (names[$0], entries[$0]) }
    }

    /// The settled entry at `index`, if it is settled.
    func entry(at index: Int) -> (String, DirectoryListing.Entry)? {
        condition.lock()
        defer { condition.unlock() }
        return index < names.count ? (names[index], entries[index]) : nil
    }

    /// The finished listing, if the fetch succeeded.
    var snapshot: ListingSnapshot? {
        condition.lock()
        defer { condition.unlock() }
        if case .success(let s)? = result { return s }
        return nil
    }

    // MARK: internals (under the lock)

    private func pause(_ isCancelled: (@Sendable () -> Bool)?) -> Bool {
        guard let isCancelled else {
            condition.wait()
            return true
        }
        if isCancelled() { return false }
        _ = condition.wait(until: Date().addingTimeInterval(0.05))
        return true
    }

    /// Merges a page's entries (sorted by name) into `pending`, a directory winning over a
    /// file of its name. An entry that sorts before what was already handed out means the
    /// pages are out of order (a repeated directory, which servers may send at a page
    /// boundary, is not): the builder takes over.
    private func merge(_ found: [(name: ByteName, entry: DirectoryListing.Entry)]) {
        var page = found[...]
        if let settled = names.last.map(ByteName.init) {
            while let e = page.first, !(settled < e.name) {
                if e.entry == .directory, let i = DirectoryListing.index(of: e.name.string, in: names), entries[i] == .directory {
                    page = page.dropFirst()
                    continue
                }
                var builder = DirectoryListing.Builder(prefix: prefix)
                for (i, name) in names.enumerated() { builder.add(ByteName(name), entries[i]) }
                for (name, entry) in pending { builder.add(name, entry) }
                unordered = builder
                return
            }
        }
        var merged: [(name: ByteName, entry: DirectoryListing.Entry)] = []
        merged.reserveCapacity(pending.count + page.count)
        var a = pending[...], b = page
        while !a.isEmpty || !b.isEmpty {
            let next: (name: ByteName, entry: DirectoryListing.Entry)
            if let x = a.first, b.first.map({ !($0.name < x.name) }) ?? true {
                next = x
                a = a.dropFirst()
            } else {
                next = b.first!
                b = b.dropFirst()
            }
            if let last = merged.last, last.name == next.name {
                if last.entry == .directory && next.entry == .directory { continue }
                let file = last.entry == .directory ? next : last
                shadowed.append(file.name.string)
                merged[merged.count - 1] = (next.name, .directory)
                continue
            }
            merged.append(next)
        }
        pending = merged
    }

    /// Hands out pending entries from the front while no later page can put anything before
    /// them or hide them (all of them after the last page).
    private func settle(all: Bool) {
        var k = 0
        while k < pending.count, all || !heldBack(pending[k]) {
            names.append(pending[k].name.string)
            entries.append(pending[k].entry)
            k += 1
        }
        pending.removeFirst(k)
    }

    /// Whether a later page could still bring a name that sorts before `e` or hides it: a
    /// directory named by a prefix `p` of it (all of it, for a file) whose key `p/` is after
    /// the last key seen. Every seen name is at most that key, so `p` must be where the name
    /// and the last key agree, and the key must end there or go on with a byte below `/`.
    private func heldBack(_ e: (name: ByteName, entry: DirectoryListing.Entry)) -> Bool {
        let name = Array(e.name.string.utf8)
        let isFile = e.entry != .directory
        var j = 0
        while j < name.count && j < lastKey.count && name[j] == lastKey[j] {
            j += 1
            // p = name[0..<j]: a proper prefix, or the whole name of a file.
            if j < name.count || isFile {
                if j == lastKey.count || lastKey[j] < UInt8(ascii: "/") { return true }
            }
        }
        return false
    }
}
