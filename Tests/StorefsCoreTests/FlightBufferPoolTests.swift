import Foundation
import Synchronization
import Testing
@testable import StorefsCore
import StorefsTestSupport

/// Download buffers are recycled within a bound on resident bytes that counts the regions in
/// use as well as the free ones (docs/architecture.md, "Adaptive transfers": Buffers).
@Suite struct FlightBufferPoolTests {
    static let mib = 1 << 20

    func touched(_ pool: FlightBufferPool, _ length: Int) -> UnsafeMutableRawBufferPointer {
        let b = pool.take(length)
        for i in stride(from: 0, to: b.count, by: 4096) { b[i] = 1 }
        return b
    }

    /// The mapping's flags in /proc/self/smaps (`hg`: huge pages asked with MADV_HUGEPAGE).
    func vmFlags(of address: UnsafeMutableRawPointer) throws -> [Substring] {
        // Read to its end (a /proc file says it is empty: a sized read gets nothing).
        let file = try #require(FileHandle(forReadingAtPath: "/proc/self/smaps"))
        defer { try? file.close() }
        let smaps = String(decoding: try file.readToEnd() ?? Data(), as: UTF8.self)
        let at = UInt(bitPattern: address)
        var inside = false
        for line in smaps.split(separator: "\n") {
            let fields = line.split(separator: " ")
            if let range = fields.first, range.contains("-"), !range.hasSuffix(":") {
                let ends = range.split(separator: "-").compactMap { UInt($0, radix: 16) }
                inside = ends.count == 2 && ends[0] <= at && at < ends[1]
            } else if inside, fields.first == "VmFlags:" {
                return Array(fields.dropFirst())
            }
        }
        return []
    }

    @Test func partRegionsAskForHugePagesAndSmallOnesDoNot() throws {
        let parts = FlightBufferPool(regionSize: 8 * Self.mib, keepBytes: 16 * Self.mib)
        let part = touched(parts, 8 * Self.mib)
        #expect(try vmFlags(of: part.baseAddress!).contains("hg"))
        parts.give(part)
        let requests = FlightBufferPool(regionSize: Self.mib, keepBytes: 4 * Self.mib)
        let request = touched(requests, Self.mib)
        let flags = try vmFlags(of: request.baseAddress!)
        #expect(!flags.isEmpty && !flags.contains("hg"))
        requests.give(request)
    }

    @Test func regionsInUseCountAgainstWhatIsKept() {
        let pool = FlightBufferPool(regionSize: 4 * Self.mib, keepBytes: 8 * Self.mib)
        // Six 2 MiB parts at once: 12 MiB resident while in use.
        let parts = (0..<6).map { _ in touched(pool, 2 * Self.mib) }
        #expect(pool.keptBytes.all == 12 * Self.mib)
        for p in parts { pool.give(p) }
        // Given back, only what fits in 8 MiB of all regions stays mapped.
        #expect(pool.keptBytes.all <= 8 * Self.mib)
        #expect(pool.keptBytes.free == pool.keptBytes.all)
        // A recycled region used for a larger part counts what that part touched.
        let big = touched(pool, 4 * Self.mib)
        #expect(pool.keptBytes.all <= 10 * Self.mib)
        pool.give(big)
        pool.releaseIfIdle(for: 0)
        #expect(pool.keptBytes.all == 0 && pool.keptBytes.free == 0)
    }

    @Test func freeRegionsBesideAFullBudgetAreNotKept() {
        // The old bound (free regions only, up to keepBytes) kept 8 MiB free beside 8 MiB in use.
        let pool = FlightBufferPool(regionSize: 2 * Self.mib, keepBytes: 8 * Self.mib)
        let first = (0..<4).map { _ in touched(pool, 2 * Self.mib) }
        let second = (0..<4).map { _ in touched(pool, 2 * Self.mib) }
        for p in first { pool.give(p) }
        #expect(pool.keptBytes.all <= 8 * Self.mib + 2 * Self.mib, "\(pool.keptBytes)")
        for p in second { pool.give(p) }
        #expect(pool.keptBytes.all <= 8 * Self.mib + 2 * Self.mib)
    }
}

/// What one reader's pools keep, together (docs/architecture.md, "Adaptive transfers": Buffers).
@Suite struct DownloadBufferBoundTests {
    static let mib = 1 << 20

    /// Regions a 32 MiB part touched, reused for a 2 MiB one while the pool is over its bound,
    /// give the pages past the part back: the budget counts 2 MiB for it.
    @Test func aLargeRegionReusedForASmallPartLetsTheRestGoWhenOverTheBound() {
        let pool = FlightBufferPool(regionSize: 32 * Self.mib, keepBytes: 16 * Self.mib)
        let a = FlightBufferPoolTests().touched(pool, 8 * Self.mib)
        let b = FlightBufferPoolTests().touched(pool, 8 * Self.mib)
        pool.give(b)
        pool.give(a)
        #expect(pool.keptBytes.all == 16 * Self.mib)
        // A part grown to 32 MiB takes one region: 40 MiB resident while it is in use.
        let grown = FlightBufferPoolTests().touched(pool, 32 * Self.mib)
        #expect(pool.keptBytes.all == 40 * Self.mib)
        // A 2 MiB part takes the other (8 MiB touched): 6 MiB of it go back.
        let small = FlightBufferPoolTests().touched(pool, 2 * Self.mib)
        #expect(pool.keptBytes.all == 34 * Self.mib, "\(pool.keptBytes)")
        pool.give(small)
        pool.give(grown)
        #expect(pool.keptBytes.all <= 16 * Self.mib)
        pool.releaseIfIdle(for: 0)
    }

    /// A sequential reader fills the part pool, then 16 readers' own misses at once fill the
    /// request pool: what both keep afterwards stays within memory_limit. Each with a bound of
    /// its own (the parts' the whole limit, the requests' 32 regions) they kept twice it.
    @Test func buffersKeptByBothPoolsStayWithinMemoryLimit() throws {
        let store = MemoryStore()
        store.put("seq", [UInt8](repeating: 7, count: 48 << 20))
        store.put("rand", [UInt8](repeating: 9, count: 32 << 20))
        let cache = try BlockCache(directory: temporaryDirectory(), capacity: 256 << 20, blockSize: 16 << 10)
        let limit = 16 * Self.mib
        let config = BlockReader.Config(blockSize: 16 << 10, readAhead: 8 << 20, parallel: 2, partSize: 2 << 20,
                                        memoryLimit: Int64(limit))
        let reader = BlockReader(store: store, cache: cache, endpoint: "e", config: config)
        defer { reader.finishPendingWork(timeout: 10) }
        @Sendable func read(_ stream: BlockReader.Stream, at offset: Int64, count: Int) throws {
            var out = [UInt8](repeating: 0, count: count)
            if !out.withUnsafeMutableBytes({ reader.readHere(stream, at: offset, into: $0) }) {
                try out.withUnsafeMutableBytes { try reader.readWaiting(stream, at: offset, into: $0, isCancelled: nil) }
            }
        }
        let seq = reader.openStream(try store.metadata(of: "seq"))
        for i in 0..<48 { try read(seq, at: Int64(i) << 20, count: 1 << 20) }
        reader.finishPendingWork(timeout: 10)
        reader.closeStream(seq)
        #expect(budgetSettles(reader))
        // 16 readers' first reads of 1 MiB each, at once (every download takes 50 ms), in the
        // other object: each miss takes a request-sized region.
        store.delayReads(0.05)
        let meta = try store.metadata(of: "rand")
        let streams = (0..<16).map { _ in reader.openStream(meta) }
        let group = DispatchGroup()
        for i in 0..<16 {
            group.enter()
            Thread.detachNewThread {
                try? read(streams[i], at: Int64(i * 2) << 20, count: 1 << 20)
                group.leave()
            }
        }
        group.wait()
        store.delayReads(0)
        reader.finishPendingWork(timeout: 10)
        for s in streams { reader.closeStream(s) }
        #expect(budgetSettles(reader))
        let kept = reader.buffers.keptBytes.all + reader.requestBuffers.keptBytes.all
        #expect(reader.requestBuffers.keptBytes.all > 0, "the readers' misses used request-sized regions")
        #expect(kept <= limit, "parts \(reader.buffers.keptBytes.all), requests \(reader.requestBuffers.keptBytes.all)")
    }
}

/// A read-ahead part takes its buffer when its first byte arrives (docs/architecture.md,
/// "Adaptive transfers", Buffers taken at the first byte).
@Suite struct BufferAtFirstByteTests {
    /// Parts waiting for a far server's answer hold budget, not memory: taken when the
    /// download starts, 2 MiB per part were resident for the whole wait.
    @Test func readAheadWaitingForItsFirstByteHoldsNoBuffer() throws {
        let store = MemoryStore()
        let bytes = pattern(32 << 20)
        store.put("f", bytes)
        let cache = try BlockCache(directory: temporaryDirectory(), capacity: 256 << 20, blockSize: 16 << 10)
        let config = BlockReader.Config(blockSize: 16 << 10, readAhead: 16 << 20, parallel: 4, partSize: 2 << 20,
                                        memoryLimit: 64 << 20)
        let reader = BlockReader(store: store, cache: cache, endpoint: "e", config: config)
        defer { reader.finishPendingWork(timeout: 10) }
        let stream = reader.openStream(try store.metadata(of: "f"))
        defer { reader.closeStream(stream) }
        // Every answer's first byte comes 0.5 s after its request.
        store.delayReads(0.5)
        let done = DispatchSemaphore(value: 0)
        let failures = Mutex(0)
        Thread.detachNewThread {
            for i in 0..<8 {
                var out = [UInt8](repeating: 0, count: 1 << 20)
                let offset = Int64(i) << 20
                do {
                    if !out.withUnsafeMutableBytes({ reader.readHere(stream, at: offset, into: $0) }) {
                        try out.withUnsafeMutableBytes { try reader.readWaiting(stream, at: offset, into: $0, isCancelled: nil) }
                    }
                    if out[...] != bytes[Int(offset)..<Int(offset) + (1 << 20)] { failures.withLock { $0 += 1 } }
                } catch {
                    failures.withLock { $0 += 1 }
                }
            }
            done.signal()
        }
        // Once parts are downloading (waiting for their first byte), none holds a buffer.
        let deadline = Date().addingTimeInterval(5)
        while reader.transfers.running == 0, Date() < deadline { usleep(1000) }
        let kept = reader.buffers.keptBytes.all
        #expect(reader.transfers.running > 0)
        #expect(kept == 0, "\(kept) bytes of part buffers resident while every part waits for its first byte")
        done.wait()
        #expect(failures.withLock { $0 } == 0)
        // The parts did take buffers once their bytes came.
        #expect(reader.buffers.keptBytes.all > 0)
    }
}
