import Foundation
import Glibc
import StorageClient
import Testing
@testable import StorefsCore
import StorefsTestSupport

/// BucketHealth's state (docs/security.md, "Time bounds"; issue 49, items 1 and 2): while an
/// outage is assumed one operation at a time asks (half-open), the first success ends it, and
/// neither a cancelled operation nor one that failed while others were answered starts one.
@Suite struct BucketHealthTests {
    let store = MemoryStore(pageSize: 3)
    static let down = StorageError(.retryLimitExceeded, "no answer in time")

    func makeFS(health: BucketHealth = BucketHealth(holdSeconds: 5), statTTL: Double = 0) -> Filesystem {
        let reader = BlockReader(store: store, cache: nil, endpoint: "", config: .init(), health: health)
        return Filesystem(store: store, reference: StorageReference(bucket: "b"),
                          config: .init(statTTL: statTTL, listTTL: 0, negativeTTL: 0), reader: reader)
    }

    func read(_ fs: Filesystem, _ handle: UInt64, count: Int, isCancelled: (@Sendable () -> Bool)? = nil) throws -> [UInt8] {
        var out = [UInt8](repeating: 0, count: count)
        let n = try out.withUnsafeMutableBytes { try fs.readWaiting(handle, at: 0, into: $0, isCancelled: isCancelled) }
        return Array(out.prefix(n))
    }

    @Test func duringAnOutageOneOperationAtATimeAsks() throws {
        let health = BucketHealth(holdSeconds: 5)
        #expect(try health.admit() == nil, "no outage: everyone asks, no probe needed")
        health.note(Self.down)
        let first = try health.admit()
        #expect(first != nil, "the first operation during the outage asks")
        #expect(health.refusal?.code == .retryLimitExceeded)
        #expect(throws: StorageError.self, "a second one fails at once while the first asks") { _ = try health.admit() }
        health.note(Self.down)  // the probe found the bucket still down
        first?.end()
        #expect(health.outage != nil)
        let second = try health.admit()
        #expect(second != nil, "once the probe ended, the next operation asks")
        second?.end()
    }

    @Test func aProbeLetGoWithoutEndingFreesTheSlot() throws {
        let health = BucketHealth(holdSeconds: 5)
        health.note(Self.down)
        do { _ = try health.admit() }
        #expect(try health.admit() != nil, "a probe nobody holds asks no more: the next may")
    }

    @Test func theFirstSuccessEndsTheOutage() throws {
        let health = BucketHealth(holdSeconds: 5)
        health.note(Self.down)
        let probe = try health.admit()
        health.noteSuccess()
        probe?.end()
        #expect(health.outage == nil)
        #expect(try health.admit() == nil)
        #expect(try health.admit() == nil)
    }

    @Test func aCancelledOperationIsNoOutage() {
        let health = BucketHealth(holdSeconds: 5)
        health.note(StorageError(.cancelled, "transfer cancelled"))
        health.note(StorageError(.cancelled, "interrupted while waiting to retry: 503"))
        #expect(health.outage == nil)
    }

    /// The server came back within the hold: a lookup and a read of names nobody knew ask it
    /// and succeed, and the outage is over.
    @Test func aServerBackWithinTheHoldIsAskedAtOnce() throws {
        store.put("d/known.txt", [1, 2, 3])
        store.put("d/new.txt", [4, 5])
        let fs = makeFS()
        let d = try fs.lookup(parent: Filesystem.rootInode, name: "d")
        store.failAll(with: Self.down)
        #expect(throws: FilesystemError.self) { _ = try fs.lookup(parent: d.inode, name: "new.txt") }
        #expect(fs.health.outage != nil)
        store.failAll(with: nil)
        let new = try fs.lookup(parent: d.inode, name: "new.txt")
        #expect(new.size == 2)
        #expect(fs.health.outage == nil, "the first success ended the outage")
        let h = try fs.open(new.inode, flags: O_RDONLY).handle
        #expect(try read(fs, h, count: 10) == [4, 5])
        fs.release(h)
    }

    /// A read's download during an outage asks (it is the probe) and, once it succeeds, ends it.
    @Test func aReadDuringAnOutageAsksAndItsSuccessEndsIt() throws {
        store.put("f.bin", [7, 8, 9])
        let fs = makeFS(statTTL: 60)
        let f = try fs.lookup(parent: Filesystem.rootInode, name: "f.bin")
        let h = try fs.open(f.inode, flags: O_RDONLY).handle
        fs.health.note(Self.down)
        #expect(try read(fs, h, count: 3) == [7, 8, 9])
        #expect(fs.health.outage == nil)
        fs.release(h)
    }

    /// Cached bytes are served whatever the outage state: while an outage is assumed and
    /// another operation holds the probe, a cached file opens and reads without asking.
    @Test func cachedBytesAreServedWhileAnotherOperationProbes() throws {
        let bytes = (0..<50_000).map { UInt8(truncatingIfNeeded: $0 &* 31) }
        store.put("c.bin", bytes, crc32c: true)
        let cache = try BlockCache(directory: temporaryDirectory(), capacity: 64 << 20, blockSize: 16 << 10)
        let health = BucketHealth(holdSeconds: 5)
        let reader = BlockReader(store: store, cache: cache, endpoint: "e",
                                 config: .init(blockSize: 16 << 10, readAhead: 0, partSize: 4 << 20, memoryLimit: 64 << 20),
                                 health: health)
        let fs = Filesystem(store: store, reference: StorageReference(bucket: "b"),
                            config: .init(statTTL: 0, listTTL: 0, negativeTTL: 0), reader: reader)
        let c = try fs.lookup(parent: Filesystem.rootInode, name: "c.bin")
        let first = try fs.open(c.inode, flags: O_RDONLY).handle
        #expect(try read(fs, first, count: bytes.count) == bytes)
        fs.release(first)
        // The read's cache copy is written after its reply: the outage begins once it is cached.
        let deadline = monotonicNow() + 10
        while try fs.extendedAttribute(c.inode, name: "user.storefs.cached") != Array(String(bytes.count).utf8),
              monotonicNow() < deadline { usleep(2000) }
        store.failAll(with: Self.down)
        health.note(Self.down)
        let probe = try health.admit()  // another operation asks the bucket meanwhile
        let asked = store.requests
        let h = try fs.open(c.inode, flags: O_RDONLY).handle
        var out = [UInt8](repeating: 0, count: bytes.count)
        let n = try out.withUnsafeMutableBytes { try fs.readHere(h, at: 0, into: $0) } ?? 0
        #expect(n == bytes.count && out == bytes, "served from the cache on the FUSE thread")
        #expect(try read(fs, h, count: bytes.count) == bytes, "and by a read that may ask")
        #expect(store.requests == asked, "nothing was asked")
        fs.release(h)
        probe?.end()
    }

    /// An interrupted read is no evidence of an outage: the reads and lookups after it ask.
    @Test func anInterruptedReadStartsNoOutage() throws {
        store.put("slow.bin", [UInt8](repeating: 1, count: 4096))
        store.put("other.bin", [2])
        let fs = makeFS(statTTL: 60)
        let f = try fs.lookup(parent: Filesystem.rootInode, name: "slow.bin")
        let h = try fs.open(f.inode, flags: O_RDONLY).handle
        store.delayReads(5)
        let start = Date()
        #expect { _ = try read(fs, h, count: 4096, isCancelled: { Date().timeIntervalSince(start) > 0.2 }) } throws: {
            ($0 as? FilesystemError)?.code == .storage(.cancelled)
        }
        #expect(Date().timeIntervalSince(start) < 2)
        #expect(fs.health.outage == nil)
        store.delayReads(0)
        #expect(try fs.lookup(parent: Filesystem.rootInode, name: "other.bin").size == 1)
        fs.release(h)
    }
}
