import Foundation
import Testing
import StorageClient
@testable import StorefsCore
import StorefsTestSupport

/// True once no download holds memory (within 2 s). `finishPendingWork` returns when the
/// workers' jobs have run; a worker lets go of its job, and so of the flight it captured and
/// that flight's budget, just after that (`WorkerPool.run`).
func budgetSettles(_ reader: BlockReader) -> Bool {
    let deadline = Date().addingTimeInterval(2)
    while reader.budget.inUse != 0, Date() < deadline { usleep(1000) }
    return reader.budget.inUse == 0
}

/// Read-ahead that has landed but whose cache copy is not made yet, under memory pressure
/// (`Tests/integration/test_link.py`: at `memory_limit=64M` on a busy machine, parts were
/// fetched twice).
@Suite struct ReadAheadRaceTests {
    /// A finished part waiting for its cache write is neither in the cache nor freeable (its
    /// writer holds the buffer until the write ends). Letting it go from the flight table when
    /// memory runs short freed nothing and hid its bytes: the reader, arriving before the write
    /// ended, found them nowhere and downloaded them again.
    @Test func readAheadWaitingForItsCacheWriteStaysFindableWhenMemoryRunsShort() throws {
        let store = MemoryStore()
        let bytes = pattern(32 << 20)
        store.put("f", bytes)
        let cache = try BlockCache(directory: temporaryDirectory(), capacity: 256 << 20, blockSize: 16 << 10)
        // The cache disk is stalled: every read-ahead part waits for its write, in memory.
        let writer = CacheWriter(maxBacklog: 256 << 20)
        let release = DispatchSemaphore(value: 0)
        #expect(writer.submit(bytes: 1, patience: 0) { release.wait() })
        // 8 MiB of budget: the 2 MiB first window, then one 4 MiB part fits, the next does not.
        let config = BlockReader.Config(blockSize: 16 << 10, readAhead: 16 << 20, partSize: 4 << 20,
                                        memoryLimit: 8 << 20, cacheWrites: .keepUp)
        let reader = BlockReader(store: store, cache: cache, endpoint: "e", config: config, writer: writer)
        let stream = reader.openStream(try store.metadata(of: "f"))
        var closed = false
        defer {
            release.signal()
            reader.finishPendingWork(timeout: 10)
            if !closed { reader.closeStream(stream) }
        }
        var out = [UInt8](repeating: 0, count: 1 << 20)
        // 0..1 MiB downloaded by the reader; its first window (1..3 MiB) by a prefetch thread.
        if !out.withUnsafeMutableBytes({ reader.readHere(stream, at: 0, into: $0) }) {
            try out.withUnsafeMutableBytes { try reader.readWaiting(stream, at: 0, into: $0, isCancelled: nil) }
        }
        #expect(out == Array(bytes[0..<(1 << 20)]))
        let deadline = Date().addingTimeInterval(10)
        while stream.flights.flight(for: (2 << 20) / (16 << 10))?.finished == nil, Date() < deadline { usleep(1000) }
        do {  // (the flight held here only meanwhile: it holds budget)
            let landed = try #require(stream.flights.flight(for: (2 << 20) / (16 << 10)))
            #expect(landed.start == 1 << 20 && landed.length == 2 << 20, "the first window is one 2 MiB part")
        }
        #expect(cache.acquire(endpoint: "e", meta: stream.meta).map { c in
            defer { cache.release(c) }
            return c.isCached((2 << 20) / (16 << 10))
        } == false, "the part's cache write is held back")
        #expect(out.withUnsafeMutableBytes { reader.readHere(stream, at: 1 << 20, into: $0) })
        #expect(out == Array(bytes[(1 << 20)..<(2 << 20)]))
        // The third read widens the window to 3..11 MiB: 3..7 fits in the budget, 7..11 does not,
        // and the reader is short of memory while 1..3 MiB waits for its cache write.
        let served = out.withUnsafeMutableBytes { reader.readHere(stream, at: 2 << 20, into: $0) }
        #expect(served, "the landed part was let go before its cache copy was made")
        if !served {
            try out.withUnsafeMutableBytes { try reader.readWaiting(stream, at: 2 << 20, into: $0, isCancelled: nil) }
        }
        #expect(out == Array(bytes[(2 << 20)..<(3 << 20)]))
        release.signal()
        reader.finishPendingWork(timeout: 10)
        // 0..1 (the reader's), 1..3 (first window) and 3..7 MiB (the part that fit): nothing twice.
        #expect(store.bytesRead == 7 << 20, "bytes fetched twice")
        // 3..7 MiB was never read: it stays for its reader until the file is closed.
        reader.closeStream(stream)
        closed = true
        #expect(budgetSettles(reader), "memory held after the file was closed and every cache write made")
    }
}
