import Foundation
import Synchronization
import Glibc
import Testing
import StorageClient
@testable import StorefsCore
import StorefsTestSupport

/// Several mounts over one cache directory (docs/cache.md). Each `BlockCache` here is one
/// mount: in one process, as the locks they take (flock, open file description locks) are
/// per open file description, two instances lock each other out exactly as two processes do.
@Suite struct SharedCacheTests {
    let dir = temporaryDirectory()
    let meta = ObjectMetadata(name: "a/b.bin", bucket: "b", size: 40_000, generation: 5, updated: Timestamp(seconds: 0))

    func mount(capacity: Int64 = 1 << 20, blockSize: Int = 4096) throws -> BlockCache {
        try BlockCache(directory: dir, capacity: capacity, blockSize: blockSize)
    }

    func object(_ m: ObjectMetadata? = nil, generation: Int64? = nil, size: Int64? = nil) -> ObjectMetadata {
        var m = m ?? meta
        if let generation { m.generation = generation }
        if let size { m.size = size }
        return m
    }

    func store(_ o: CachedObject, _ bytes: [UInt8], first: Int = 0) {
        bytes.withUnsafeBytes { o.store(first: first, $0) }
    }

    func read(_ o: CachedObject, at offset: Int, count: Int) -> [UInt8]? {
        var out = [UInt8](repeating: 0, count: count)
        return out.withUnsafeMutableBytes { o.read(at: Int64(offset), into: $0) } ? out : nil
    }

    /// Whether the cache serves exactly `expected` from `offset` (a Bool, so that a failure
    /// does not print the bytes).
    func serves(_ o: CachedObject, at offset: Int = 0, _ expected: [UInt8]) -> Bool {
        read(o, at: offset, count: expected.count) == expected
    }

    /// Disk the cache's block files take.
    func allocated(_ cache: BlockCache) -> Int64 {
        var total: Int64 = 0
        let e = FileManager.default.enumerator(atPath: cache.files.versionPath)!
        while let f = e.nextObject() as? String {
            if f.hasSuffix(".blk") { total += allocatedBytes(cache.files.versionPath + "/" + f) }
        }
        return total
    }

    @Test func twoMountsUseOneDirectoryAndEachKnowsTheOther() throws {
        let a = try mount()
        #expect(!a.isShared)
        let b = try mount()
        #expect(a.isShared && b.isShared)
        #expect(a.shared.slot != b.shared.slot)
        let members = SharedCache.liveMembers(cacheDirectoryFD: a.files.topFD)
        #expect(Set(members.compactMap(\.slot)) == [a.shared.slot, b.shared.slot])
    }

    @Test func aBlockOneMountStoredIsServedByAnotherWithoutStoringItAgain() throws {
        let bytes = pattern(40_000, seed: 3)
        let a = try mount()
        let b = try mount()
        let oa = try #require(a.acquire(endpoint: "e", meta: meta))
        store(oa, bytes)
        let ob = try #require(b.acquire(endpoint: "e", meta: meta))
        #expect((0..<10).allSatisfy { ob.isCached($0) })
        #expect(serves(ob, at: 0, bytes))
        #expect(ob.indexWrites == 0, "the second mount wrote the index again")
        #expect(b.cachedBytes(endpoint: "e", bucket: "b", name: "a/b.bin", generation: 5, size: 40_000) == 40_000)
        #expect(a.usedBytes == b.usedBytes)
    }

    @Test func aMountThatOpenedAnObjectFirstFindsWhatAnotherStoresInItLater() throws {
        let bytes = pattern(40_000, seed: 4)
        let a = try mount()
        let b = try mount()
        let ob = try #require(b.acquire(endpoint: "e", meta: meta))
        #expect(!ob.isCached(0))
        let oa = try #require(a.acquire(endpoint: "e", meta: meta))
        #expect(oa.inode == ob.inode, "two files for one object")
        store(oa, Array(bytes[0..<16384]), first: 0)
        #expect(ob.cachedBytes(from: 0, upTo: 40_000) == 16384)
        #expect(serves(ob, at: 100, Array(bytes[100..<8100])))
        #expect(!ob.isCached(4))
    }

    @Test func indexEntriesTwoMountsWriteIntoOnePageAreAllKept() throws {
        let bytes = pattern(40_000, seed: 5)
        do {
            let a = try mount()
            let b = try mount()
            let oa = try #require(a.acquire(endpoint: "e", meta: meta))
            let ob = try #require(b.acquire(endpoint: "e", meta: meta))
            // Alternate blocks from the two mounts, at once: every entry lies in the first index page.
            let group = DispatchGroup()
            for (o, parity) in [(oa, 0), (ob, 1)] {
                group.enter()
                Thread {
                    for k in stride(from: parity, to: 10, by: 2) {
                        let end = min(40_000, (k + 1) * 4096)
                        Array(bytes[(k * 4096)..<end]).withUnsafeBytes { o.store(first: k, $0) }
                    }
                    group.leave()
                }.start()
            }
            group.wait()
            a.release(oa)
            b.release(ob)
        }
        let c = try mount()
        let oc = try #require(c.acquire(endpoint: "e", meta: meta))
        #expect((0..<10).allSatisfy { oc.isCached($0) }, "an index write of one mount dropped the other's entries")
        #expect(serves(oc, at: 0, bytes))
    }

    @Test func theTwoMountsKeepToOneCap() throws {
        let cap: Int64 = 96 << 10
        let a = try mount(capacity: cap)
        let b = try mount(capacity: cap)
        for g in 1...12 {
            let m = object(generation: Int64(g), size: 16_384)
            let o = try #require((g % 2 == 0 ? a : b).acquire(endpoint: "e", meta: m))
            store(o, pattern(16_384, seed: UInt8(g)))
            #expect(a.usedBytes <= cap && b.usedBytes == a.usedBytes)
            #expect(allocated(a) <= cap + 8192, "the files hold \(allocated(a)) bytes, over the cap \(cap)")
        }
        // What the count says is what the files hold.
        #expect(abs(a.usedBytes - allocated(a)) <= 8192, "counted \(a.usedBytes), on disk \(allocated(a))")
    }

    @Test func theSmallestCacheSizeOfTheLiveMountsIsTheCap() throws {
        let a = try mount(capacity: 1 << 20)
        #expect(a.capacity == 1 << 20)
        var b: BlockCache? = try mount(capacity: 256 << 10)
        #expect(a.capacity == 256 << 10 && b?.capacity == 256 << 10)
        b = nil
        a.shared.refreshMembers(force: true)
        #expect(a.capacity == 1 << 20)
    }

    @Test func aMountOfAnotherBlockSizeIsRefusedWhileOneIsLive() throws {
        var a: BlockCache? = try mount(blockSize: 4096)
        #expect { _ = try mount(blockSize: 16384) } throws: {
            ($0 as? FilesystemError)?.message.contains("block_size=4096") == true
        }
        withExtendedLifetime(a) {}
        a = nil
        _ = try mount(blockSize: 16384)
    }

    @Test func evictionByOneMountSeesTheOthersUse() throws {
        let cap: Int64 = 80 << 10
        let a = try mount(capacity: cap)
        let b = try mount(capacity: cap)
        let old = try #require(a.acquire(endpoint: "e", meta: object(generation: 1, size: 16_384)))
        let hot = try #require(a.acquire(endpoint: "e", meta: object(generation: 2, size: 16_384)))
        store(old, pattern(16_384, seed: 1))
        store(hot, pattern(16_384, seed: 2))
        Thread.sleep(forTimeInterval: 1.2)  // this mount's last use of `hot` is now a while ago
        let newer = try #require(a.acquire(endpoint: "e", meta: object(generation: 3, size: 16_384)))
        store(newer, pattern(16_384, seed: 3))
        // File times come from the kernel's coarse clock, a tick (up to ~10 ms) behind: apart
        // by more than that, the other mount's read of `hot` is later than `newer` on disk too.
        Thread.sleep(forTimeInterval: 0.1)
        // The other mount reads `hot` after that: later than this mount used `hot` or `newer`.
        let hotB = try #require(b.acquire(endpoint: "e", meta: object(generation: 2, size: 16_384)))
        #expect(serves(hotB, at: 0, pattern(16_384, seed: 2)))
        // This mount now needs room: the file the other mount used stays, older ones go.
        for g in 4...5 {
            let o = try #require(a.acquire(endpoint: "e", meta: object(generation: Int64(g), size: 16_384)))
            store(o, pattern(16_384, seed: UInt8(g)))
        }
        #expect(!old.isCached(0))
        #expect(hot.isCached(0) && hot.isCached(3))
    }

    @Test func evictionByOneMountWhileAnotherReadsNeverServesWrongBytes() throws {
        let bytes = pattern(40_000, seed: 6)
        let a = try mount()
        let b = try mount()
        let ob = try #require(b.acquire(endpoint: "e", meta: meta))
        store(ob, bytes)
        #expect(serves(ob, at: 0, bytes))
        _ = a.clear()
        // Gone under the reader: a miss (fetched again by the reader), never other bytes.
        #expect(read(ob, at: 0, count: 40_000) == nil)
        store(ob, bytes)
        #expect(serves(ob, at: 0, bytes))
        #expect(a.usedBytes == b.usedBytes && a.usedBytes <= allocated(a) + 8192)
    }

    @Test func racingFirstOpensInTwoMountsShareOneFile() throws {
        let a = try mount()
        let b = try mount()
        let got = Mutex<[CachedObject]>([])
        let group = DispatchGroup()
        for i in 0..<8 {
            group.enter()
            Thread {
                if let o = (i % 2 == 0 ? a : b).acquire(endpoint: "e", meta: meta) { got.withLock { $0.append(o) } }
                group.leave()
            }.start()
        }
        group.wait()
        let objects = got.withLock { $0 }
        #expect(objects.count == 8 && Set(objects.map(\.inode)).count == 1)
        store(objects[0], pattern(40_000, seed: 8))
        #expect(objects.allSatisfy { read($0, at: 5000, count: 100) == Array(pattern(40_000, seed: 8)[5000..<5100]) })
    }

    @Test func aFileAnotherMountRemovedIsMadeAgain() throws {
        let a = try mount()
        let b = try mount()
        let first = try #require(a.acquire(endpoint: "e", meta: meta))
        a.release(first)  // empty and unused: the other mount's clear removes it
        _ = b.clear()
        #expect(b.files.identity(first.hex) == nil)
        let again = try #require(a.acquire(endpoint: "e", meta: meta))
        #expect(again !== first && b.files.identity(again.hex) == again.inode)
        store(again, pattern(40_000, seed: 9))
        let ob = try #require(b.acquire(endpoint: "e", meta: meta))
        #expect(serves(ob, at: 0, pattern(40_000, seed: 9)))
    }

    @Test func bytesAKilledMountReservedAndNeverWroteAreCountedAgain() throws {
        let cap: Int64 = 64 << 10
        let b = try mount(capacity: cap)
        do {
            let a = try mount(capacity: cap)
            #expect(a.reserve(24 << 10))  // then killed before its write: never landed
        }
        #expect(b.usedBytes >= 24 << 10)
        // The next eviction counts again from the files and the live mounts' writes in flight.
        for g in 1...6 {
            let o = try #require(b.acquire(endpoint: "e", meta: object(generation: Int64(g), size: 16_384)))
            store(o, pattern(16_384, seed: UInt8(g)))
        }
        #expect(abs(b.usedBytes - allocated(b)) <= 8192, "counted \(b.usedBytes), on disk \(allocated(b))")
    }

    @Test func aSlotIsFreeAgainOnceItsMountIsGone() throws {
        var a: BlockCache? = try mount()
        let slot = try #require(a?.shared.slot)
        a = nil
        let b = try mount()
        #expect(b.shared.slot == slot)
    }
}

/// The offline namespace of one source, kept by several mounts of it over one cache directory.
@Suite struct SharedNamespaceTests {
    let dir = temporaryDirectory()

    @Test func twoMountsOfOneSourceAppendToOneLogAndLoseNothing() throws {
        // Two mounts start at once: the new log gets one header, and neither load rewrites
        // the log under the other.
        let a = try NamespaceStore(cacheDirectory: dir, source: "s")
        let b = try NamespaceStore(cacheDirectory: dir, source: "s")
        _ = a.load()
        _ = b.load()
        let group = DispatchGroup()
        for (store, prefix) in [(a, "a"), (b, "b")] {
            group.enter()
            Thread {
                for i in 0..<200 { store.recordFile("\(prefix)/\(i)", FileRecord(object("\(prefix)/\(i)", size: Int64(i + 1)))) }
                store.flush(timeout: 30)
                group.leave()
            }.start()
        }
        group.wait()
        let loaded = try NamespaceStore(cacheDirectory: dir, source: "s").load()
        let paths = Set(loaded.files.map(\.path))
        #expect(paths.count == 400, "\(400 - paths.count) records lost")
        #expect(loaded.files.allSatisfy { $0.record.size == Int64(Int($0.path.split(separator: "/")[1])! + 1) })
        withExtendedLifetime((a, b)) {}
    }
}
