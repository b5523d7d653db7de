import Foundation
import StorageClient
@testable import StorefsCore
import StorefsTestSupport
import Synchronization
import Testing

@Suite struct FirstBytesTests {
    private func landed(_ generation: Int64, _ size: Int64?, _ count: Int) -> FirstBytesTable.Landed {
        .init(generation: generation, size: size, bytes: [UInt8](repeating: 7, count: count))
    }

    @Test func bytesAreTakenOnceAndOnlyForTheGenerationAndSizeTheReaderOpened() {
        let table = FirstBytesTable()
        table.begin("a")?.finish(landed(5, 1000, 1000))
        #expect(table.begin("a") == nil, "asked twice for one name")
        #expect(table.take("a", generation: 5, size: 1000, wait: 0, isCancelled: nil)?.count == 1000)
        #expect(table.take("a", generation: 5, size: 1000, wait: 0, isCancelled: nil) == nil, "taken twice")
        table.begin("b")?.finish(landed(5, 1000, 1000))
        #expect(table.take("b", generation: 6, size: 1000, wait: 0, isCancelled: nil) == nil, "another generation's bytes")
        table.begin("c")?.finish(landed(5, 2000, 1000))
        #expect(table.take("c", generation: 5, size: 1000, wait: 0, isCancelled: nil) == nil, "another size")
        // A large object: exactly the first `length` bytes, whether or not the answer said its size.
        let big = Int64(10 << 20)
        table.begin("d")?.finish(landed(5, nil, FirstBytesTable.length))
        #expect(table.take("d", generation: 5, size: big, wait: 0, isCancelled: nil)?.count == FirstBytesTable.length)
        table.begin("e")?.finish(landed(5, big, 100))
        #expect(table.take("e", generation: 5, size: big, wait: 0, isCancelled: nil) == nil, "a short answer")
        table.begin("f")?.finish(nil)
        #expect(table.take("f", generation: 5, size: 10, wait: 0, isCancelled: nil) == nil, "a failed GET")
        #expect(table.isEmpty)
    }

    @Test func aReaderWaitsForBytesStillComingButNotPastItsBound() {
        let table = FirstBytesTable()
        let entry = table.begin("a")
        DispatchQueue.global().asyncAfter(deadline: .now() + 0.1) { entry?.finish(.init(generation: 1, size: 3, bytes: [1, 2, 3])) }
        let t0 = Date()
        #expect(table.take("a", generation: 1, size: 3, wait: 5, isCancelled: nil) == [1, 2, 3])
        // Back when the bytes land (0.1 s, seconds more on a loaded host), not at the bound.
        #expect(Date().timeIntervalSince(t0) < 4.5)
        _ = table.begin("slow")
        let t1 = Date()
        #expect(table.take("slow", generation: 1, size: 3, wait: 0.2, isCancelled: nil) == nil)
        #expect(Date().timeIntervalSince(t1) >= 0.19 && Date().timeIntervalSince(t1) < 2)
        _ = table.begin("cancelled")
        #expect(table.take("cancelled", generation: 1, size: 3, wait: 5, isCancelled: { true }) == nil)
    }

    @Test func theTableIsBoundedInCountAndTime() {
        let table = FirstBytesTable()
        for i in 0..<FirstBytesTable.capacity { #expect(table.begin("n\(i)") != nil) }
        #expect(table.begin("one-more") == nil, "more entries than the bound")
        // Entries asked for long ago are forgotten, taken or not.
        let old = FirstBytesTable()
        old.begin("a", now: monotonicNow() - FirstBytesTable.lifetime - 1)?.finish(landed(1, 3, 3))
        #expect(old.take("a", generation: 1, size: 3, wait: 0, isCancelled: nil) == nil)
        for i in 0..<FirstBytesTable.capacity { _ = old.begin("o\(i)", now: monotonicNow() - FirstBytesTable.lifetime - 1) }
        #expect(old.begin("fresh") != nil, "expired entries still count against the bound")
    }

    @Test func aFilesFirstReadTakesTheBytesItsLookupAskedFor() throws {
        let store = MemoryStore()
        let bytes = pattern(1 << 20)
        store.put("f", bytes)
        store.answerReadStart()
        let cache = try BlockCache(directory: temporaryDirectory(), capacity: 64 << 20, blockSize: 16 << 10)
        let reader = BlockReader(store: store, cache: cache, endpoint: "e", config: .init(blockSize: 16 << 10, readAhead: 0, wholeObjectLimit: 0))
        reader.fetchFirstBytes(of: "f") { $0() }
        let stream = reader.openStream(try store.metadata(of: "f"))
        var out = [UInt8](repeating: 0, count: 4096)
        try out.withUnsafeMutableBytes { try reader.readWaiting(stream, at: 0, into: $0, isCancelled: { false }) }
        #expect(out == Array(bytes[0..<4096]))
        #expect(store.readStarts == 1 && store.requests.read == 0, "the first read asked again")
        // All of the first bytes were kept: a read further in, within them, asks nothing.
        try out.withUnsafeMutableBytes { try reader.readWaiting(stream, at: 100_000, into: $0, isCancelled: { false }) }
        #expect(out == Array(bytes[100_000..<104_096]) && store.requests.read == 0)
        try out.withUnsafeMutableBytes { try reader.readWaiting(stream, at: 500_000, into: $0, isCancelled: { false }) }
        #expect(out == Array(bytes[500_000..<504_096]) && store.requests.read == 1)
        reader.finishPendingWork(timeout: 10)
        reader.closeStream(stream)
    }

    @Test func firstBytesOfAnotherGenerationAreNotServed() throws {
        let store = MemoryStore()
        store.put("f", pattern(300_000, seed: 1))
        store.answerReadStart()
        let reader = BlockReader(store: store, cache: nil, endpoint: "e", config: .init(blockSize: 16 << 10, readAhead: 0, wholeObjectLimit: 0))
        reader.fetchFirstBytes(of: "f") { $0() }
        // Replaced between the lookup's two answers: the reader opened generation 2.
        let replaced = pattern(300_000, seed: 2)
        store.put("f", replaced, generation: 2)
        let stream = reader.openStream(try store.metadata(of: "f"))
        var out = [UInt8](repeating: 0, count: 4096)
        try out.withUnsafeMutableBytes { try reader.readWaiting(stream, at: 0, into: $0, isCancelled: { false }) }
        #expect(out == Array(replaced[0..<4096]))
        #expect(store.requests.read == 1)
        reader.closeStream(stream)
    }
}
