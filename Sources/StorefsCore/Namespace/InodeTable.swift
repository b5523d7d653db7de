import StorageClient

/// One inode the kernel holds (docs/architecture.md, "Metadata memory"): its path, what it
/// is, when that was last checked, and the kernel's reference count: 72 bytes
/// (`FileRecordLayoutTests`), 91–102 with its slot's inode number and the table's two indexes
/// (`NodeStore`; paths of up to 15 bytes are stored inline); the object resource itself is
/// not kept here.
struct Node {
    enum Kind: Equatable {
        case directory
        case file(FileRecord)
    }

    var path: String
    var kind: Kind
    /// Monotonic seconds since `Node.epoch`, as a Float (1 s resolution after 194 days: TTLs
    /// are whole seconds or more).
    private var fetchedSinceEpoch: Float
    /// Kernel references (lookup replies not yet forgotten), saturating.
    private var lookupCount: UInt32

    init(path: String, kind: Kind, fetched: Double, lookups: UInt64) {
        self.path = path
        self.kind = kind
        fetchedSinceEpoch = Float(fetched - Node.epoch)
        lookupCount = UInt32(min(lookups, UInt64(UInt32.max)))
    }

    static let epoch = now()

    /// Monotonic time the kind was last confirmed by the bucket (or a listing).
    var fetched: Double {
        get { Double(fetchedSinceEpoch) + Node.epoch }
        set { fetchedSinceEpoch = Float(newValue - Node.epoch) }
    }

    var lookups: UInt64 {
        get { UInt64(lookupCount) }
        set { lookupCount = UInt32(min(newValue, UInt64(UInt32.max))) }
    }
}

/// Inode numbers for paths. A path keeps its inode while its content is unchanged; a new
/// generation of a file gets a new inode, so the kernel never mixes two versions' pages.
/// Only inodes the kernel references are here: what it forgot lives on, bounded, in the
/// path-keyed `MetadataCache`.
struct InodeTable {
    /// Nodes by inode number; each path's current inode by the path's bytes (ByteName: two
    /// canonically equivalent names are two inodes). An inode its path no longer names is
    /// superseded (its object was replaced).
    var nodes: NodeStore = {
        var store = NodeStore()
        store[Filesystem.rootInode] = Node(path: "", kind: .directory, fetched: .infinity, lookups: 1)
        store.makeCurrent(Filesystem.rootInode)
        return store
    }()
    var lastOpenedGeneration: [UInt64: Int64] = [:]

    /// The inode `path` names now.
    func inode(of path: ByteName) -> UInt64? { nodes.current(path) }

    mutating func upsert(path: String, kind: Node.Kind, at time: Double, countLookup: Bool) -> (UInt64, Node) {
        if let ino = nodes.current(ByteName(path)), var node = nodes[ino], node.kind.sameIdentity(as: kind) {
            node.kind = kind
            node.fetched = time
            if countLookup { node.lookups += 1 }
            nodes[ino] = node
            return (ino, node)
        }
        // The number readdir already reported for this entry (Filesystem.inodeNumber); on the
        // rare collision, the next free one.
        var ino = Filesystem.inodeNumber(path)
        while nodes[ino] != nil || ino <= Filesystem.rootInode { ino = (ino &+ 1) | (1 << 63) }
        let node = Node(path: path, kind: kind, fetched: time, lookups: countLookup ? 1 : 0)
        nodes[ino] = node
        nodes.makeCurrent(ino)
        return (ino, node)
    }

    /// Updates a file's record. A changed generation never rewrites this inode (one inode,
    /// one generation: its handles and the kernel's pages are that generation's): the path is
    /// let go, so the next lookup makes a fresh inode for the new object, and this one keeps
    /// its old record, marked fresh so it is not asked about again and again.
    mutating func refresh(_ ino: UInt64, record: FileRecord, at time: Double) -> Node? {
        guard var node = nodes[ino] else { return nil }
        if case .file(let old) = node.kind, old.generation != record.generation {
            supersede(ino, node)
        } else {
            node.kind = .file(record)
        }
        node.fetched = time
        nodes[ino] = node
        return node
    }

    /// The inode no longer stands for its path (its object was replaced or deleted).
    mutating func supersede(_ ino: UInt64, _ node: Node) {
        nodes.releasePath(of: ino)
    }

    /// Whether `ino` is still what its path names (not replaced by a newer object).
    func isCurrent(_ ino: UInt64) -> Bool {
        guard let node = nodes[ino] else { return false }
        return nodes.current(ByteName(node.path)) == ino
    }

    /// Makes the next `getattr`/`open` of `ino` ask the bucket again.
    mutating func expire(_ ino: UInt64) {
        nodes[ino]?.fetched = -.infinity
    }

    mutating func forget(_ ino: UInt64, count: UInt64) -> Node? {
        guard ino != Filesystem.rootInode, var node = nodes[ino] else { return nil }
        node.lookups = node.lookups > count ? node.lookups - count : 0
        if node.lookups == 0 {
            let wasCurrent = nodes.current(ByteName(node.path)) == ino
            nodes.removeValue(forKey: ino)
            lastOpenedGeneration.removeValue(forKey: ino)
            return wasCurrent ? node : nil
        }
        nodes[ino] = node
        return nil
    }
}

extension Node.Kind {
    func sameIdentity(as other: Node.Kind) -> Bool {
        switch (self, other) {
        case (.directory, .directory): return true
        case (.file(let a), .file(let b)): return a.generation == b.generation
        default: return false
        }
    }

    var entry: DirectoryListing.Entry {
        switch self {
        case .directory: return .directory
        case .file(let r): return .file(r)
        }
    }
}

extension DirectoryListing.Entry {
    /// What a listing says a name is; nil for a file listed without its size (Firebase v0),
    /// which a metadata GET must complete.
    var nodeKind: Node.Kind? {
        switch self {
        case .directory: return .directory
        case .file(let r): return .file(r)
        case .unsizedFile: return nil
        }
    }
}
