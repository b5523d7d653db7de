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
        case file(ObjectMetadata)
    }

    /// Keyed by the entry's bytes (ByteName): canonically equivalent names are two entries.
    public private(set) var entries: [ByteName: Entry] = [:]
    /// Files hidden because a directory of the same name exists (logged once by the caller).
    public private(set) var shadowedFiles: [String] = []

    public init() {}

    /// The entry called `name` (compared as bytes).
    public subscript(name name: String) -> Entry? { entries[ByteName(name)] }

    /// Whether `name` can appear as a path component exactly as stored.
    public static func isRepresentable(_ name: String) -> Bool {
        let b = name.utf8
        return !b.isEmpty && !b.elementsEqual(".".utf8) && !b.elementsEqual("..".utf8) && b.count <= 255 && !b.contains(0)
    }

    /// Builds the listing of `prefix` (`""` or ending in `/`) from all its pages.
    public init(prefix: String, pages: [ListPage]) {
        var dirs = Set<ByteName>()
        var files: [ByteName: ObjectMetadata] = [:]
        let skip = prefix.utf8.count
        for page in pages {
            for p in page.prefixes where p.hasBytePrefix(prefix) && p.endsWithSlash && p.utf8.count > skip {
                let rel = p.droppingBytes(skip).droppingLastByte
                if !rel.containsSlash, Self.isRepresentable(rel) { dirs.insert(ByteName(rel)) }
            }
            for item in page.items where item.name.hasBytePrefix(prefix) {
                let rel = item.name.droppingBytes(skip)
                if rel.isEmpty { continue }  // the placeholder of this very directory
                if rel.containsSlash {
                    // Without a delimiter match this would be deeper; a trailing-slash item
                    // (`x/` under includeTrailingDelimiter) marks a directory.
                    let parts = rel.slashComponents
                    if parts.count == 2, parts[1].isEmpty, Self.isRepresentable(parts[0]) {
                        dirs.insert(ByteName(parts[0]))
                    }
                    continue
                }
                if Self.isRepresentable(rel) { files[ByteName(rel)] = item }
            }
        }
        for d in dirs { entries[d] = .directory }
        for (name, meta) in files {
            if dirs.contains(name) { shadowedFiles.append(name.string) } else { entries[name] = .file(meta) }
        }
        shadowedFiles.sort { ByteName($0) < ByteName($1) }
    }

    /// Entry names in byte order (stable readdir offsets).
    public var sortedNames: [String] {
        entries.keys.sorted().map(\.string)
    }
}
