import Foundation
import Testing
import StorageClient
@testable import StorefsCore
import StorefsTestSupport

/// End-to-end integrity (docs/integrity.md): once every block of an object is cached, the
/// blocks' CRC32Cs combined must equal the object's crc32c.
@Suite struct IntegrityTests {
    @Test(arguments: [1, 4096, 16_384, 16_385, 100_000, 1 << 20])
    func combinedBlockCRCsEqualTheWholeObjectCRC(size: Int) {
        let bytes = pattern(size, seed: 3)
        let block = 16_384
        var crcs: [UInt32] = []
        var at = 0
        while at < size {
            let n = min(block, size - at)
            crcs.append(bytes.withUnsafeBytes { Checksum.crc32c(UnsafeRawBufferPointer(rebasing: $0[at..<(at + n)])) })
            at += n
        }
        let last = size % block == 0 ? block : size % block
        #expect(Checksum.crc32c(combining: crcs, blockLength: block, lastLength: last) == bytes.withUnsafeBytes { Checksum.crc32c($0) })
    }

    /// Pieces of any length, not only the cache's power-of-two blocks, combine to the CRC of
    /// the whole (the operator of a length is built from its bits: each bit is exercised).
    @Test(arguments: [1, 3, 8, 255, 4096, 5_000, 65_537, (1 << 20) + 3])
    func combinedCRCsOfPiecesOfAnyLength(piece: Int) {
        for count in [1, 2, 5] {
            let last = max(1, piece / 3 + 1)
            let size = piece * (count - 1) + last
            let bytes = pattern(size, seed: UInt8(truncatingIfNeeded: piece))
            let crcs = (0..<count).map { i in
                let at = i * piece, n = i == count - 1 ? last : piece
                return bytes.withUnsafeBytes { Checksum.crc32c(UnsafeRawBufferPointer(rebasing: $0[at..<(at + n)])) }
            }
            #expect(Checksum.crc32c(combining: crcs, blockLength: piece, lastLength: last) == bytes.withUnsafeBytes { Checksum.crc32c($0) },
                    "\(count) pieces of \(piece) bytes, the last \(last)")
        }
    }

    @Test func crc32cFromTheAPIsBase64() {
        // "123456789" has CRC32C e3069283; GCS writes it as base64 of the big-endian bytes.
        #expect(Checksum.crc32c(base64: "4waSgw==") == 0xE306_9283)
        #expect(Checksum.crc32c(base64: "not base64") == nil)
        #expect(Checksum.crc32c(base64: "AAAAAAA=") == nil)
    }

    func setUp(size: Int) throws -> (MemoryStore, [UInt8], BlockCache, BlockReader, ObjectMetadata) {
        let store = MemoryStore()
        let bytes = pattern(size, seed: 9)
        store.put("f", bytes, crc32c: true)
        let cache = try BlockCache(directory: temporaryDirectory(), capacity: 64 << 20, blockSize: 16 << 10)
        let reader = BlockReader(store: store, cache: cache, endpoint: "e",
                                 // Small objects read in ranges, as large ones are: the check of an object
                                 // completed piece by piece is what these tests are about.
                                 config: .init(blockSize: 16 << 10, readAhead: 0, partSize: 4 << 20, memoryLimit: 64 << 20,
                                               wholeObjectLimit: 0))
        return (store, bytes, cache, reader, try store.metadata(of: "f"))
    }

    func readAll(_ reader: BlockReader, _ meta: ObjectMetadata) throws -> [UInt8] {
        let stream = reader.openStream(meta)
        defer { reader.closeStream(stream) }
        var out = [UInt8](repeating: 0, count: Int(meta.size))
        try out.withUnsafeMutableBytes { try reader.readWaiting(stream, at: 0, into: $0, isCancelled: nil) }
        return out
    }

    @Test func aCorruptedDownloadThatCompletesTheObjectIsFetchedAgainBeforeItIsServed() throws {
        let (store, bytes, _, reader, meta) = try setUp(size: 100_000)
        store.corruptNextReads(1)
        #expect(try readAll(reader, meta) == bytes)
        #expect(store.requests.read == 2)  // the download, then the whole object again
        // And what stayed in the cache is right: a second read needs no request.
        #expect(try readAll(reader, meta) == bytes)
        #expect(store.requests.read == 2)
    }

    @Test func anObjectCorruptedTwiceIsAnErrorAndNothingOfItStaysCached() throws {
        let (store, _, cache, reader, meta) = try setUp(size: 100_000)
        store.corruptNextReads(2)
        #expect(throws: StorageError.self) { _ = try readAll(reader, meta) }
        let o = try #require(cache.acquire(endpoint: "e", meta: meta))
        #expect(!(0..<o.format.blockCount).contains { o.isCached($0) })
        cache.release(o)
    }

    @Test func cachedBlocksThatDoNotMakeTheObjectAreDroppedWhenItIsOpened() throws {
        let (store, bytes, cache, reader, meta) = try setUp(size: 40_000)
        // Blocks with valid CRCs of their own but the wrong bytes (planted, or a corrupt
        // download from before): only the object's crc32c can tell.
        var planted = bytes
        planted[20_000] ^= 1
        var unchecked = meta
        unchecked.crc32c = nil
        let o = try #require(cache.acquire(endpoint: "e", meta: unchecked))
        planted.withUnsafeBytes { o.store(first: 0, $0) }
        cache.release(o)
        #expect(try readAll(reader, meta) == bytes)
        #expect(store.requests.read >= 1)
    }

    /// Reads a 100,000-byte object in two: the first 64 KiB (its cache copy made), then the rest
    /// as the daemon's FUSE thread does, its cache copy left to `held` (not finished here).
    /// `corruptingTail`: the tail's first download comes back with a flipped byte.
    func readInTwo(_ reader: BlockReader, _ store: MemoryStore, _ meta: ObjectMetadata,
                   corruptingTail: Bool, held: HeldReply) throws -> [UInt8] {
        let stream = reader.openStream(meta)
        defer { reader.closeStream(stream) }
        var head = [UInt8](repeating: 0, count: 65_536)
        try head.withUnsafeMutableBytes { try reader.readWaiting(stream, at: 0, into: $0, isCancelled: nil) }
        reader.finishPendingWork(timeout: 10)
        if corruptingTail { store.corruptNextReads(1) }
        var tail = [UInt8](repeating: 0, count: Int(meta.size) - 65_536)
        try tail.withUnsafeMutableBytes {
            try reader.readWaiting(stream, at: 65_536, into: $0, isCancelled: { false }, held: held)
        }
        return head + tail
    }

    /// The download that completes an object is checked from memory (its blocks' CRC32Cs with
    /// the index's) and answers its reader before its cache copy is written: the last read of
    /// a file does not wait for the disk (docs/integrity.md, "Checked before stored"). The copy,
    /// written after the reply, is checked again from the index.
    @Test func theReadThatCompletesAnObjectRepliesBeforeItsCacheCopyIsWritten() throws {
        let (store, bytes, cache, reader, meta) = try setUp(size: 100_000)
        let held = HeldReply()
        #expect(try readInTwo(reader, store, meta, corruptingTail: false, held: held) == bytes)
        let o = try #require(cache.acquire(endpoint: "e", meta: meta))
        defer { cache.release(o) }
        // Replied: the last blocks are not on disk yet, and nothing is marked verified.
        #expect(o.cachedBytes(from: 65_536, upTo: 100_000) == 0)
        #expect(!o.isVerified)
        held.finish()
        #expect(o.cachedBytes(from: 0, upTo: 100_000) == 100_000)
        #expect(o.isVerified)
        #expect(store.requests.read == 2)
    }

    /// A completing download whose bytes do not match is not answered from memory: the full
    /// check stores it, finds the mismatch and fetches the object again before replying.
    @Test func aCompletingDownloadThatDoesNotMatchIsStoredCheckedAndFetchedAgainBeforeItsReply() throws {
        let (store, bytes, cache, reader, meta) = try setUp(size: 100_000)
        let held = HeldReply()
        #expect(try readInTwo(reader, store, meta, corruptingTail: true, held: held) == bytes)
        let o = try #require(cache.acquire(endpoint: "e", meta: meta))
        defer { cache.release(o) }
        #expect(o.isVerified)  // before the reply: fetched again and checked
        #expect(store.requests.read == 3)  // the head, the corrupt tail, the whole object again
        held.finish()
    }

    /// Bytes handed to a reader before the object was complete cannot be taken back: when the
    /// completing download finds that they were wrong, that read fails (EIO), so `cp` and
    /// `cat` exit non-zero, and the object is then cached right for the next read.
    @Test func wrongBytesReadEarlierFailTheReadThatCompletesTheObject() throws {
        let (store, bytes, _, reader, meta) = try setUp(size: 100_000)
        let stream = reader.openStream(meta)
        defer { reader.closeStream(stream) }
        var head = [UInt8](repeating: 0, count: 16_384)
        store.corruptNextReads(1)
        try head.withUnsafeMutableBytes { try reader.readWaiting(stream, at: 0, into: $0, isCancelled: nil) }
        #expect(head != Array(bytes[0..<16_384]))  // served as it came: nothing could tell yet
        reader.finishPendingWork(timeout: 10)  // its cache copy lands (the daemon writes it after the reply)
        var tail = [UInt8](repeating: 0, count: 100_000 - 16_384)
        #expect(throws: StorageError.self) {
            try tail.withUnsafeMutableBytes { try reader.readWaiting(stream, at: 16_384, into: $0, isCancelled: nil) }
        }
        #expect(try readAll(reader, meta) == bytes)
    }
}
