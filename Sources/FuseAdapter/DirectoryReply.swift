/// How a readdir / readdirplus reply is filled, apart from libfuse so it can be tested.
///
/// Entries go in order while they fit in the kernel's buffer. `add` writes one entry and is
/// called only for entries that fit. readdirplus counts a kernel reference (a lookup) for each
/// entry it sends, so it asks `fitting` first how many will go, and counts exactly those. An error
/// after some entries went in ends the reply with those entries (the kernel asks again from
/// the next offset); an error before any is the reply (libfuse's passthrough example does the
/// same).
enum DirectoryReply {
    /// The most a readdirplus reply at offset 0 holds: one page, what kernels before 6.x asked
    /// for (docs/architecture.md, "Metadata memory"): ~25 entries with attributes.
    static let firstPlusReplyBytes = 4096

    /// How many entries, of the given packed sizes and in order, fit in `size` bytes.
    static func fitting(_ sizes: [Int], into size: Int) -> Int {
        var used = 0
        for (k, need) in sizes.enumerated() {
            if used + need > size { return k }
            used += need
        }
        return sizes.count
    }

    /// Returns the bytes used. `entrySize` is an entry's packed size (`fuse_add_direntry*` with
    /// no buffer); `add(entry, offset)` writes it at `offset`.
    static func pack<Entry>(_ entries: [Entry], into size: Int, entrySize: (Entry) -> Int,
                            add: (Entry, Int) throws -> Void) throws -> Int {
        var used = 0
        for entry in entries {
            let need = entrySize(entry)
            if used + need > size { break }
            do {
                try add(entry, used)
            } catch {
                if used == 0 { throw error }
                break
            }
            used += need
        }
        return used
    }
}
