import StorageClient

/// One directory's entries, merged from the pages of a delimited listing (design.md §1).
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

    public private(set) var entries: [String: Entry] = [:]
    /// Files hidden because a directory of the same name exists (logged once by the caller).
    public private(set) var shadowedFiles: [String] = []

    public init() {}

    /// Whether `name` can appear as a path component exactly as stored.
    public static func isRepresentable(_ name: Substring) -> Bool {
        !name.isEmpty && name != "." && name != ".." && name.utf8.count <= 255 && !name.utf8.contains(0)
    }

    /// Builds the listing of `prefix` (`""` or ending in `/`) from all its pages.
    public init(prefix: String, pages: [ListPage]) {
        var dirs = Set<String>()
        var files: [String: ObjectMetadata] = [:]
        for page in pages {
            for p in page.prefixes where p.hasPrefix(prefix) && p.hasSuffix("/") {
                let rel = p.dropFirst(prefix.count).dropLast()
                if !rel.contains("/"), Self.isRepresentable(rel) { dirs.insert(String(rel)) }
            }
            for item in page.items where item.name.hasPrefix(prefix) {
                let rel = item.name.dropFirst(prefix.count)
                if rel.isEmpty { continue }  // the placeholder of this very directory
                if rel.contains("/") {
                    // Without a delimiter match this would be deeper; a trailing-slash item
                    // (`x/` under includeTrailingDelimiter) marks a directory.
                    let first = rel.split(separator: "/", maxSplits: 1, omittingEmptySubsequences: false)[0]
                    if rel.hasSuffix("/") && rel.dropLast() == first && Self.isRepresentable(first) {
                        dirs.insert(String(first))
                    }
                    continue
                }
                if Self.isRepresentable(rel) { files[String(rel)] = item }
            }
        }
        for d in dirs { entries[d] = .directory }
        for (name, meta) in files {
            if dirs.contains(name) { shadowedFiles.append(name) } else { entries[name] = .file(meta) }
        }
        shadowedFiles.sort()
    }

    /// Entry names in byte order (stable readdir offsets).
    public var sortedNames: [String] {
        entries.keys.sorted { Array($0.utf8).lexicographicallyPrecedes(Array($1.utf8)) }
    }
}
