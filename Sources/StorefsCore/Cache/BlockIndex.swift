/// The in-memory index of one cache file: per block, its CRC32C and length (length 0: absent)
/// and its last-use tick (LRU).
///
/// An object's size is what a server says it is, and a local user opens whatever they like:
/// neither may decide how much memory an open costs. Objects of up to `denseLimit` blocks keep
/// two flat arrays (16 bytes a block: 1 MiB for 1 GiB at 16 KiB blocks, the fast path); larger
/// ones keep only their present blocks in a dictionary, so their index is bounded by what the
/// cache holds (`cache_size`), not by the object (a 5 TiB object costs nothing until read).
struct BlockIndex {
    static let denseLimit = 1 << 16

    struct Slot {
        var entry: CacheFileFormat.Entry
        var tick: UInt64
    }

    /// Blocks in the object.
    let count: Int
    /// Blocks present.
    private(set) var present = 0
    private var dense: [Slot]
    private var sparse: [Int: Slot] = [:]
    private var isDense: Bool { !dense.isEmpty || count == 0 }

    init(count: Int, tick: UInt64 = 0) {
        self.count = count
        dense = count <= Self.denseLimit ? Array(repeating: Slot(entry: .absent, tick: tick), count: count) : []
    }

    subscript(block: Int) -> CacheFileFormat.Entry {
        if isDense { return dense[block].entry }
        return sparse[block]?.entry ?? .absent
    }

    func isPresent(_ block: Int) -> Bool { self[block].length != 0 }

    /// Sets a block's entry (an absent entry removes it) and its tick.
    mutating func set(_ block: Int, _ entry: CacheFileFormat.Entry, tick: UInt64) {
        let was = isPresent(block)
        let now = entry.length != 0
        if isDense {
            dense[block] = Slot(entry: entry, tick: tick)
        } else if now {
            sparse[block] = Slot(entry: entry, tick: tick)
        } else {
            sparse.removeValue(forKey: block)
        }
        present += (now ? 1 : 0) - (was ? 1 : 0)
    }

    /// Marks a present block as just used.
    mutating func touch(_ block: Int, tick: UInt64) {
        if isDense { dense[block].tick = tick } else { sparse[block]?.tick = tick }
    }

    mutating func setAllTicks(_ tick: UInt64) {
        if isDense {
            for i in dense.indices { dense[i].tick = tick }
        } else {
            for k in Array(sparse.keys) { sparse[k]!.tick = tick }
        }
    }

    /// Calls `body(block, entry, tick)` for every present block.
    func forEachPresent(_ body: (Int, CacheFileFormat.Entry, UInt64) -> Void) {
        if isDense {
            for i in dense.indices where dense[i].entry.length != 0 { body(i, dense[i].entry, dense[i].tick) }
        } else {
            for (b, slot) in sparse { body(b, slot.entry, slot.tick) }
        }
    }

    /// Every block's CRC in order, when every block is present (for the whole-object check).
    func allCRCs() -> [UInt32]? {
        guard present == count, count > 0 else { return nil }
        return (0..<count).map { self[$0].crc }
    }

    mutating func removeAll() {
        if isDense {
            for i in dense.indices { dense[i].entry = .absent }
        } else {
            sparse.removeAll()
        }
        present = 0
    }
}
