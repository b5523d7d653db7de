import StorageClient

/// What the bucket said about paths, independent of the kernel's references
/// (docs/architecture.md, "Metadata memory"): a lookup of a path seen within `stat_ttl` needs
/// no request even after the kernel forgot its inode, and a missing name is remembered for
/// `negative_ttl`. Bounded: past `capacity` records the oldest eighth goes (a flood of
/// lookups of names that do not exist — any local user can make one — costs at most this).
struct MetadataCache {
    enum Known: Equatable {
        case directory
        case file(FileRecord)
        case missing
    }

    struct Record {
        var known: Known
        /// Monotonic time the bucket said so.
        var fetched: Double
        /// Insertion order, for eviction.
        var sequence: UInt64
    }

    let capacity: Int
    private(set) var records: [ByteName: Record] = [:]
    private var nextSequence: UInt64 = 0

    init(capacity: Int) { self.capacity = max(16, capacity) }

    var count: Int { records.count }

    /// What is known about `path` if it was learnt less than `ttl` seconds before `now`.
    func lookup(_ path: ByteName, now: Double, ttl: Double) -> Record? {
        guard let r = records[path], now - r.fetched < ttl else { return nil }
        return r
    }

    /// What was last known about `path`, however old (outages).
    func last(_ path: ByteName) -> Record? { records[path] }

    mutating func remember(_ path: ByteName, _ known: Known, at time: Double) {
        if records.count >= capacity, records[path] == nil { evictOldest() }
        nextSequence += 1
        records[path] = Record(known: known, fetched: time, sequence: nextSequence)
    }

    mutating func forget(_ path: ByteName) { records.removeValue(forKey: path) }

    /// Drops the oldest eighth: O(n) once per n/8 insertions.
    private mutating func evictOldest() {
        let drop = max(1, records.count / 8)
        let cutoff = records.values.map(\.sequence).sorted()[drop - 1]
        records = records.filter { $0.value.sequence > cutoff }
    }
}

/// Whole object resources (content type, custom metadata, download tokens), kept briefly for
/// extended attributes: a few thousand at most, the oldest dropped first.
struct FullMetadataCache {
    let capacity: Int
    private var entries: [ByteName: (meta: ObjectMetadata, fetched: Double, sequence: UInt64)] = [:]
    private var nextSequence: UInt64 = 0

    init(capacity: Int) { self.capacity = max(16, capacity) }

    func lookup(_ path: ByteName, generation: Int64, now: Double, ttl: Double) -> ObjectMetadata? {
        guard let e = entries[path], e.meta.generation == generation, now - e.fetched < ttl else { return nil }
        return e.meta
    }

    mutating func remember(_ path: ByteName, _ meta: ObjectMetadata, at time: Double) {
        if entries.count >= capacity, entries[path] == nil {
            let drop = max(1, entries.count / 8)
            let cutoff = entries.values.map(\.sequence).sorted()[drop - 1]
            entries = entries.filter { $0.value.sequence > cutoff }
        }
        nextSequence += 1
        entries[path] = (meta, time, nextSequence)
    }

    mutating func forget(_ path: ByteName) { entries.removeValue(forKey: path) }
}
