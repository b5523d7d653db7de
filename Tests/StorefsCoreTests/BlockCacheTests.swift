import Foundation
import Synchronization
import Glibc
import Testing
import StorageClient
@testable import StorefsCore
import StorefsTestSupport

/// Disk space a file takes (its allocated blocks, written or not).
func allocatedBytes(_ path: String) -> Int64 {
    var st = stat()
    _ = stat(path, &st)
    return Int64(st.st_blocks) * 512
}

/// Which pages of the file at `path` from `offset` for `length` bytes are in the page cache.
func residentPages(_ path: String, offset: Int64, length: Int) -> [Bool] {
    let fd = open(path, O_RDONLY)
    defer { close(fd) }
    guard let p = mmap(nil, length, PROT_READ, MAP_SHARED, fd, off_t(offset)), p != MAP_FAILED else { return [] }
    defer { munmap(p, length) }
    var vec = [UInt8](repeating: 0, count: (length + 4095) / 4096)
    guard mincore(p, length, &vec) == 0 else { return [] }
    return vec.map { $0 & 1 == 1 }
}

@Suite struct CacheFileFormatTests {
    /// Pins the on-disk header byte for byte: if this fails, the format changed — bump
    /// `CacheFileFormat.version` (old caches are then discarded at start-up) and update this.
    @Test func headerIsByteForByteStable() {
        let key = BlockCache.keyHash(endpoint: "https://storage.googleapis.com", bucket: "b", name: "dir/a.bin", generation: 42)
        let f = CacheFileFormat(blockSize: 65536, objectSize: 200_000, generation: 42, keyHash: key)
        let header = f.encodeHeader()
        // Cross-checked with Python's hashlib and a bitwise CRC32C (Castagnoli) implementation.
        #expect(BlockCache.hex(key) == "242045596240480dca027e4040c4c58a03c7a091f6c735adcf553f93cdc60ccc")
        #expect(BlockCache.hex(Array(header[0..<72])) == "53544653424c4b000100000000000100400d0300000000002a00000000000000"
            + "242045596240480dca027e4040c4c58a03c7a091f6c735adcf553f93cdc60ccc" + "04000000" + "973b96eb")
        #expect(header[72...].allSatisfy { $0 == 0 })
        #expect(f.dataOffset == 4096 && f.entryOffset(3) == 152 && f.blockOffset(2) == 4096 + 131072)
        #expect(f.blockLength(3) == 200_000 - 3 * 65536)
        #expect(CacheFileFormat.decodeHeader(header) == f)
        #expect(CacheFileFormat.encode(.init(crc: 0x0102_0304, length: 65536)) == [4, 3, 2, 1, 0, 0, 1, 0])
    }

    @Test func damagedHeadersAreRejected() {
        let f = CacheFileFormat(blockSize: 4096, objectSize: 10, generation: 1, keyHash: Array(repeating: 1, count: 32))
        var h = f.encodeHeader()
        h[20] ^= 1
        #expect(CacheFileFormat.decodeHeader(h) == nil)
        var v = f.encodeHeader()
        v[8] = 2
        #expect(CacheFileFormat.decodeHeader(v) == nil)
    }

    @Test func crc32cMatchesTheCastagnoliCheckValue() {
        let bytes = Array("123456789".utf8)
        #expect(bytes.withUnsafeBytes { Checksum.crc32c($0) } == 0xE306_9283)
        // Lengths around the three-stream thresholds (3 × 256 and 3 × 8192 bytes) and odd tails.
        var rng = SystemRandomNumberGenerator()
        for length in [0, 1, 7, 8, 767, 768, 769, 24_575, 24_576, 24_577, 65_536, 100_003, 262_144, 1_048_583] {
            let bytes = (0..<length).map { _ in UInt8.random(in: 0...255, using: &rng) }
            let fast = bytes.withUnsafeBytes { Checksum.crc32c($0) }
            #expect(fast == bytes.withUnsafeBytes { Checksum.crc32cPortable($0) }, "length \(length)")
        }
    }
}

@Suite struct BlockCacheTests {
    let dir = temporaryDirectory()
    let meta = ObjectMetadata(name: "a/b.bin", bucket: "b", size: 10_000, generation: 5, updated: Timestamp(seconds: 0))

    func storeAll(_ o: CachedObject, _ bytes: [UInt8]) {
        bytes.withUnsafeBytes { o.store(first: 0, $0) }
    }

    func readBack(_ o: CachedObject, block: Int, from: Int = 0, count: Int) -> [UInt8]? {
        var out = [UInt8](repeating: 0, count: count)
        let offset = Int64(block * o.format.blockSize + from)
        let ok = out.withUnsafeMutableBytes { o.read(at: offset, into: $0) }
        return ok ? out : nil
    }

    /// A download that completes its object has its blocks' CRC32Cs computed by its check
    /// (`ObjectIntegrity.landed`); its cache copy takes them instead of reading the bytes again.
    @Test func aStoreGivenItsBlocksCRCsRecordsThoseInsteadOfComputingThem() throws {
        let bytes = pattern(10_000)
        let cache = try BlockCache(directory: dir, capacity: 1 << 20, blockSize: 4096)
        let o = try #require(cache.acquire(endpoint: "e", meta: meta))
        let crcs = bytes.withUnsafeBytes { o.blockCRCs(first: 0, $0) }
        let slices = [bytes[0..<4096], bytes[4096..<8192], bytes[8192...]]
        #expect(crcs == slices.map { s in Array(s).withUnsafeBytes { Checksum.crc32c($0) } })
        // Bytes that end inside a block give the whole blocks only.
        #expect(Array(bytes[0..<5000]).withUnsafeBytes { o.blockCRCs(first: 0, $0) } == [crcs[0]])
        bytes.withUnsafeBytes { o.store(first: 0, $0, crcs: crcs) }
        #expect(readBack(o, block: 0, count: 10_000) == bytes)
        cache.release(o)
        // Given a wrong one, the store records it as given: the block then fails its check.
        var other = meta
        other.generation = 6
        let wrong = try #require(cache.acquire(endpoint: "e", meta: other))
        bytes.withUnsafeBytes { wrong.store(first: 0, $0, crcs: [crcs[0], crcs[1] ^ 1, crcs[2]]) }
        #expect(readBack(wrong, block: 0, count: 4096) == Array(bytes[0..<4096]))
        #expect(readBack(wrong, block: 1, count: 4096) == nil)
        // A list of the wrong length is not used.
        var third = meta
        third.generation = 7
        let short = try #require(cache.acquire(endpoint: "e", meta: third))
        bytes.withUnsafeBytes { short.store(first: 0, $0, crcs: [crcs[0] ^ 1]) }
        #expect(readBack(short, block: 0, count: 10_000) == bytes)
    }

    @Test func storedBlocksSurviveReopeningTheCache() throws {
        let bytes = pattern(10_000)
        do {
            let cache = try BlockCache(directory: dir, capacity: 1 << 20, blockSize: 4096)
            let o = try #require(cache.acquire(endpoint: "e", meta: meta))
            storeAll(o, bytes)
            #expect(readBack(o, block: 2, count: 10_000 - 8192) == Array(bytes[8192...]))
            #expect(readBack(o, block: 1, from: 100, count: 50) == Array(bytes[4196..<4246]))
            cache.release(o)
        }
        let again = try BlockCache(directory: dir, capacity: 1 << 20, blockSize: 4096)
        let o = try #require(again.acquire(endpoint: "e", meta: meta))
        #expect((0..<3).allSatisfy { o.isCached($0) })
        #expect(readBack(o, block: 0, count: 4096) == Array(bytes[0..<4096]))
        // Another generation or endpoint shares nothing.
        var newer = meta
        newer.generation = 6
        let other = try #require(again.acquire(endpoint: "e", meta: newer))
        #expect(!other.isCached(0))
        #expect(!(try #require(again.acquire(endpoint: "f", meta: meta))).isCached(0))
    }

    /// Open files do not decide how many descriptors the cache holds: past `maxOpenFiles`,
    /// idle files let theirs go and open again at their next use (issue 43, item 3).
    @Test func openFilesBeyondTheBoundLetTheirDescriptorsGoAndStillServeTheirBlocks() throws {
        // Descriptors of this test's cache files only: other suites run in this process at once.
        func openDescriptors() -> Int {
            let fds = (try? FileManager.default.contentsOfDirectory(atPath: "/proc/self/fd")) ?? []
            return fds.filter { fd in
                guard let target = try? FileManager.default.destinationOfSymbolicLink(atPath: "/proc/self/fd/\(fd)") else { return false }
                return target.hasPrefix(dir + "/") && target.hasSuffix(".blk")
            }.count
        }
        let cache = try BlockCache(directory: dir, capacity: 16 << 20, blockSize: 4096, maxOpenFiles: 4)
        let before = openDescriptors()
        var objects: [CachedObject] = []
        for i in 0..<40 {
            var m = meta
            m.name = "f\(i)"
            let o = try #require(cache.acquire(endpoint: "e", meta: m))
            storeAll(o, pattern(10_000, seed: UInt8(i)))
            objects.append(o)  // held open, as 40 open file handles hold them
        }
        #expect(cache.openFileCount <= 4)
        // Two descriptors a file (buffered and direct) at most, and the bound is kept: 40 files
        // held open would have held 80.
        #expect(openDescriptors() - before <= 2 * 4 + 2)
        for (i, o) in objects.enumerated() {
            #expect(readBack(o, block: 1, count: 4096) == Array(pattern(10_000, seed: UInt8(i))[4096..<8192]))
        }
        #expect(cache.openFileCount <= 4)
        for o in objects { cache.release(o) }
        #expect(cache.openFileCount == 0)
        #expect(openDescriptors() <= before)
    }

    @Test func corruptedBlockIsNeverServed() throws {
        let cache = try BlockCache(directory: dir, capacity: 1 << 20, blockSize: 4096)
        let o = try #require(cache.acquire(endpoint: "e", meta: meta))
        storeAll(o, pattern(10_000))
        let fd = open(o.path, O_RDWR)
        var junk: UInt8 = 0xFF
        #expect(pwrite(fd, &junk, 1, off_t(o.format.blockOffset(1) + 17)) == 1)
        close(fd)
        #expect(readBack(o, block: 1, count: 4096) == nil)
        #expect(!o.isCached(1) && o.isCached(0))
    }

    @Test func aReadAcrossBlocksIsOneRunAndEveryBlockIsChecked() throws {
        let cache = try BlockCache(directory: dir, capacity: 1 << 20, blockSize: 4096)
        let o = try #require(cache.acquire(endpoint: "e", meta: meta))
        let bytes = pattern(10_000)
        storeAll(o, bytes)
        #expect(o.cachedBytes(from: 100, upTo: 10_000) == 9_900)
        var out = [UInt8](repeating: 0, count: 9_000)
        #expect(out.withUnsafeMutableBytes { o.read(at: 1_000, into: $0) })  // unaligned: through a scratch run
        #expect(out == Array(bytes[1_000..<10_000]))
        var whole = [UInt8](repeating: 0, count: 10_000)
        #expect(whole.withUnsafeMutableBytes { o.read(at: 0, into: $0) })  // aligned: straight into the buffer
        #expect(whole == bytes)
        // Damage in the middle of a run fails the whole read and drops only that block.
        let fd = open(o.path, O_RDWR)
        var junk: UInt8 = 0xFF
        #expect(pwrite(fd, &junk, 1, off_t(o.format.blockOffset(1) + 5)) == 1)
        close(fd)
        #expect(!whole.withUnsafeMutableBytes { o.read(at: 0, into: $0) })
        #expect(o.isCached(0) && !o.isCached(1) && o.isCached(2))
        #expect(o.cachedBytes(from: 0, upTo: 10_000) == 4096)
    }

    /// A download buffer (page-aligned, as `FlightBufferPool`'s) holding `bytes`.
    func aligned(_ bytes: [UInt8]) -> UnsafeMutableRawBufferPointer {
        let b = UnsafeMutableRawBufferPointer.allocate(byteCount: bytes.count, alignment: 4096)
        b.copyBytes(from: bytes)
        return b
    }

    /// Stores an object of 100 KiB + 1,000 bytes in 16 KiB blocks (six whole blocks and a
    /// partial one), whole in one call or in two parts as a file fetched in parts is; returns
    /// which pages of its six whole blocks are in the page cache then, and whether it reads
    /// back as stored (its checks passing).
    func storeAndLook(directWrites: Bool, whole: Bool, seed: UInt8) throws -> (pages: [Bool], readsBack: Bool) {
        var m = meta
        m.size = 103_400
        let bytes = pattern(Int(m.size), seed: seed)
        let cache = try BlockCache(directory: dir, capacity: 1 << 20, blockSize: 16 << 10, directWrites: directWrites)
        let o = try #require(cache.acquire(endpoint: "e", meta: m))
        defer { cache.release(o) }
        let buffer = aligned(bytes)
        defer { buffer.deallocate() }
        if whole {
            o.store(first: 0, UnsafeRawBufferPointer(buffer))
        } else {
            let part = 4 * (16 << 10)
            o.store(first: 0, UnsafeRawBufferPointer(rebasing: buffer[0..<part]))
            o.store(first: 4, UnsafeRawBufferPointer(rebasing: buffer[part...]))
        }
        let pages = residentPages(o.path, offset: o.format.dataOffset, length: 98_304)
        var back = [UInt8](repeating: 0, count: bytes.count)
        let read = back.withUnsafeMutableBytes { o.read(at: 0, into: $0) }
        return (pages, read && back == bytes)
    }

    @Test(arguments: [true, false])
    func cacheDataIsWrittenPastThePageCacheUnlessBuffered(direct: Bool) throws {
        // In two parts (the whole object at once goes through the page cache:
        // `anObjectStoredWholeGoesThroughThePageCache`).
        let (pages, readsBack) = try storeAndLook(directWrites: direct, whole: false, seed: 3)
        // Only the partial last block (its page) may be in the page cache after a direct write.
        #expect(pages.count == 24)
        if direct {
            #expect(pages.allSatisfy { !$0 }, "cache data went through the page cache: \(pages.filter { $0 }.count) of 24 pages resident")
        } else {
            #expect(pages.allSatisfy { $0 })
        }
        // Either way the bytes read back are those stored, and their checks pass.
        #expect(readsBack)
    }

    /// A file fetched whole (`BlockReader.Config.wholeObjectLimit`) is stored in one call: its
    /// data goes through the page cache even where direct writes are on, as a direct write per
    /// small file waits for the disk and costs more than the copy (docs/architecture.md,
    /// "Cache writes").
    @Test func anObjectStoredWholeGoesThroughThePageCache() throws {
        let (pages, readsBack) = try storeAndLook(directWrites: true, whole: true, seed: 4)
        #expect(pages.count == 24)
        #expect(pages.allSatisfy { $0 }, "a whole object went past the page cache: \(pages.filter { !$0 }.count) of 24 pages not resident")
        #expect(readsBack)
    }

    /// A read of one block (a random read) whose pages the kernel let go is read past the page
    /// cache, not into it beside the mounted file's own page (docs/architecture.md, "Cached
    /// runs ahead"): the object's last, partial block too (its direct read ends at the file's
    /// end). A run of blocks is read through the page cache, where the kernel's read-ahead of
    /// the cache file serves sequential readers.
    @Test func aBlockWhosePagesWentIsReadPastThePageCache() throws {
        var m = meta
        m.size = 103_400
        let bytes = pattern(Int(m.size), seed: 5)
        let cache = try BlockCache(directory: dir, capacity: 1 << 20, blockSize: 16 << 10, directWrites: true)
        let o = try #require(cache.acquire(endpoint: "e", meta: m))
        defer { cache.release(o) }
        let buffer = aligned(bytes)
        defer { buffer.deallocate() }
        let part = 4 * (16 << 10)
        o.store(first: 0, UnsafeRawBufferPointer(rebasing: buffer[0..<part]))
        o.store(first: 4, UnsafeRawBufferPointer(rebasing: buffer[part...]))
        // The buffered tail and index pages out of memory too, as memory pressure takes them.
        let fd = open(o.path, O_RDONLY)
        #expect(fsync(fd) == 0 && posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED) == 0)
        close(fd)
        func readsBack(_ offset: Int, _ count: Int) -> Bool {
            var got = [UInt8](repeating: 0, count: count)
            return got.withUnsafeMutableBytes { o.read(at: Int64(offset), into: $0) } && got == Array(bytes[offset..<(offset + count)])
        }
        func resident(block: Int, count: Int = 1) -> Int {
            residentPages(o.path, offset: o.format.blockOffset(block), length: count * (16 << 10)).filter { $0 }.count
        }
        #expect(resident(block: 2) == 0 && resident(block: 6) == 0)
        #expect(readsBack(2 * (16 << 10) + 4096, 4096))
        #expect(readsBack(6 * (16 << 10) + 1000, 4000))
        #expect(resident(block: 2) == 0, "a random read of a block filled the cache file's pages")
        #expect(resident(block: 6) == 0, "a random read of the last block filled the cache file's pages")
        #expect(readsBack(0, 2 * (16 << 10)))
        #expect(resident(block: 0, count: 2) == 8)
    }

    @Test func directWritesOfOneObjectRunAtOnceAndStoreEveryBlockOnce() throws {
        // 8 threads store the same 8 MiB object, each in 2 MiB parts in its own order, so
        // parts of one file are written side by side and some twice at once.
        var m = meta
        m.size = 8 << 20
        let bytes = pattern(Int(m.size), seed: 5)
        let cache = try BlockCache(directory: dir, capacity: 64 << 20, blockSize: 16 << 10)
        let o = try #require(cache.acquire(endpoint: "e", meta: m))
        let before = cache.usedBytes
        let buffer = aligned(bytes)
        defer { buffer.deallocate() }
        let part = 2 << 20
        let address = Int(bitPattern: buffer.baseAddress)  // Sendable; the buffer outlives the threads
        DispatchQueue.concurrentPerform(iterations: 8) { t in
            for k in 0..<4 {
                let p = (k + t) % 4
                let slice = UnsafeRawBufferPointer(start: UnsafeRawPointer(bitPattern: address)! + p * part, count: part)
                o.store(first: p * part / (16 << 10), slice)
            }
        }
        var whole = [UInt8](repeating: 0, count: bytes.count)
        #expect(whole.withUnsafeMutableBytes { o.read(at: 0, into: $0) })
        #expect(whole == bytes)
        // Each block counted once against the cap, and on disk once.
        #expect(o.storedBytes == m.size)
        #expect(cache.usedBytes - before == m.size)
        var st = stat()
        #expect(stat(o.path, &st) == 0)
        #expect(Int64(st.st_blocks) * 512 <= m.size + (64 << 10), "allocated \(Int64(st.st_blocks) * 512)")
        cache.release(o)
    }

    /// Index pages written past the page cache are built from the index in memory: 8 threads
    /// storing single blocks of one object at once, all of whose entries share one page, must
    /// leave every entry on disk (a page built before another writer's entry and written after
    /// it would drop that entry), as a reopened cache shows.
    @Test func indexEntriesStoredSideBySideAllSurviveReopeningTheCache() throws {
        var m = meta
        m.size = 4 << 20  // 256 blocks of 16 KiB: their 2 KiB of entries lie in the first page
        let bytes = pattern(Int(m.size), seed: 11)
        let buffer = aligned(bytes)
        defer { buffer.deallocate() }
        let block = 16 << 10
        do {
            let cache = try BlockCache(directory: dir, capacity: 64 << 20, blockSize: block)
            let o = try #require(cache.acquire(endpoint: "e", meta: m))
            let address = Int(bitPattern: buffer.baseAddress)
            DispatchQueue.concurrentPerform(iterations: 8) { t in
                for b in stride(from: t, to: 256, by: 8) {
                    let slice = UnsafeRawBufferPointer(start: UnsafeRawPointer(bitPattern: address)! + b * block, count: block)
                    o.store(first: b, slice, ahead: t % 2 == 0)
                }
            }
            #expect(o.storedBytes == m.size)
            cache.release(o)
        }
        let again = try BlockCache(directory: dir, capacity: 64 << 20, blockSize: block)
        let o = try #require(again.acquire(endpoint: "e", meta: m))
        let missing = (0..<256).filter { !o.isCached($0) }
        #expect(missing.isEmpty, "blocks without an entry on disk: \(missing)")
        var whole = [UInt8](repeating: 0, count: bytes.count)
        #expect(whole.withUnsafeMutableBytes { o.read(at: 0, into: $0) })
        #expect(whole.elementsEqual(bytes))  // a Bool: no element-wise diff of 4 MiB
        again.release(o)
    }

    /// Stores beside direct data writes set their index entries before the file's index lock,
    /// and whoever holds it writes, once it lets go, every page set meanwhile: 8 stores made
    /// while one index write is under way make one write between them, not 8 one after the
    /// other (each waits for the disk: on a cold loopback read 40 finished parts waited in that
    /// queue), and every entry is on disk, as a reopened cache shows.
    @Test func storesQueuedBehindAnIndexWriteAreWrittenTogether() throws {
        let (m, bytes, buffer) = fourMiBObject(seed: 13)
        defer { buffer.deallocate() }
        let block = 16 << 10
        let address = Int(bitPattern: buffer.baseAddress)
        @Sendable func slice(_ b: Int) -> UnsafeRawBufferPointer {
            UnsafeRawBufferPointer(start: UnsafeRawPointer(bitPattern: address)! + b * block, count: block)
        }
        let stores = [3, 40, 77, 100, 130, 170, 200, 255]
        do {
            let cache = try BlockCache(directory: dir, capacity: 64 << 20, blockSize: block)
            let o = try #require(cache.acquire(endpoint: "e", meta: m))
            o.store(first: 0, slice(0))  // allocates the index pages: later writes overwrite
            let before = o.indexWrites
            let group = DispatchGroup()
            let queued = o.withIndexWritesHeld { () -> UInt64 in
                // A thread each (Dispatch's pool on Linux does not grow past blocked workers:
                // when stores blocked on the index lock, beside the other suites one never ran).
                for b in stores {
                    group.enter()
                    Thread { o.store(first: b, slice(b)); group.leave() }.start()
                }
                let deadline = Date().addingTimeInterval(10)
                while o.unwrittenIndexSets < UInt64(stores.count), Date() < deadline { usleep(1000) }
                return o.unwrittenIndexSets
            }
            group.wait()
            #expect(queued == UInt64(stores.count), "entry sets waiting for the index lock")
            #expect(o.indexWrites - before == 1, "index writes for \(stores.count) queued stores")
            #expect(o.unwrittenIndexSets == 0)
            cache.release(o)
        }
        let again = try BlockCache(directory: dir, capacity: 64 << 20, blockSize: block)
        let o = try #require(again.acquire(endpoint: "e", meta: m))
        let missing = ([0] + stores).filter { !o.isCached($0) }
        #expect(missing.isEmpty, "blocks without an entry on disk: \(missing)")
        var got = [UInt8](repeating: 0, count: block)
        for b in stores {
            #expect(got.withUnsafeMutableBytes { o.read(at: Int64(b * block), into: $0) })
            #expect(got.elementsEqual(bytes[(b * block)..<((b + 1) * block)]))
        }
        again.release(o)
    }

    /// A store does not wait for an index write made by another thread: its data is on disk
    /// and its entries set in memory, so it leaves them to the holder of the index lock and
    /// returns (a part's buffer is let go then). Waiting there, a 2 MiB part through `wan`
    /// spent ~10–16 ms behind index pages queued at the disk, and 40 finished parts at a time
    /// held their buffers. Once the holder lets go, the entries it was left are on disk.
    @Test func aStoreDoesNotWaitForAnIndexWriteUnderWay() throws {
        let (m, bytes, buffer) = fourMiBObject(seed: 17)
        defer { buffer.deallocate() }
        let block = 16 << 10
        let address = Int(bitPattern: buffer.baseAddress)
        let part = 64  // blocks: 1 MiB
        do {
            let cache = try BlockCache(directory: dir, capacity: 64 << 20, blockSize: block)
            let o = try #require(cache.acquire(endpoint: "e", meta: m))
            o.store(first: 0, UnsafeRawBufferPointer(start: buffer.baseAddress, count: block))  // the index pages allocated
            let done = DispatchSemaphore(value: 0)
            let returned = o.withIndexWritesHeld { () -> Bool in
                Thread {
                    o.store(first: part, UnsafeRawBufferPointer(start: UnsafeRawPointer(bitPattern: address)! + part * block,
                                                                count: part * block))
                    done.signal()
                }.start()
                return done.wait(timeout: .now() + 5) == .success
            }
            if !returned { done.wait() }
            #expect(returned, "the store waited for the index lock")
            #expect((part..<(2 * part)).allSatisfy { o.isCached($0) })
            #expect(o.unwrittenIndexSets == 0, "entry sets left unwritten once the lock was let go")
            cache.release(o)
        }
        let again = try BlockCache(directory: dir, capacity: 64 << 20, blockSize: block)
        let o = try #require(again.acquire(endpoint: "e", meta: m))
        let missing = ([0] + Array(part..<(2 * part))).filter { !o.isCached($0) }
        #expect(missing.isEmpty, "blocks without an entry on disk: \(missing)")
        var got = [UInt8](repeating: 0, count: part * block)
        #expect(got.withUnsafeMutableBytes { o.read(at: Int64(part * block), into: $0) })
        #expect(got.elementsEqual(bytes[(part * block)..<(2 * part * block)]))
        again.release(o)
    }

    /// A 4 MiB object, its bytes, and a page-aligned copy of them (for direct writes).
    func fourMiBObject(seed: UInt8) -> (ObjectMetadata, [UInt8], UnsafeMutableRawBufferPointer) {
        var m = meta
        m.size = 4 << 20
        let bytes = pattern(Int(m.size), seed: seed)
        return (m, bytes, aligned(bytes))
    }

    /// An object of `mib` MiB (40: three 16 MiB allocation chunks) and a 2 MiB part of it,
    /// page-aligned.
    func objectAndAPart(mib: Int64 = 40, seed: UInt8) -> (ObjectMetadata, UnsafeMutableRawBufferPointer) {
        var m = meta
        m.size = mib << 20
        return (m, aligned(pattern(2 << 20, seed: seed)))
    }

    /// Read-ahead allocates its data 16 MiB at a time, once (allocating waits for every direct
    /// write of the file under way: once per part queued 8 readers' writers behind each
    /// other); a reader's own miss, random reads mostly, allocates no more than its blocks; and
    /// what the chunks hold beyond the blocks written goes when the file is closed, as the
    /// cap does not count it. A small cap (chunks of 1/64 of it under 4 MiB) allocates per run.
    @Test func readAheadAllocatesWholeChunksOnceAndLetsTheRestGoAtClose() throws {
        let (m, part) = objectAndAPart(seed: 3)
        defer { part.deallocate() }
        let cache = try BlockCache(directory: dir, capacity: 1 << 30, blockSize: 16 << 10)
        let o = try #require(cache.acquire(endpoint: "e", meta: m))
        func allocated(_ o: CachedObject) -> Int64 { allocatedBytes(o.path) - o.overheadBytes }
        o.store(first: 0, UnsafeRawBufferPointer(part), ahead: true)
        #expect(allocated(o) >= 16 << 20 && allocated(o) < 17 << 20, "allocated \(allocated(o))")
        o.store(first: 128, UnsafeRawBufferPointer(part), ahead: true)  // the same chunk
        #expect(allocated(o) < 17 << 20, "allocated \(allocated(o))")
        // A miss at 32 MiB, in a chunk nothing was read ahead into: its 2 MiB only.
        o.store(first: 2048, UnsafeRawBufferPointer(part))
        #expect(allocated(o) >= 18 << 20 && allocated(o) < 19 << 20, "allocated \(allocated(o))")
        cache.release(o)
        #expect(allocated(o) <= (6 << 20) + (64 << 10), "after close: allocated \(allocated(o)) for 6 MiB of blocks")
        #expect(o.storedBytes == 6 << 20)

        let small = try BlockCache(directory: temporaryDirectory(), capacity: 128 << 20, blockSize: 16 << 10)
        let p = try #require(small.acquire(endpoint: "e", meta: m))
        p.store(first: 0, UnsafeRawBufferPointer(part), ahead: true)
        #expect(allocated(p) <= (2 << 20) + (64 << 10), "allocated \(allocated(p)) under a 128 MiB cap")
        small.release(p)
    }

    /// Each allocation waits for every direct write of the file under way, so read-ahead that
    /// needs a chunk allocates as many chunks after it as the file already holds (here at most
    /// 4 at once: 1/64 of a 4 GiB cap): 16, then 32, then 64 MiB, never past the object, and
    /// never ahead for a file that holds nothing yet. What goes beyond the blocks goes at close.
    @Test func readAheadAllocatesAheadAsManyChunksAsTheFileHolds() throws {
        let (m, part) = objectAndAPart(mib: 160, seed: 7)  // ten 16 MiB chunks
        defer { part.deallocate() }
        let cache = try BlockCache(directory: dir, capacity: 4 << 30, blockSize: 16 << 10)
        let o = try #require(cache.acquire(endpoint: "e", meta: m))
        func allocated() -> Int64 { allocatedBytes(o.path) - o.overheadBytes }
        func store(atMiB mib: Int) { o.store(first: (mib << 20) / (16 << 10), UnsafeRawBufferPointer(part), ahead: true) }
        let slack: Int64 = 1 << 20
        store(atMiB: 0)  // chunk 0 only: the file held nothing
        #expect(allocated() >= 16 << 20 && allocated() < (16 << 20) + slack, "allocated \(allocated())")
        store(atMiB: 16)  // chunk 1, and 1 ahead
        #expect(allocated() >= 48 << 20 && allocated() < (48 << 20) + slack, "allocated \(allocated())")
        store(atMiB: 32)  // inside chunk 2, allocated ahead: nothing more
        #expect(allocated() < (48 << 20) + slack, "allocated \(allocated())")
        store(atMiB: 48)  // chunk 3 and 3 ahead: 4 at once, the most
        #expect(allocated() >= 112 << 20 && allocated() < (112 << 20) + slack, "allocated \(allocated())")
        store(atMiB: 112)  // chunk 7 and the 2 left before the object's end
        #expect(allocated() >= 160 << 20 && allocated() < (160 << 20) + slack, "allocated \(allocated())")
        cache.release(o)
        #expect(allocated() <= (10 << 20) + (64 << 10), "after close: allocated \(allocated()) for 10 MiB of blocks")
        #expect(o.storedBytes == 10 << 20)
    }

    /// A daemon killed while reading ahead leaves its chunks allocated beyond the blocks
    /// written: the next mount lets that go the first time it opens the file, and keeps the
    /// blocks.
    @Test func allocationLeftByAKilledDaemonGoesAtTheNextOpen() throws {
        let (m, part) = objectAndAPart(seed: 4)
        defer { part.deallocate() }
        let path: String
        do {
            let cache = try BlockCache(directory: dir, capacity: 1 << 30, blockSize: 16 << 10)
            let o = try #require(cache.acquire(endpoint: "e", meta: m))
            o.store(first: 0, UnsafeRawBufferPointer(part), ahead: true)
            path = o.path
            cache.release(o)
        }
        // What the killed daemon's chunk allocation left (its close never ran): 24 MiB more.
        let fd = open(path, O_RDWR)
        #expect(fd >= 0)
        #expect(posix_fallocate(fd, 8 << 20, 24 << 20) == 0)  // inside the file: its size unchanged
        close(fd)
        func allocated() -> Int64 { allocatedBytes(path) }
        #expect(allocated() > 24 << 20)
        let again = try BlockCache(directory: dir, capacity: 1 << 30, blockSize: 16 << 10)
        let o = try #require(again.acquire(endpoint: "e", meta: m))
        #expect(allocated() <= o.overheadBytes + (2 << 20) + (64 << 10), "allocated \(allocated()) after the first open")
        var back = [UInt8](repeating: 0, count: 2 << 20)
        #expect(back.withUnsafeMutableBytes { o.read(at: 0, into: $0) })
        #expect(back.elementsEqual(UnsafeRawBufferPointer(part)))
        again.release(o)
    }

    @Test func unalignedBuffersAndOffsetsAreWrittenBufferedAndReadBackWhole() throws {
        var m = meta
        m.size = 70_000
        let bytes = pattern(Int(m.size), seed: 9)
        let cache = try BlockCache(directory: dir, capacity: 1 << 20, blockSize: 16 << 10)
        let o = try #require(cache.acquire(endpoint: "e", meta: m))
        // An aligned buffer for the first block; the rest from an array at whatever address
        // it has, one byte in (never page-aligned).
        let first = aligned(Array(bytes[0..<16_384]))
        defer { first.deallocate() }
        o.store(first: 0, UnsafeRawBufferPointer(first))
        let shifted = [0] + Array(bytes[16_384...])
        shifted.withUnsafeBytes { o.store(first: 1, UnsafeRawBufferPointer(rebasing: $0[1...])) }
        var whole = [UInt8](repeating: 0, count: bytes.count)
        #expect(whole.withUnsafeMutableBytes { o.read(at: 0, into: $0) })
        #expect(whole == bytes)
        cache.release(o)
    }

    @Test func capIsHardAndLeastRecentlyUsedGoesFirst() throws {
        let cap: Int64 = 64 << 10
        let cache = try BlockCache(directory: dir, capacity: cap, blockSize: 4096)
        var objects: [CachedObject] = []
        for g in 1...6 {
            var m = meta
            m.generation = Int64(g)
            m.size = 16_384
            let o = try #require(cache.acquire(endpoint: "e", meta: m))
            storeAll(o, pattern(16_384, seed: UInt8(g)))
            #expect(cache.usedBytes <= cap)
            objects.append(o)
            _ = readBack(objects[0], block: 0, count: 4096)  // keep the first one hot
        }
        #expect(objects[0].isCached(0))
        #expect(!objects[1].isCached(0))
        var onDisk: Int64 = 0
        let e = FileManager.default.enumerator(atPath: cache.files.versionPath)!
        while let f = e.nextObject() as? String {
            var st = stat()
            stat(cache.files.versionPath + "/" + f, &st)
            if st.st_mode & S_IFMT == S_IFREG { onDisk += Int64(st.st_blocks) * 512 }
        }
        #expect(onDisk <= cap + 8192, "allocated \(onDisk)")
    }

    @Test func aCacheDirectoryAnOlderStorefsHoldsIsRefused() throws {
        // Older versions (and `storefs cache clear`) lock cache_dir exclusively; mounts share it.
        let first = try BlockCache(directory: dir, capacity: 1 << 20, blockSize: 4096)
        let second = try BlockCache(directory: dir, capacity: 1 << 20, blockSize: 4096)
        withExtendedLifetime((first, second)) {}
        let other = temporaryDirectory()
        let old = open(other, O_RDONLY | O_DIRECTORY)
        defer { close(old) }
        #expect(flock(old, LOCK_EX | LOCK_NB) == 0)
        #expect { _ = try BlockCache(directory: other, capacity: 1 << 20, blockSize: 4096) } throws: {
            ($0 as? FilesystemError)?.message.contains("held by an older storefs version") == true
        }
    }

    @Test func racingFirstOpensShareOneFile() throws {
        let cache = try BlockCache(directory: dir, capacity: 1 << 20, blockSize: 4096)
        let got = Mutex<[CachedObject]>([])
        let group = DispatchGroup()
        for _ in 0..<8 {
            group.enter()
            Thread {
                if let o = cache.acquire(endpoint: "e", meta: meta) { got.withLock { $0.append(o) } }
                group.leave()
            }.start()
        }
        group.wait()
        let objects = got.withLock { $0 }
        #expect(objects.count == 8 && objects.allSatisfy { $0 === objects[0] })
        #expect(FileManager.default.fileExists(atPath: objects[0].path))
        storeAll(objects[0], pattern(10_000))
        #expect(readBack(objects[0], block: 0, count: 4096) == Array(pattern(10_000)[0..<4096]))
    }

    @Test func cacheFilesArePrivateAndNamedByHash() throws {
        let dir = self.dir + "/fresh"  // made by the cache itself: 0700
        let cache = try BlockCache(directory: dir, capacity: 1 << 20, blockSize: 4096)
        let o = try #require(cache.acquire(endpoint: "e", meta: meta))
        var st = stat()
        stat(dir, &st)
        #expect(st.st_mode & 0o777 == 0o700)
        stat(cache.files.versionPath, &st)
        #expect(st.st_mode & 0o777 == 0o700)
        stat(o.path, &st)
        #expect(st.st_mode & 0o777 == 0o600)
        #expect(!o.path.contains("b.bin") && o.path.hasSuffix(".blk"))
    }

    @Test func leftoverTempFilesAndOtherVersionsAreRemovedAtStart() throws {
        _ = try BlockCache(directory: dir, capacity: 1 << 20, blockSize: 4096)
        let shard = dir + "/v1/ab"
        mkdir(shard, 0o700)
        _ = FileManager.default.createFile(atPath: shard + "/junk.blk.tmp123-4", contents: Data([1, 2, 3]))
        _ = try BlockCache(directory: dir, capacity: 1 << 20, blockSize: 4096)
        #expect(!FileManager.default.fileExists(atPath: shard + "/junk.blk.tmp123-4"))
    }
}

@Suite struct PrefetcherTests {
    @Test func sequentialReadsOpenAWindowThatGrowsInWholeParts() {
        var p = Prefetcher(minWindow: 8 << 20, maxWindow: 32 << 20)
        let mib: Int64 = 1 << 20
        #expect(p.observe(offset: 0, count: 1 << 20, size: 1 << 30) == mib..<(9 * mib))
        #expect(p.observe(offset: mib, count: 1 << 20, size: 1 << 30) == nil)  // less than a part to add
        // The window grows fourfold per read (8 → 32 MiB, the ceiling): 3 MiB read + 32 ahead.
        let third = p.observe(offset: 2 * mib, count: 1 << 20, size: 1 << 30)
        // 9 + 32 would end short of a part: the window ends on the last whole one.
        #expect(third == (9 * mib)..<(33 * mib))
        var scheduled: Int64 = 33 * mib
        for i in 3..<40 {
            if let r = p.observe(offset: Int64(i) * mib, count: 1 << 20, size: 1 << 30) {
                #expect(r.lowerBound == scheduled && r.count >= 8 << 20 && r.upperBound <= Int64(i + 1) * mib + (32 << 20))
                scheduled = r.upperBound
            }
        }
        #expect(scheduled >= 40 * mib + (24 << 20))
    }

    @Test func theKernelsReadaheadForAShortReadGetsOnlyTheFirstWindow() {
        // `head -c 100000`: the kernel reads 32 KiB, then 128 and 256 KiB ahead of it. Three
        // sequential reads, but 416 KiB read: the window opens (2 MiB) and does not grow.
        var p = Prefetcher(minWindow: 2 << 20, maxWindow: 256 << 20)
        let kib: Int64 = 1 << 10, mib: Int64 = 1 << 20, size: Int64 = 1 << 30
        var ahead: Int64 = 0
        for (offset, count) in [(0, 32), (32, 128), (160, 256)] as [(Int64, Int)] {
            ahead += Int64(p.observe(offset: offset * kib, count: count << 10, size: size, granularity: 8 * mib)?.count ?? 0)
        }
        #expect(ahead == 2 * mib)
        #expect(!p.hasEvidence)
        // A reader that goes on is a stream once it has read 1 MiB: the window grows ×4 per read.
        _ = p.observe(offset: 416 * kib, count: 512 << 10, size: size, granularity: 8 * mib)
        let grown = p.observe(offset: 928 * kib, count: 1 << 20, size: size, granularity: 8 * mib)
        #expect(p.hasEvidence)
        #expect(grown.map { $0.upperBound >= 8 * mib } == true, "\(String(describing: grown))")
    }

    @Test func aWindowEndsOnAWholePartUnlessTheFileEnds() {
        // Parts of 8 MiB, 1 MiB reads: the window (up to 64 MiB) slides by whole parts only,
        // so no GET is a sliver of a part that waits a whole first byte for a fraction of one.
        var p = Prefetcher(minWindow: 2 << 20, maxWindow: 64 << 20)
        let mib: Int64 = 1 << 20, size: Int64 = 300 * mib + 12345
        var ranges: [Range<Int64>] = []
        for i in 0..<Int64(300) {
            if let r = p.observe(offset: i * mib, count: 1 << 20, size: size, granularity: 8 * mib) { ranges.append(r) }
        }
        #expect(ranges.count > 10)
        for (i, r) in ranges.enumerated() {
            #expect(i == 0 || r.lowerBound == ranges[i - 1].upperBound)
            if r.lowerBound >= 3 * mib, r.upperBound < size { #expect(r.count % Int(8 * mib) == 0, "\(r) is not whole parts") }
        }
        #expect(ranges.last?.upperBound == size)
    }

    @Test func randomAccessGetsNoReadAhead() {
        var p = Prefetcher(minWindow: 8 << 20, maxWindow: 64 << 20)
        var rng = SystemRandomNumberGenerator()
        var ahead = 0
        _ = p.observe(offset: 500 << 20, count: 4096, size: 1 << 30)
        for _ in 0..<500 {
            let off = Int64.random(in: 0..<(1 << 30), using: &rng) & ~4095
            if p.observe(offset: off, count: 4096, size: 1 << 30) != nil { ahead += 1 }
        }
        #expect(ahead <= 2)
    }

    @Test func cachedBytesAreWarmedAShortReachAheadOfAStreamOnly() {
        // The download window grows to 64 MiB; cached bytes are asked from disk 4 MiB ahead of
        // the reader, each byte once, and not at all for random reads.
        var p = Prefetcher(minWindow: 2 << 20, maxWindow: 64 << 20)
        let mib: Int64 = 1 << 20, size: Int64 = 100 * mib, reach: Int64 = 4 * mib
        var warmed: [Range<Int64>] = []
        for i in 0..<Int64(20) {
            _ = p.observe(offset: i * mib, count: 1 << 20, size: size, granularity: 8 * mib)
            if let r = p.warm(reach: reach, size: size) {
                #expect(r.upperBound <= (i + 1) * mib + reach, "\(r) reaches past the read's end + 4 MiB")
                #expect(warmed.last.map { $0.upperBound == r.lowerBound } ?? (r.lowerBound == mib))
                warmed.append(r)
            }
        }
        #expect(warmed.last?.upperBound == 24 * mib)
        // A jump elsewhere is not a stream: nothing is warmed, then a new streak warms from its end.
        _ = p.observe(offset: 70 * mib, count: 4096, size: size)
        #expect(p.warm(reach: reach, size: size) == nil)
        _ = p.observe(offset: 70 * mib + 4096, count: 4096, size: size)
        #expect(p.warm(reach: reach, size: size) == nil)
        _ = p.observe(offset: 70 * mib + 8192, count: 4096, size: size)
        #expect(p.warm(reach: reach, size: size) == (70 * mib + 12288)..<(74 * mib + 12288))
        // Never past the end of the file.
        _ = p.observe(offset: 70 * mib + 12288, count: 28 << 20, size: size)
        #expect(p.warm(reach: reach, size: size) == (98 * mib + 12288)..<size)
    }

    @Test func windowStopsAtEndOfFile() {
        var p = Prefetcher(minWindow: 8 << 20, maxWindow: 64 << 20)
        #expect(p.observe(offset: 0, count: 1 << 20, size: 3 << 20) == (1 << 20)..<(3 << 20))
        #expect(p.observe(offset: 1 << 20, count: 1 << 20, size: 3 << 20) == nil)
    }
}

@Suite struct BlockReaderTests {
    /// Object "f" of `size` pattern bytes, read through 16 KiB blocks and 4 MiB read-ahead parts
    /// within 64 MiB of memory: the shape the read-ahead tests share.
    private func streaming(size: Int, cached: Bool, readAhead: Int64, cacheWrites: CacheWrites = .all,
                           writer: CacheWriter? = nil) throws -> (MemoryStore, [UInt8], BlockCache?, BlockReader) {
        let store = MemoryStore()
        let bytes = pattern(size)
        store.put("f", bytes)
        let cache = cached ? try BlockCache(directory: temporaryDirectory(), capacity: 256 << 20, blockSize: 16 << 10) : nil
        let config = BlockReader.Config(blockSize: 16 << 10, readAhead: readAhead, partSize: 4 << 20, memoryLimit: 64 << 20,
                                        cacheWrites: cacheWrites)
        let reader = writer.map { BlockReader(store: store, cache: cache, endpoint: "e", config: config, writer: $0) }
            ?? BlockReader(store: store, cache: cache, endpoint: "e", config: config)
        return (store, bytes, cache, reader)
    }

    @Test func concurrentReadersOfOneBlockShareOneDownload() throws {
        let store = MemoryStore()
        store.put("f", pattern(1 << 20))
        let reader = BlockReader(store: store, cache: nil, endpoint: "e",
                                 config: .init(blockSize: 64 << 10, readAhead: 0, memoryLimit: 8 << 20))
        let meta = try store.metadata(of: "f")
        store.delayReads(0.3)
        let results = Mutex<[[UInt8]]>([])
        let group = DispatchGroup()
        for _ in 0..<4 {
            group.enter()
            // Threads of our own, as in the daemon: the cooperative pool has only two.
            Thread {
                let stream = reader.openStream(meta)
                var out = [UInt8](repeating: 0, count: 4096)
                try? out.withUnsafeMutableBytes { try reader.readWaiting(stream, at: 70_000, into: $0, isCancelled: nil) }
                results.withLock { $0.append(out) }
                group.leave()
            }.start()
        }
        group.wait()
        #expect(results.withLock { $0.count } == 4)
        #expect(results.withLock { $0 }.allSatisfy { $0 == Array(pattern(1 << 20)[70_000..<74_096]) })
        #expect(store.requests.read == 1)
    }

    /// A reader that needs a block of read-ahead still queued behind another file's downloads
    /// downloads it itself instead of waiting for the prefetch thread to get there.
    @Test func aReaderClaimsQueuedReadAheadInsteadOfWaitingBehindOtherFiles() throws {
        let store = MemoryStore()
        store.put("a", pattern(32 << 20, seed: 1))
        store.put("b", pattern(32 << 20, seed: 2))
        let reader = BlockReader(store: store, cache: nil, endpoint: "e",
                                 config: .init(blockSize: 16 << 10, readAhead: 16 << 20, parallel: 1,
                                               partSize: 4 << 20, memoryLimit: 64 << 20))
        let a = reader.openStream(try store.metadata(of: "a"))
        let b = reader.openStream(try store.metadata(of: "b"))
        store.delayReads(0.5)
        var scratch = [UInt8](repeating: 0, count: 1 << 20)
        // b's sequential reads queue three 4 MiB parts on the one prefetch thread (1.5 s)...
        for mib in 0..<3 { _ = scratch.withUnsafeMutableBytes { reader.readHere(b, at: Int64(mib) << 20, into: $0) } }
        // ...then a's first read queues a's first part behind them.
        _ = scratch.withUnsafeMutableBytes { reader.readHere(a, at: 0, into: $0) }
        let start = Date()
        var out = [UInt8](repeating: 0, count: 4096)
        try out.withUnsafeMutableBytes { try reader.readWaiting(a, at: 2 << 20, into: $0, isCancelled: nil) }
        let took = Date().timeIntervalSince(start)
        // One download (0.5 s) rather than four in a row (2 s).
        #expect(took < 1.5, "waited behind b's read-ahead")
        #expect(out == Array(pattern(32 << 20, seed: 1)[(2 << 20)..<((2 << 20) + 4096)]))
        reader.finishPendingWork(timeout: 10)
    }

    @Test func randomReadFetchesOnlyItsBlocksAndHitsNeedNoNetwork() throws {
        let store = MemoryStore()
        // Larger than `BlockReader.defaultWholeObjectLimit`: a miss fetches its block, not the object.
        let size = Int(BlockReader.defaultWholeObjectLimit) * 2
        store.put("f", pattern(size))
        let dir = temporaryDirectory()
        let cache = try BlockCache(directory: dir, capacity: 64 << 20, blockSize: 64 << 10)
        let reader = BlockReader(store: store, cache: cache, endpoint: "e", config: .init(blockSize: 64 << 10))
        let meta = try store.metadata(of: "f")
        let stream = reader.openStream(meta)
        var out = [UInt8](repeating: 0, count: 4096)
        try out.withUnsafeMutableBytes { try reader.readWaiting(stream, at: 3_000_000, into: $0, isCancelled: nil) }
        #expect(out == Array(pattern(size)[3_000_000..<3_004_096]))
        #expect(store.requests.read == 1 && store.bytesRead == 64 << 10)
        #expect(out.withUnsafeMutableBytes { reader.readHere(stream, at: 3_000_100, into: $0) })
        #expect(store.requests.read == 1)
        reader.closeStream(stream)
    }

    /// Read-ahead stays in memory once cached until its reader has copied it (no disk read, no
    /// CRC pass), and not after: a part read to its end goes, and closing the file lets go of
    /// what was never read.
    @Test func readAheadIsKeptUntilItsReaderHasItThenLetGo() throws {
        let (store, bytes, cache, reader) = try streaming(size: 32 << 20, cached: true, readAhead: 16 << 20)
        store.reportFirstByte(0.0002)  // a near server
        let stream = reader.openStream(try store.metadata(of: "f"))
        var out = [UInt8](repeating: 0, count: 1 << 20)
        for i in 0..<2 {
            try out.withUnsafeMutableBytes { try reader.readWaiting(stream, at: Int64(i) << 20, into: $0, isCancelled: nil) }
        }
        reader.finishPendingWork(timeout: 10)
        #expect(reader.transfers.isNear)
        // The first window (1..3 MiB) landed, was written to the cache, and 2..3 MiB is not read
        // yet: its download buffer is still held, and the next read is served from it.
        // (held by identity only: a reference here would hold its buffer and budget)
        let part = try #require(stream.flights.flight(for: (2 << 20) / (16 << 10)).map { f in
            #expect(f.finished != nil && f.end == 3 << 20)
            return ObjectIdentifier(f)
        })
        let blockCache = try #require(cache)
        #expect(blockCache.acquire(endpoint: "e", meta: stream.meta).map { c in
            defer { blockCache.release(c) }
            return c.cachedBytes(from: 1 << 20, upTo: 3 << 20)
        } == 2 << 20, "the part's cache copy is made")
        #expect(reader.budget.inUse >= 2 << 20)
        var sent: [UInt8] = []
        var wasSent = false
        #expect(out.withUnsafeMutableBytes { dst in
            reader.readHere(stream, at: 2 << 20, into: dst, borrowed: { sent = Array($0); wasSent = true })
        })
        #expect(wasSent && sent == Array(bytes[(2 << 20)..<(3 << 20)]), "served from the download's buffer")
        #expect(stream.flights.flight(for: (2 << 20) / (16 << 10)).map(ObjectIdentifier.init) != part,
                "read to its end, the part is let go")
        // That read widened the window to 3..11 MiB: once landed, every MiB is served.
        reader.finishPendingWork(timeout: 10)
        for i in 3..<11 {
            #expect(out.withUnsafeMutableBytes { reader.readHere(stream, at: Int64(i) << 20, into: $0) }, "at \(i) MiB")
            #expect(out == Array(bytes[(i << 20)..<((i + 1) << 20)]))
        }
        reader.finishPendingWork(timeout: 10)
        reader.closeStream(stream)
        #expect(budgetSettles(reader), "read-ahead nobody read is let go at close")
    }

    /// A read that had to wait for a download lying wholly under it is handed to `send` from the
    /// download's buffer (no copy into the reply buffer); one that a download only partly holds
    /// is copied into the reply buffer as before.
    @Test func aReadInsideOneDownloadIsRepliedFromItsBuffer() throws {
        let (store, bytes, _, reader) = try streaming(size: 8 << 20, cached: true, readAhead: 4 << 20)
        store.reportFirstByte(0.0002)
        let stream = reader.openStream(try store.metadata(of: "f"))
        defer {
            reader.finishPendingWork(timeout: 10)
            reader.closeStream(stream)
        }
        var out = [UInt8](repeating: 0, count: 1 << 20)
        var sent: [UInt8] = []
        var wasSent = false
        var sentFrom: UnsafeRawPointer?
        // The reader's own download of 0..1 MiB.
        try out.withUnsafeMutableBytes { dst in
            try reader.readWaiting(stream, at: 0, into: dst, isCancelled: nil,
                                   borrowed: { sent = Array($0); sentFrom = $0.baseAddress; wasSent = true })
            #expect(sentFrom != UnsafeRawPointer(dst.baseAddress))
        }
        #expect(wasSent && sent == Array(bytes[0..<(1 << 20)]), "replied from the download's buffer")
        #expect(out.allSatisfy { $0 == 0 }, "and not copied into the reply buffer")
        // 0.5..1.5 MiB: half in the cache (the first download, cached and let go), half in the
        // read-ahead part 1..3 MiB.
        reader.finishPendingWork(timeout: 10)
        wasSent = false
        try out.withUnsafeMutableBytes { dst in
            try reader.readWaiting(stream, at: 1 << 19, into: dst, isCancelled: nil, borrowed: { _ in wasSent = true })
        }
        #expect(!wasSent && out.elementsEqual(bytes[(1 << 19)..<((1 << 19) + (1 << 20))]), "copied into the reply buffer")
    }

    /// Far from the server read-ahead stays in memory until its reader has read it, as near it
    /// (on a busy machine the daemon's CPU sets the pace there too), and its reader is replied
    /// from it; its cache copy goes past the page cache, as near it (a copy into fresh page-cache
    /// pages cost more than the read-backs of parts let go when memory ran short saved,
    /// docs/architecture.md, "Cache writes").
    @Test func farFromTheServerReadAheadStaysInMemoryUntilRead() throws {
        let (store, bytes, _, reader) = try streaming(size: 32 << 20, cached: true, readAhead: 16 << 20)
        store.reportFirstByte(0.030)
        let stream = reader.openStream(try store.metadata(of: "f"))
        var out = [UInt8](repeating: 0, count: 1 << 20)
        for i in 0..<2 {
            try out.withUnsafeMutableBytes { try reader.readWaiting(stream, at: Int64(i) << 20, into: $0, isCancelled: nil) }
        }
        reader.finishPendingWork(timeout: 10)
        #expect(!reader.transfers.isNear)
        let block = (2 << 20) / (16 << 10)
        #expect(stream.flights.flight(for: block) != nil, "the landed part was let go before its reader read it")
        let c = try #require(stream.cached)
        let pages = residentPages(c.path, offset: c.format.blockOffset(block), length: 1 << 20)
        #expect(!pages.isEmpty && pages.allSatisfy { !$0 }, "\(pages.filter { $0 }.count) of \(pages.count) pages in the page cache")
        var sent: [UInt8] = []
        var wasSent = false
        #expect(out.withUnsafeMutableBytes { dst in
            reader.readHere(stream, at: 2 << 20, into: dst, borrowed: { sent = Array($0); wasSent = true })
        })
        #expect(wasSent && sent.elementsEqual(bytes[(2 << 20)..<(3 << 20)]), "replied from memory")
        reader.finishPendingWork(timeout: 10)
        reader.closeStream(stream)
        #expect(budgetSettles(reader))
    }

    /// The kernel reads a page again at once when a read of it failed: that read gets the
    /// same error without a request of its own (not all its tries anew, doubling the time a
    /// `read` takes to fail while the bucket answers other requests), and a read a second
    /// later tries again (`FlightTable.failureMemory`).
    @Test func aReadOfBlocksWhoseDownloadJustFailedGetsItsErrorWithoutAsking() throws {
        let (store, bytes, _, reader) = try streaming(size: 64 << 10, cached: true, readAhead: 0)
        var failure = StorageError(.retryLimitExceeded, "gave up after 5 tries")
        failure.answeredOthers = true  // no outage assumed from it
        let stream = reader.openStream(try store.metadata(of: "f"))
        store.failAll(with: failure)
        defer { reader.closeStream(stream) }
        var out = [UInt8](repeating: 0, count: 4096)
        func readHead() throws {
            try out.withUnsafeMutableBytes { try reader.readWaiting(stream, at: 0, into: $0, isCancelled: { false }) }
        }
        #expect(throws: StorageError.self) { try readHead() }
        let asked = store.requests.read
        #expect(asked >= 1)
        #expect(throws: StorageError.self) { try readHead() }
        #expect(store.requests.read == asked, "the page read again asked the bucket again")
        store.failAll(with: nil)
        Thread.sleep(forTimeInterval: FlightTable.failureMemory + 0.1)
        try readHead()
        #expect(out == Array(bytes[0..<4096]))
        reader.finishPendingWork(timeout: 10)
    }

    @Test func aPartsSlotIsFreeOnceItsBytesLandBeforeItsCacheWrite() throws {
        // The reader waits for the read-ahead part 1..3 MiB. Its cache copy then waits for room
        // at a stalled cache writer (cache_writes=keep_up: up to 2 × parallel times the
        // download's 0.1 s), but its slot is free as soon as its bytes are in: the link does not
        // wait for the disk.
        let (writer, release) = stalledWriter()
        let (store, bytes, _, reader) = try streaming(size: 16 << 20, cached: true, readAhead: 8 << 20,
                                                      cacheWrites: .keepUp, writer: writer)
        store.delayReads(0.1)
        let stream = reader.openStream(try store.metadata(of: "f"))
        var out = [UInt8](repeating: 0, count: 1 << 20)
        for i in 0..<2 {
            try out.withUnsafeMutableBytes { try reader.readWaiting(stream, at: Int64(i) << 20, into: $0, isCancelled: nil) }
        }
        // The second read waited for the part (the only one: the window does not grow yet).
        #expect(out == Array(bytes[(1 << 20)..<(2 << 20)]))
        #expect(reader.transfers.running == 0, "the part's slot is held while its cache copy waits")
        release.signal()
        reader.finishPendingWork(timeout: 10)
        reader.closeStream(stream)
    }

    /// A reader that adapts to the link, over `store`, with 1 MiB parts.
    private func adaptive(_ store: MemoryStore, parallel: Int = 8, memory: Int64 = 64 << 20,
                          cache: BlockCache? = nil) throws -> BlockReader {
        let cache = try cache ?? BlockCache(directory: temporaryDirectory(), capacity: 256 << 20, blockSize: 16 << 10)
        var config = BlockReader.Config(blockSize: 16 << 10, readAhead: 64 << 20, parallel: parallel, partSize: 1 << 20,
                                        memoryLimit: memory, adaptive: true)
        config.initialWindow = 1 << 20
        return BlockReader(store: store, cache: cache, endpoint: "e", config: config)
    }

    /// Reads `count` MiB of "f" from MiB `first` on, a MiB at a time.
    private func readOn(_ reader: BlockReader, _ stream: BlockReader.Stream, from first: Int = 0, mib count: Int) throws {
        var out = [UInt8](repeating: 0, count: 1 << 20)
        for i in first..<(first + count) {
            try out.withUnsafeMutableBytes { try reader.readWaiting(stream, at: Int64(i) << 20, into: $0, isCancelled: nil) }
        }
    }

    /// Waits (at most 5 s) for `store`'s connection count to stop changing; returns it.
    private func settledConnections(_ store: MemoryStore) -> Int {
        var last = -1
        for _ in 0..<50 {
            usleep(100_000)
            let now = store.connectionCount ?? 0
            if now == last { return now }
            last = now
        }
        return last
    }

    /// Object "f" of 24 MiB behind one open connection, its reads reporting `firstByte`.
    private func pooledStore(firstByte: Double) -> MemoryStore {
        let store = MemoryStore()
        store.put("f", pattern(24 << 20))
        store.simulateConnections(1)
        store.reportFirstByte(firstByte)
        return store
    }

    @Test func farFromTheServerConnectionsOpenAheadOfTheParts() throws {
        let store = pooledStore(firstByte: 0.030)
        let reader = try adaptive(store)
        let stream = reader.openStream(try store.metadata(of: "f"))
        try readOn(reader, stream, mib: 3)
        // As many connections as parts may run at once (one was open): opened once, not per read.
        let parts = reader.transfers.parts
        #expect(parts >= 2)
        #expect(settledConnections(store) == parts)
        #expect(store.connectionsOpened == parts - 1)
        reader.finishPendingWork(timeout: 10)
        reader.closeStream(stream)
    }

    @Test func nearTheServerOrForAShortReadNoConnectionIsOpenedAhead() throws {
        let near = pooledStore(firstByte: 0.0002)
        let reader = try adaptive(near)
        let stream = reader.openStream(try near.metadata(of: "f"))
        // One small read far into the file first: the server is judged near before any window
        // opens.
        var small = [UInt8](repeating: 0, count: 4096)
        try small.withUnsafeMutableBytes { try reader.readWaiting(stream, at: 20 << 20, into: $0, isCancelled: nil) }
        #expect(reader.transfers.isNear)
        try readOn(reader, stream, mib: 4)
        #expect(settledConnections(near) == 1 && near.connectionsOpened == 0, "opened ahead near the server")
        reader.finishPendingWork(timeout: 10)
        reader.closeStream(stream)

        // Far, but one small read (head -c): no window opens, nothing is opened ahead.
        let far = pooledStore(firstByte: 0.030)
        let headReader = try adaptive(far)
        let head = headReader.openStream(try far.metadata(of: "f"))
        var out = [UInt8](repeating: 0, count: 4096)
        try out.withUnsafeMutableBytes { try headReader.readWaiting(head, at: 0, into: $0, isCancelled: nil) }
        #expect(settledConnections(far) == 1 && far.connectionsOpened == 0, "opened ahead for one small read")
        headReader.finishPendingWork(timeout: 10)
        headReader.closeStream(head)
    }

    /// How far the server is, before any download has said, comes from the mount's own store:
    /// another mount's (or test's) answers never decide it. A store whose lookup came within
    /// 3 ms plans its first windows near; one whose answers took 30 ms seems far, though a near
    /// store answered within a millisecond in the same process just before.
    @Test func aServersDistanceBeforeAnyDownloadIsTheMountsOwn() throws {
        let near = pooledStore(firstByte: 0.0002)
        var byte = [UInt8](repeating: 0, count: 1)
        // A lookup's answer, as far as distance goes: the store answered, no download landed.
        let lookup = { (store: MemoryStore) throws in
            let generation = try store.metadata(of: "f").generation
            _ = try byte.withUnsafeMutableBytes { try store.read("f", generation: generation, offset: 0, into: $0, isCancelled: nil) }
        }
        try lookup(near)
        let nearReader = try adaptive(near)
        #expect(nearReader.transfers.current.isNear && !nearReader.transfers.seemsFar)

        let far = pooledStore(firstByte: 0.030)
        try lookup(far)
        let farReader = try adaptive(far)
        #expect(!farReader.transfers.current.isNear && farReader.transfers.seemsFar)
        // And a store that has not answered yet is neither.
        let fresh = pooledStore(firstByte: 0.030)
        let freshReader = try adaptive(fresh)
        #expect(!freshReader.transfers.current.isNear && !freshReader.transfers.seemsFar)
    }

    @Test func farFromTheServerACachedFileOpensNoConnection() throws {
        let store = pooledStore(firstByte: 0.030)
        let cache = try BlockCache(directory: temporaryDirectory(), capacity: 64 << 20, blockSize: 16 << 10)
        let meta = try store.metadata(of: "f")
        let fill = BlockReader(store: store, cache: cache, endpoint: "e", config: .init(blockSize: 16 << 10, readAhead: 0))
        let filled = fill.openStream(meta)
        var whole = [UInt8](repeating: 0, count: 24 << 20)
        try whole.withUnsafeMutableBytes { try fill.readWaiting(filled, at: 0, into: $0, isCancelled: nil) }
        fill.finishPendingWork(timeout: 10)
        fill.closeStream(filled)
        // A new reader over the same cache (a remount), far from the server: the reads find
        // every byte cached, so no connection is opened for read-ahead that will not run.
        let reader = try adaptive(store, cache: cache)
        let stream = reader.openStream(meta)
        try readOn(reader, stream, mib: 8)
        #expect(settledConnections(store) == 1 && store.connectionsOpened == 0, "opened ahead for a cached file")
        reader.finishPendingWork(timeout: 10)
        reader.closeStream(stream)
    }

    @Test func aFileOpenedAgainSharesTheReadAheadStillRunning() throws {
        let (store, bytes, _, reader) = try streaming(size: 16 << 20, cached: false, readAhead: 8 << 20)
        let meta = try store.metadata(of: "f")
        store.delayReads(0.5)
        var out = [UInt8](repeating: 0, count: 1 << 20)
        let first = reader.openStream(meta)
        // A large first read starts read-ahead of 1..5 MiB; the file is closed while it runs.
        #expect(!out.withUnsafeMutableBytes { reader.readHere(first, at: 0, into: $0) })
        reader.closeStream(first)
        let second = reader.openStream(meta)
        try out.withUnsafeMutableBytes { try reader.readWaiting(second, at: 1 << 20, into: $0, isCancelled: nil) }
        #expect(out == Array(bytes[(1 << 20)..<(2 << 20)]))
        #expect(store.requests.read == 1, "the reopened file waited for the running download instead of fetching again")
        reader.closeStream(second)
        reader.finishPendingWork(timeout: 10)
    }

    @Test func aReaderNeverWaitsBehindReadAheadNobodyReads() throws {
        // Cache off (a full disk): finished read-ahead stays in memory until it is read. Here
        // the first read's own read-ahead takes the whole budget before the read's download
        // asks for room; the read must still complete.
        let store = MemoryStore()
        let bytes = pattern(8 << 20)
        store.put("a", bytes)
        let reader = BlockReader(store: store, cache: nil, endpoint: "e",
                                 config: .init(blockSize: 16 << 10, readAhead: 8 << 20, partSize: 4 << 20, memoryLimit: 4 << 20))
        let a = reader.openStream(try store.metadata(of: "a"))
        let done = DispatchSemaphore(value: 0)
        let result = Mutex<[UInt8]?>(nil)
        Thread {
            var got = [UInt8](repeating: 0, count: 1 << 20)
            try? got.withUnsafeMutableBytes { try reader.readWaiting(a, at: 0, into: $0, isCancelled: nil) }
            result.withLock { $0 = got }
            done.signal()
        }.start()
        #expect(done.wait(timeout: .now() + 5) == .success, "the read waited for memory held by read-ahead nobody reads")
        let same = result.withLock { $0 } == Array(bytes[0..<(1 << 20)])
        #expect(same, "the read returned other bytes")
        reader.closeStream(a)
    }

    /// A disk that cannot keep up: the writer's queue is held full by a write that does not end.
    private func stalledWriter() -> (CacheWriter, DispatchSemaphore) {
        let writer = CacheWriter(maxBacklog: 1)
        let release = DispatchSemaphore(value: 0)
        #expect(writer.submit(bytes: 1, patience: 0) { release.wait() })
        return (writer, release)
    }

    @Test func aFullWriteQueueTakesNothingMoreWithinItsPatience() {
        let (writer, release) = stalledWriter()
        let t0 = Date()
        #expect(!writer.submit(bytes: 8 << 20, patience: 0.2) {})
        #expect(Date().timeIntervalSince(t0) >= 0.19, "gave up before its patience ran out")
        #expect(writer.skipped == 8 << 20)
        release.signal()
        #expect(writer.drain(timeout: 5))
        let ran = Mutex(false)
        #expect(writer.submit(bytes: 8 << 20, patience: 0.2) { ran.withLock { $0 = true } })
        #expect(writer.drain(timeout: 5))
        #expect(ran.withLock { $0 })
    }

    @Test func withKeepUpASlowCacheDiskDoesNotSlowSequentialReadsDown() throws {
        let (writer, release) = stalledWriter()
        let (store, bytes, cached, reader) = try streaming(size: 24 << 20, cached: true, readAhead: 16 << 20,
                                                           cacheWrites: .keepUp, writer: writer)
        let cache = try #require(cached)
        let stream = reader.openStream(try store.metadata(of: "f"))
        let done = DispatchSemaphore(value: 0)
        let same = Mutex(true)
        Thread {
            var out = [UInt8](repeating: 0, count: 1 << 20)
            for i in 0..<24 {
                try? out.withUnsafeMutableBytes { try reader.readWaiting(stream, at: Int64(i) << 20, into: $0, isCancelled: nil) }
                if out != Array(bytes[(i << 20)..<((i + 1) << 20)]) { same.withLock { $0 = false } }
            }
            done.signal()
        }.start()
        #expect(done.wait(timeout: .now() + 10) == .success, "the reads waited for a cache write that never ends")
        #expect(same.withLock { $0 }, "a read returned other bytes")
        #expect(writer.skipped > 0, "read-ahead was neither cached nor skipped")
        #expect(cache.usedBytes < 24 << 20)
        release.signal()
        reader.finishPendingWork(timeout: 10)
        reader.closeStream(stream)
    }

    @Test func byDefaultEveryReadAheadByteIsCachedByTheThreadThatFetchedIt() throws {
        let (writer, release) = stalledWriter()  // cache_writes=all never queues there
        let (store, bytes, cached, reader) = try streaming(size: 16 << 20, cached: true, readAhead: 8 << 20, writer: writer)
        let cache = try #require(cached)
        let stream = reader.openStream(try store.metadata(of: "f"))
        var out = [UInt8](repeating: 0, count: 1 << 20)
        for i in 0..<16 {
            try out.withUnsafeMutableBytes { try reader.readWaiting(stream, at: Int64(i) << 20, into: $0, isCancelled: nil) }
            #expect(out == Array(bytes[(i << 20)..<((i + 1) << 20)]))
        }
        #expect(writer.queued == 1 && writer.skipped == 0, "cache_writes=all went through the writer")
        release.signal()
        reader.finishPendingWork(timeout: 10)
        let meta = try store.metadata(of: "f")
        #expect(cache.acquire(endpoint: "e", meta: meta).map { c in
            defer { cache.release(c) }
            return c.cachedBytes(from: 0, upTo: 16 << 20)
        } == 16 << 20, "every byte of the object is cached")
        reader.closeStream(stream)
    }

    @Test func interruptedReaderGetsCancelled() throws {
        let store = MemoryStore()
        store.put("f", pattern(1 << 20))
        store.delayReads(0.5)
        let reader = BlockReader(store: store, cache: nil, endpoint: "e", config: .init(blockSize: 64 << 10, readAhead: 0))
        let stream = reader.openStream(try store.metadata(of: "f"))
        var out = [UInt8](repeating: 0, count: 4096)
        let start = Date()
        #expect {
            try out.withUnsafeMutableBytes { try reader.readWaiting(stream, at: 0, into: $0, isCancelled: { true }) }
        } throws: { ($0 as? StorageError)?.code == .cancelled }
        #expect(Date().timeIntervalSince(start) < 2)
    }
}
