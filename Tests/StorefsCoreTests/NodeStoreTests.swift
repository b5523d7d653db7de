import StorageClient
import Testing
@testable import StorefsCore

/// The packed inode store (docs/architecture.md, "Metadata memory"): it must answer exactly
/// as a dictionary would, through growth, deletions that move entries back, and shrinking.
@Suite struct NodeStoreTests {
    private func node(_ path: String, _ size: Int64 = 1) -> Node {
        Node(path: path, kind: .file(FileRecord(size: size, generation: 1, modified: Timestamp(seconds: 0, nanoseconds: 0))),
             fetched: 0, lookups: 1)
    }

    @Test func answersAsADictionaryThroughRandomChanges() {
        var store = NodeStore()
        var model: [UInt64: String] = [:]
        var current: [String: UInt64] = [:]
        var rng = SystemRandomNumberGenerator()
        for step in 0..<60_000 {
            // Few distinct numbers and paths, so updates, supersessions and removals are common.
            let ino = UInt64.random(in: 1...3_000, using: &rng)
            let path = "d/f\(ino % 1_000)"
            switch Int.random(in: 0..<10, using: &rng) {
            case 0..<4:
                if let p = model[ino] {
                    store[ino] = node(p, Int64(step))
                } else {
                    store[ino] = node(path)
                    model[ino] = path
                }
            case 4..<6:
                guard let p = model[ino] else { continue }
                store.makeCurrent(ino)
                current[p] = ino
            case 6:
                guard let p = model[ino] else { continue }
                store.releasePath(of: ino)
                if current[p] == ino { current[p] = nil }
            default:
                let removed = store.removeValue(forKey: ino)
                #expect(removed?.path == model[ino])
                if let p = model.removeValue(forKey: ino), current[p] == ino { current[p] = nil }
            }
            if step % 997 == 0 {
                #expect(store.count == model.count)
                for (i, p) in model { #expect(store[i]?.path == p) }
                for k in 0..<1_000 { #expect(store.current(ByteName("d/f\(k)")) == current["d/f\(k)"]) }
            }
        }
        for i in UInt64(1)...3_000 { #expect(store[i]?.path == model[i]) }
    }

    @Test func memoryFollowsTheCountDownAsWellAsUp() {
        var store = NodeStore()
        for i in UInt64(1)...100_000 {
            store[i] = node("p\(i)")
            store.makeCurrent(i)
        }
        let full = store.capacity
        #expect(full.slots == 100_000 && full.inodeBuckets <= 262_144 && full.pathBuckets <= 262_144)
        for i in UInt64(1)...99_000 { store.removeValue(forKey: i) }
        let after = store.capacity
        #expect(store.count == 1_000)
        #expect(after.slots < 10_000 && after.inodeBuckets <= 8_192 && after.pathBuckets <= 8_192, "\(after)")
        for i in UInt64(99_001)...100_000 {
            #expect(store[i]?.path == "p\(i)")
            #expect(store.current(ByteName("p\(i)")) == i)
        }
        #expect(store.current(ByteName("p5")) == nil && store[5] == nil)
    }

    @Test func deletionsInOneLongProbeRunKeepEveryOtherEntryFindable() {
        // Every slot hashes to one of three buckets: runs wrap around and overlap.
        var index = SlotIndex()
        let hashOf = { (slot: Int) in slot % 3 == 0 ? 15 : slot % 3 }
        for s in 0..<12 { index.insert(slot: s, hash: hashOf(s), hashOf: hashOf) }
        for s in [0, 4, 7, 9] { index.remove(slot: s, hash: hashOf(s), hashOf: hashOf) }
        for s in 0..<12 {
            let found = index.find(hash: hashOf(s)) { $0 == s }
            #expect(found == ([0, 4, 7, 9].contains(s) ? nil : s), "slot \(s)")
        }
    }

    @Test func anInodeCostsAboutAHundredBytesOfTable() {
        // 80-byte slot + two indexes of 4-byte buckets, 3/8 to 3/4 full: 91 to 102 bytes.
        #expect(NodeStore.slotBytes <= 80)
        var store = NodeStore()
        for i in UInt64(1)...200_000 { store[i] = node("p\(i)"); store.makeCurrent(i) }
        let c = store.capacity
        let bytes = c.slots * NodeStore.slotBytes + (c.inodeBuckets + c.pathBuckets) * 4
        #expect(bytes / store.count <= 102, "\(bytes / store.count) bytes an inode")
    }
}
