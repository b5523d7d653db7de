import Foundation
import Glibc
import StorageClient
import Synchronization
import Testing
@testable import StorefsCore
import StorefsTestSupport

/// The sequential streams of one open file (`ReadStreams`, issue 48): each has its own window.
@Suite struct ReadStreamsTests {
    let mib: Int64 = 1 << 20

    /// Four threads reading quarters of one file through one descriptor, their 1 MiB reads
    /// arriving interleaved: each quarter is a stream of its own and opens a window from its
    /// second read on. One window for the file was reset by every read of another quarter.
    @Test func interleavedReadersOfQuartersEachKeepAWindow() {
        var streams = ReadStreams(minWindow: 2 << 20, maxWindow: 64 << 20)
        let size: Int64 = 512 * mib
        let starts = (0..<4).map { Int64($0) * 128 * mib }
        var ids: [Set<Int>] = Array(repeating: [], count: 4)
        var windows = [Int](repeating: 0, count: 4)
        for step in 0..<8 {
            for q in 0..<4 {
                let offset = starts[q] + Int64(step) * mib
                let id = streams.stream(for: offset, count: 1 << 20)
                ids[q].insert(id)
                let ahead = streams.with(id) { $0.observe(offset: offset, count: 1 << 20, size: size, granularity: 2 * mib) } ?? nil
                if let ahead {
                    windows[q] += 1
                    #expect(ahead.lowerBound >= offset + mib && ahead.upperBound <= starts[q] + 128 * mib + 64 * mib)
                }
            }
        }
        #expect(ids.allSatisfy { $0.count == 1 }, "each quarter stays one stream: \(ids)")
        #expect(Set(ids.map { $0.first! }).count == 4)
        #expect(windows.allSatisfy { $0 >= 2 }, "every quarter reads ahead: \(windows)")
    }

    @Test func oneSequentialReaderIsOneStream() {
        var streams = ReadStreams(minWindow: 2 << 20, maxWindow: 64 << 20)
        var ids = Set<Int>()
        for i in 0..<50 {
            let id = streams.stream(for: Int64(i) * mib, count: 1 << 20)
            _ = streams.with(id) { $0.observe(offset: Int64(i) * mib, count: 1 << 20, size: 1 << 30) }
            ids.insert(id)
        }
        #expect(ids.count == 1)
    }

    /// Random reads each start a stream, which gets no window; the places are bounded.
    @Test func randomReadsGetNoWindowAndTakeBoundedPlaces() {
        var streams = ReadStreams(minWindow: 2 << 20, maxWindow: 64 << 20, capacity: 8)
        var rng = SystemRandomNumberGenerator()
        var ahead = 0
        for _ in 0..<500 {
            let offset = Int64.random(in: 0..<(1 << 30), using: &rng) & ~4095
            let id = streams.stream(for: offset, count: 4096)
            if (streams.with(id) { $0.observe(offset: offset, count: 4096, size: 1 << 30) } ?? nil) != nil { ahead += 1 }
        }
        #expect(ahead <= 2)
        #expect(streams.streams.count <= 8)
    }
}

/// The workloads users run (issue 48) through the read path, against the in-memory bucket.
@Suite struct WorkloadReadTests {
    func reader(_ store: MemoryStore, cached: Bool = true, readAhead: Int64 = 64 << 20) throws -> BlockReader {
        let cache = cached ? try BlockCache(directory: temporaryDirectory(), capacity: 512 << 20, blockSize: 16 << 10) : nil
        return BlockReader(store: store, cache: cache, endpoint: "e",
                           config: .init(blockSize: 16 << 10, readAhead: readAhead, partSize: 2 << 20, memoryLimit: 128 << 20))
    }

    /// A small file read as the kernel reads it (128 KiB, then larger requests) costs one GET:
    /// its first miss fetches it whole, and the reads after it are served from that download.
    @Test(arguments: [100_000, 300_000, 1 << 20])
    func aSmallFileReadInPiecesCostsOneRequest(size: Int) throws {
        let store = MemoryStore()
        let bytes = pattern(size, seed: 9)
        store.put("f", bytes)
        let reader = try reader(store)
        let stream = reader.openStream(try store.metadata(of: "f"))
        defer { reader.closeStream(stream) }
        var got: [UInt8] = []
        var offset = 0
        var count = 128 << 10
        while offset < size {
            var out = [UInt8](repeating: 0, count: min(count, size - offset))
            if !out.withUnsafeMutableBytes({ reader.readHere(stream, at: Int64(offset), into: $0) }) {
                try out.withUnsafeMutableBytes { try reader.readWaiting(stream, at: Int64(offset), into: $0) }
            }
            got += out
            offset += out.count
            count = 256 << 10
        }
        #expect(got == bytes)
        #expect(store.requests.read == 1, "\(store.requests.read) GETs for a \(size)-byte file")
    }

    /// Past the limit a file is read in ranges as before: the first read does not fetch it all.
    @Test func aLargerFileIsNotFetchedWhole() throws {
        let store = MemoryStore()
        store.put("f", pattern(Int(BlockReader.defaultWholeObjectLimit) + (1 << 20)))
        let reader = try reader(store, readAhead: 0)
        let stream = reader.openStream(try store.metadata(of: "f"))
        defer { reader.closeStream(stream) }
        var out = [UInt8](repeating: 0, count: 4096)
        try out.withUnsafeMutableBytes { try reader.readWaiting(stream, at: 0, into: $0) }
        #expect(store.bytesRead < 1 << 20)
    }

    /// Four threads reading quarters of one 64 MiB object through one open file, 1 MiB at a
    /// time, in turn: each reads ahead, so most reads find their bytes landed, and the object
    /// is fetched about once, in parts. With one window for the file every read was a miss.
    @Test func readersOfQuartersOfOneOpenFileEachReadAhead() throws {
        let store = MemoryStore()
        let size = 64 << 20
        let bytes = pattern(size, seed: 3)
        store.put("f", bytes)
        let reader = try reader(store)
        let stream = reader.openStream(try store.metadata(of: "f"))
        defer {
            reader.finishPendingWork(timeout: 10)
            reader.closeStream(stream)
        }
        let quarter = size / 4
        var misses = 0
        var out = [UInt8](repeating: 0, count: 1 << 20)
        for step in 0..<(quarter >> 20) {
            for q in 0..<4 {
                let offset = q * quarter + step << 20
                if !out.withUnsafeMutableBytes({ reader.readHere(stream, at: Int64(offset), into: $0) }) {
                    misses += 1
                    try out.withUnsafeMutableBytes { try reader.readWaiting(stream, at: Int64(offset), into: $0) }
                }
                #expect(out.elementsEqual(bytes[offset..<(offset + (1 << 20))]), "at \(offset)")
            }
            _ = reader.pools.prefetch.drain(timeout: 10)  // the read-ahead asked for lands
        }
        #expect(misses <= 12, "\(misses) of 64 reads missed")
        #expect(store.bytesRead <= size + size / 4, "\(store.bytesRead) bytes fetched for \(size)")
    }
}
