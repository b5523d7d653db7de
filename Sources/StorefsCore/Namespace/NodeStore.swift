/// The nodes of `InodeTable`, packed for millions of them (docs/architecture.md, "Metadata
/// memory"). `ls -lR` of a million objects leaves the kernel holding a million inodes, and
/// each must be remembered while it does.
///
/// Nodes live in one array of slots; two open-addressing indexes of 4-byte slot numbers find
/// a slot by inode number and by path (the path's current inode). An inode costs its 80-byte
/// slot and 11 to 21 bytes of index (buckets are 3/8 to 3/4 full). Swift
/// dictionaries, used before, cost ~200 bytes an inode at a million: their buckets are a
/// power of two of the whole key and value (80 + 24 bytes), and they never shrink, so memory
/// stayed at its peak after the kernel forgot. This store shrinks when three quarters of its
/// slots are free.
///
/// Both indexes hash with Swift's seeded `Hasher`: names come from the server, which must not
/// be able to choose names that pile onto one bucket.
struct NodeStore {
    private struct Slot {
        /// 0: a free slot (inode numbers are never 0).
        var ino: UInt64
        var node: Node
    }

    private var slots: ContiguousArray<Slot> = []
    private var freeSlots: [UInt32] = []
    private var byInode = SlotIndex()
    private var byPath = SlotIndex()

    /// Nodes held.
    private(set) var count = 0

    /// Slots and index buckets allocated (tests, stats): what the store's memory is made of.
    var capacity: (slots: Int, inodeBuckets: Int, pathBuckets: Int) { (slots.count, byInode.bucketCount, byPath.bucketCount) }

    /// Bytes of one slot.
    static var slotBytes: Int { MemoryLayout<Slot>.stride }

    init() {}

    // MARK: by inode number

    subscript(ino: UInt64) -> Node? {
        get { slotOf(ino).map { slots[$0].node } }
        set {
            if let node = newValue {
                if let s = slotOf(ino) { slots[s].node = node } else { insert(ino, node) }
            } else {
                removeValue(forKey: ino)
            }
        }
    }

    /// Removes the node of `ino`, and its path's entry when that is this inode.
    @discardableResult
    mutating func removeValue(forKey ino: UInt64) -> Node? {
        guard let s = slotOf(ino) else { return nil }
        let node = slots[s].node
        withIndex(\.byInode) { index, hashOf in index.remove(slot: s, hash: Self.hash(ino), hashOf: hashOf) }
        let h = Self.hash(ByteName(node.path))
        if byPath.find(hash: h, where: { $0 == s }) != nil {
            withIndex(\.byPath) { index, hashOf in index.remove(slot: s, hash: h, hashOf: hashOf) }
        }
        slots[s] = Slot(ino: 0, node: Self.vacant)
        freeSlots.append(UInt32(s))
        count -= 1
        shrinkIfSparse()
        return node
    }

    // MARK: by path

    /// The inode a path currently names (not one superseded by a newer object).
    func current(_ path: ByteName) -> UInt64? {
        byPath.find(hash: Self.hash(path)) { ByteName(slots[$0].node.path) == path }.map { slots[$0].ino }
    }

    /// Makes `ino` (which must be held, with this path) the inode its path names.
    mutating func makeCurrent(_ ino: UInt64) {
        guard let s = slotOf(ino) else { return }
        let key = ByteName(slots[s].node.path)
        let h = Self.hash(key)
        let old = byPath.find(hash: h, where: { ByteName(slots[$0].node.path) == key })
        if old == s { return }
        withIndex(\.byPath) { index, hashOf in
            if let old { index.remove(slot: old, hash: h, hashOf: hashOf) }
            index.insert(slot: s, hash: h, hashOf: hashOf)
        }
    }

    /// The path no longer names `ino` (its object was replaced or deleted); the node stays.
    mutating func releasePath(of ino: UInt64) {
        guard let s = slotOf(ino) else { return }
        let h = Self.hash(ByteName(slots[s].node.path))
        if byPath.find(hash: h, where: { $0 == s }) != nil {
            withIndex(\.byPath) { index, hashOf in index.remove(slot: s, hash: h, hashOf: hashOf) }
        }
    }

    // MARK: internals

    private static let vacant = Node(path: "", kind: .directory, fetched: 0, lookups: 0)

    private func slotOf(_ ino: UInt64) -> Int? {
        guard ino != 0 else { return nil }
        return byInode.find(hash: Self.hash(ino)) { slots[$0].ino == ino }
    }

    private mutating func insert(_ ino: UInt64, _ node: Node) {
        precondition(ino != 0, "inode 0 is not a number the kernel accepts")
        let s: Int
        if let f = freeSlots.popLast() {
            s = Int(f)
            slots[s] = Slot(ino: ino, node: node)
        } else {
            s = slots.count
            precondition(s < Int(UInt32.max) - 1, "over four billion inodes")
            slots.append(Slot(ino: ino, node: node))
        }
        withIndex(\.byInode) { index, hashOf in index.insert(slot: s, hash: Self.hash(ino), hashOf: hashOf) }
        count += 1
    }

    /// Moves the nodes to the front of a smaller array once three quarters of the slots are
    /// free, and rebuilds both indexes at their new size.
    private mutating func shrinkIfSparse() {
        guard slots.count >= 4096, count < slots.count / 4 else { return }
        var packed = ContiguousArray<Slot>()
        packed.reserveCapacity(count * 2)
        var current: [Int] = []
        for s in slots.indices where slots[s].ino != 0 {
            if byPath.find(hash: Self.hash(ByteName(slots[s].node.path)), where: { $0 == s }) != nil { current.append(packed.count) }
            packed.append(slots[s])
        }
        slots = packed
        freeSlots = []
        byInode = SlotIndex()
        byPath = SlotIndex()
        let n = slots.count
        withIndex(\.byInode) { index, hashOf in for s in 0..<n { index.insert(slot: s, hash: hashOf(s), hashOf: hashOf) } }
        withIndex(\.byPath) { index, hashOf in for s in current { index.insert(slot: s, hash: hashOf(s), hashOf: hashOf) } }
    }

    /// Runs `body` on one index, moved out of `self` meanwhile, with the hash of a slot's key
    /// for entries that move. (The index cannot be changed in place while the hash function
    /// reads the slots: that would overlap two accesses to `self`.)
    private mutating func withIndex(_ which: WritableKeyPath<NodeStore, SlotIndex>,
                                    _ body: (inout SlotIndex, (Int) -> Int) -> Void) {
        var index = SlotIndex()
        swap(&index, &self[keyPath: which])
        let byInode = which == \NodeStore.byInode
        slots.withUnsafeBufferPointer { p in
            body(&index) { byInode ? Self.hash(p[$0].ino) : Self.hash(ByteName(p[$0].node.path)) }
        }
        swap(&index, &self[keyPath: which])
    }

    private static func hash(_ ino: UInt64) -> Int {
        var h = Hasher()
        h.combine(ino)
        return h.finalize()
    }

    private static func hash(_ path: ByteName) -> Int { path.hashValue }
}

/// An open-addressing hash index (linear probing, deletion by backward shift, no tombstones)
/// from a hash to a slot number. It stores slot numbers only: the caller compares keys through
/// `where` and gives the hash of a stored slot when entries move (growing, deleting).
struct SlotIndex {
    /// slot + 1; 0 is an empty bucket.
    private var buckets: [UInt32] = []
    private var count = 0

    var bucketCount: Int { buckets.count }

    /// The first slot on `hash`'s probe sequence that `matches`.
    func find(hash: Int, where matches: (Int) -> Bool) -> Int? {
        guard !buckets.isEmpty else { return nil }
        let mask = buckets.count - 1
        var i = hash & mask
        while true {
            let b = buckets[i]
            if b == 0 { return nil }
            if matches(Int(b - 1)) { return Int(b - 1) }
            i = (i + 1) & mask
        }
    }

    mutating func insert(slot: Int, hash: Int, hashOf: (Int) -> Int) {
        if (count + 1) * 4 > buckets.count * 3 { resize(to: max(16, buckets.count * 2), hashOf: hashOf) }
        place(UInt32(slot + 1), hash: hash)
        count += 1
    }

    /// Removes `slot`, found from `hash`; the entries after it on the probe run move back.
    mutating func remove(slot: Int, hash: Int, hashOf: (Int) -> Int) {
        guard !buckets.isEmpty else { return }
        let mask = buckets.count - 1
        var i = hash & mask
        while buckets[i] != UInt32(slot + 1) {
            if buckets[i] == 0 { return }
            i = (i + 1) & mask
        }
        buckets[i] = 0
        count -= 1
        var j = i
        while true {
            j = (j + 1) & mask
            let b = buckets[j]
            if b == 0 { break }
            let home = hashOf(Int(b - 1)) & mask
            // The entry at j may fill the hole at i unless its home lies in (i, j] cyclically.
            let stays = i <= j ? (home > i && home <= j) : (home > i || home <= j)
            if !stays {
                buckets[i] = b
                buckets[j] = 0
                i = j
            }
        }
        if buckets.count > 64, count * 8 < buckets.count { resize(to: buckets.count / 2, hashOf: hashOf) }
    }

    private mutating func place(_ b: UInt32, hash: Int) {
        let mask = buckets.count - 1
        var i = hash & mask
        while buckets[i] != 0 { i = (i + 1) & mask }
        buckets[i] = b
    }

    private mutating func resize(to size: Int, hashOf: (Int) -> Int) {
        let old = buckets
        buckets = [UInt32](repeating: 0, count: size)
        for b in old where b != 0 { place(b, hash: hashOf(Int(b - 1))) }
    }
}
