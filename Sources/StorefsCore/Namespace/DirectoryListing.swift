import StorageClient

/// One directory's entries, merged from the pages of a delimited listing (README, "Namespace semantics").
///
/// - Sub-prefixes become directories; a directory shadows a same-named file.
/// - The placeholder object equal to the listed prefix (`dir/`) is not an entry of its own.
/// - Names that cannot be a path component are hidden, never mangled: empty (`a//b`), `.`,
///   `..`, and anything over 255 bytes.
public struct DirectoryListing: Sendable {
    public enum Entry: Sendable, Equatable {
        case directory
        case file(FileRecord)
        /// A file whose listing gave only its name (Firebase v0, docs/protocol.md §2.4): its
        /// size comes from a metadata GET when something asks (`stat`, a lookup).
        case unsizedFile
    }

    /// Entry names in byte order (stable readdir offsets), and their entries at the same
    /// positions: two arrays, no per-entry dictionary node (docs/architecture.md, "Metadata
    /// memory"). Names are found by binary search on their bytes.
    public let names: [String]
    public let entries: [Entry]
    /// Files hidden because a directory of the same name exists (logged once by the caller).
    public let shadowedFiles: [String]

    public init() {
        names = []
        entries = []
        shadowedFiles = []
    }

    public var count: Int { names.count }

    /// The entry called `name` (compared as bytes).
    public subscript(name name: String) -> Entry? {
        index(of: name).map { entries[$0] }
    }

    /// The position of `name` in `names`, by binary search on bytes.
    public func index(of name: String) -> Int? { Self.index(of: name, in: names) }

    /// The position of `name` in `names` (sorted by bytes), by binary search on bytes.
    static func index(of name: String, in names: [String]) -> Int? {
        var lo = 0, hi = names.count
        while lo < hi {
            let mid = (lo + hi) / 2
            if names[mid].utf8.lexicographicallyPrecedes(name.utf8) { lo = mid + 1 } else { hi = mid }
        }
        return lo < names.count && names[lo].utf8.elementsEqual(name.utf8) ? lo : nil
    }

    /// The longest path component, in bytes (Linux's NAME_MAX): longer names are hidden, and
    /// `statfs` says so (`f_namemax`).
    public static let maxNameBytes = 255

    /// Whether `name` can appear as a path component exactly as stored.
    public static func isRepresentable(_ name: String) -> Bool {
        let b = name.utf8
        return !b.isEmpty && !b.elementsEqual(".".utf8) && !b.elementsEqual("..".utf8) && b.count <= maxNameBytes && !b.contains(0)
    }

    /// Builds the listing of `prefix` (`""` or ending in `/`) from all its pages.
    public init(prefix: String, pages: [ListPage]) {
        var builder = Builder(prefix: prefix)
        for page in pages { builder.add(page) }
        self = builder.build()
    }

    /// Entries already in byte order of names, each name once (`ListingStream`).
    init(names: [String], entries: [Entry], shadowedFiles: [String]) {
        self.names = names
        self.entries = entries
        self.shadowedFiles = shadowedFiles
    }

    /// Takes a listing's pages one at a time, keeping only compact entries: a page's object
    /// resources are dropped as soon as it is added (a 100,000-entry directory never holds
    /// 100,000 of them).
    public struct Builder {
        let prefix: String
        private var dirs = Set<ByteName>()
        private var files: [ByteName: Entry] = [:]

        public init(prefix: String) { self.prefix = prefix }

        public var count: Int { dirs.count + files.count }

        public mutating func add(_ page: ListPage) {
            let skip = prefix.utf8.count
            for p in page.prefixes where p.hasBytePrefix(prefix) && p.endsWithSlash && p.utf8.count > skip {
                let rel = p.droppingBytes(skip).droppingLastByte
                if !rel.containsSlash, DirectoryListing.isRepresentable(rel) { dirs.insert(ByteName(rel)) }
            }
            for item in page.items where item.name.hasBytePrefix(prefix) {
                let rel = item.name.droppingBytes(skip)
                if rel.isEmpty { continue }  // the placeholder of this very directory
                if rel.containsSlash {
                    // Without a delimiter match this would be deeper; a trailing-slash item
                    // (`x/` under includeTrailingDelimiter) marks a directory.
                    let parts = rel.slashComponents
                    if parts.count == 2, parts[1].isEmpty, DirectoryListing.isRepresentable(parts[0]) {
                        dirs.insert(ByteName(parts[0]))
                    }
                    continue
                }
                if DirectoryListing.isRepresentable(rel) {
                    files[ByteName(rel)] = page.metadataComplete ? .file(FileRecord(item)) : .unsizedFile
                }
            }
        }

        /// One entry, already relative to the prefix and representable.
        mutating func add(_ name: ByteName, _ entry: Entry) {
            if entry == .directory { dirs.insert(name) } else { files[name] = entry }
        }

        public func build() -> DirectoryListing {
            var all: [(ByteName, Entry)] = []
            all.reserveCapacity(dirs.count + files.count)
            for d in dirs { all.append((d, .directory)) }
            var shadowed: [String] = []
            for (name, entry) in files {
                if dirs.contains(name) { shadowed.append(name.string) } else { all.append((name, entry)) }
            }
            all.sort { $0.0 < $1.0 }
            return DirectoryListing(names: all.map(\.0.string), entries: all.map(\.1),
                                    shadowedFiles: shadowed.sorted { ByteName($0) < ByteName($1) })
        }
    }

    /// Entry names in byte order.
    public var sortedNames: [String] { names }
}
