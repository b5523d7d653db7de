import StorageClient

struct Node {
    enum Kind {
        case directory
        /// Metadata and the monotonic time it was fetched.
        case file(ObjectMetadata, Double)
    }

    var path: String
    var kind: Kind
    /// Kernel references (lookup replies not yet forgotten).
    var lookups: UInt64
}

/// Inode numbers for paths. A path keeps its inode while its content is unchanged; a new
/// generation of a file gets a new inode, so the kernel never mixes two versions' pages.
struct InodeTable {
    var nodes: [UInt64: Node] = [Filesystem.rootInode: Node(path: "", kind: .directory, lookups: 1)]
    /// Paths by their bytes (ByteName): two canonically equivalent names are two inodes.
    var byPath: [ByteName: UInt64] = [ByteName(""): Filesystem.rootInode]
    var lastOpenedGeneration: [UInt64: Int64] = [:]

    mutating func upsert(path: String, entry: DirectoryListing.Entry, at time: Double, countLookup: Bool) -> (UInt64, Node) {
        let kind: Node.Kind
        switch entry {
        case .directory: kind = .directory
        case .file(let meta): kind = .file(meta, time)
        }
        if let ino = byPath[ByteName(path)], var node = nodes[ino], node.kind.sameIdentity(as: kind) {
            node.kind = kind
            if countLookup { node.lookups += 1 }
            nodes[ino] = node
            return (ino, node)
        }
        // The number readdir already reported for this entry (Filesystem.inodeNumber); on the
        // rare collision, the next free one.
        var ino = Filesystem.inodeNumber(path, entry)
        while nodes[ino] != nil || ino <= Filesystem.rootInode { ino = (ino &+ 1) | (1 << 63) }
        let node = Node(path: path, kind: kind, lookups: countLookup ? 1 : 0)
        nodes[ino] = node
        byPath[ByteName(path)] = ino
        return (ino, node)
    }

    /// Updates a file's metadata. A changed generation never rewrites this inode (one inode,
    /// one generation: its handles and the kernel's pages are that generation's): the path is
    /// let go, so the next lookup makes a fresh inode for the new object, and this one keeps
    /// its old metadata, marked fresh so it is not asked about again and again.
    mutating func refresh(_ ino: UInt64, meta: ObjectMetadata, at time: Double) -> Node? {
        guard var node = nodes[ino] else { return nil }
        if case .file(let old, _) = node.kind, old.generation != meta.generation {
            if byPath[ByteName(node.path)] == ino { byPath.removeValue(forKey: ByteName(node.path)) }
            node.kind = .file(old, time)
        } else {
            node.kind = .file(meta, time)
        }
        nodes[ino] = node
        return node
    }

    mutating func forget(_ ino: UInt64, count: UInt64) {
        guard ino != Filesystem.rootInode, var node = nodes[ino] else { return }
        node.lookups = node.lookups > count ? node.lookups - count : 0
        if node.lookups == 0 {
            nodes.removeValue(forKey: ino)
            lastOpenedGeneration.removeValue(forKey: ino)
            if byPath[ByteName(node.path)] == ino { byPath.removeValue(forKey: ByteName(node.path)) }
        } else {
            nodes[ino] = node
        }
    }
}

extension Node.Kind {
    func sameIdentity(as other: Node.Kind) -> Bool {
        switch (self, other) {
        case (.directory, .directory): return true
        case (.file(let a, _), .file(let b, _)): return a.generation == b.generation
        default: return false
        }
    }
}
