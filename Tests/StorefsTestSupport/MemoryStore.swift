import Foundation
import Glibc
import StorageClient
internal import CChecksum
import Synchronization

/// An in-memory bucket that counts requests, for testing the core and the adapter without HTTP
/// (shared by the test targets).
public final class MemoryStore: ObjectStore, ConnectionTuning {
    public struct Counts: Equatable, Sendable {
        public var list = 0, metadata = 0, read = 0
        public init(list: Int = 0, metadata: Int = 0, read: Int = 0) { (self.list, self.metadata, self.read) = (list, metadata, read) }
    }

    public let bucket = "b"
    public let pageSize: Int
    private let objects = Mutex<[String: (ObjectMetadata, [UInt8])]>([:])
    private let counts = Mutex(Counts())
    private let failure = Mutex<StorageError?>(nil)
    private let delay = Mutex<Double>(0)
    private let readBytes = Mutex<Int>(0)
    private let corruptions = Mutex<Int>(0)

    /// Flips one bit in the answers of the next `count` media reads (a corrupting server).
    public func corruptNextReads(_ count: Int) { corruptions.withLock { $0 = count } }

    /// Makes every media read take this long (to line readers up on one download).
    public func delayReads(_ seconds: Double) { delay.withLock { $0 = seconds } }

    /// Each read reports this as its time to first byte (as the HTTP client does): a far server.
    private let firstByte = Mutex<Double?>(nil)
    public func reportFirstByte(_ seconds: Double) { firstByte.withLock { $0 = seconds } }
    private let fastest = FastestAnswer()
    public var fastestFirstByte: Double? { fastest.seconds }

    private let metadataDelay = Mutex<Double>(0)
    /// Makes every list and metadata request take this long (a slow server), cancellable.
    public func delayAll(_ seconds: Double) { metadataDelay.withLock { $0 = seconds } }

    private func slowly(_ isCancelled: (@Sendable () -> Bool)?) throws(StorageError) {
        let end = Date().addingTimeInterval(metadataDelay.withLock { $0 })
        while Date() < end {
            if let isCancelled, isCancelled() { throw StorageError(.cancelled, "cancelled") }
            usleep(5_000)
        }
    }
    public var bytesRead: Int { readBytes.withLock { $0 } }

    /// Answers `readStart` (as the Firebase v0 store does) once set; counts its calls.
    private let startReads = Mutex<Int?>(nil)
    public func answerReadStart() { startReads.withLock { $0 = 0 } }
    public var readStarts: Int { startReads.withLock { $0 ?? 0 } }

    public func readStart(_ name: String, into buffer: UnsafeMutableRawBufferPointer,
                   isCancelled: (@Sendable () -> Bool)?) throws(StorageError) -> ObjectStart? {
        guard startReads.withLock({ s -> Bool in
            guard let n = s else { return false }
            s = n + 1
            return true
        }) else { return nil }
        try check()
        guard let (m, bytes) = objects.withLock({ $0[name] }) else { throw StorageError(.notFound, "no \(name)", httpStatus: 404) }
        let n = min(buffer.count, bytes.count)
        bytes.withUnsafeBytes { buffer.copyMemory(from: UnsafeRawBufferPointer(rebasing: $0[0..<n])) }
        return ObjectStart(generation: m.generation, size: m.size, count: n)
    }

    /// A connection pool, simulated: nil (no pool) until `simulateConnections`.
    private let connections = Mutex<(count: Int, opened: Int)?>(nil)
    public func simulateConnections(_ count: Int) { connections.withLock { $0 = (count, 0) } }
    /// `openConnection` calls so far.
    public var connectionsOpened: Int { connections.withLock { $0?.opened ?? 0 } }
    public var connectionCount: Int? { connections.withLock { $0?.count } }
    public func openConnection(forReading name: String, generation: Int64) {
        connections.withLock { c in
            c?.count += 1
            c?.opened += 1
        }
    }

    public init(pageSize: Int = 1000) { self.pageSize = pageSize }

    public var requests: Counts { counts.withLock { $0 } }

    /// `crc32c`: give the object its CRC32C in the metadata, as GCS does (base64, big-endian).
    public func put(_ name: String, _ bytes: [UInt8], generation: Int64 = 1, custom: [String: String] = [:], crc32c: Bool = false) {
        var m = ObjectMetadata(name: name, bucket: bucket, size: Int64(bytes.count), generation: generation,
                               updated: Timestamp(seconds: 1_700_000_000), contentType: "text/plain", custom: custom)
        if crc32c {
            let crc = bytes.withUnsafeBytes { cchecksum_crc32c(0, $0.baseAddress, $0.count) }
            m.crc32c = Data([UInt8(crc >> 24), UInt8(crc >> 16 & 0xff), UInt8(crc >> 8 & 0xff), UInt8(crc & 0xff)]).base64EncodedString()
        }
        m.downloadTokens = custom["firebaseStorageDownloadTokens"].map { $0.split(separator: ",").map(String.init) } ?? []
        objects.withLock { $0[name] = (m, bytes) }
    }

    /// Deletes an object (as another client of the bucket would).
    public func remove(_ name: String) { _ = objects.withLock { $0.removeValue(forKey: name) } }

    public func failAll(with error: StorageError?) { failure.withLock { $0 = error } }

    private func check() throws(StorageError) {
        if let e = failure.withLock({ $0 }) { throw e }
    }

    public func list(prefix: String, pageToken: String?, isCancelled: (@Sendable () -> Bool)?,
                     connection: ConnectionClaim?) throws(StorageError) -> ListPage {
        counts.withLock { $0.list += 1 }
        try check()
        try slowly(isCancelled)
        // One snapshot of the names and their metadata: a test may delete an object while a
        // listing runs on another thread (a listing ahead), which must not find it half gone.
        let snapshot = objects.withLock { o in o.filter { $0.key.hasPrefix(prefix) }.mapValues { $0.0 } }
        let names = snapshot.keys.sorted()
        var items: [ObjectMetadata] = []
        var prefixes = Set<String>()
        var started = pageToken == nil
        var next: String? = nil
        for n in names {
            if !started { if n == pageToken { started = true } else { continue } }
            let rest = n.dropFirst(prefix.count)
            if let slash = rest.firstIndex(of: "/") {
                prefixes.insert(prefix + rest[...slash])
                continue
            }
            if items.count == pageSize { next = n; break }
            items.append(snapshot[n]!)
        }
        return ListPage(items: items, prefixes: prefixes.sorted(), nextPageToken: next)
    }

    public func hasChildren(prefix: String, isCancelled: (@Sendable () -> Bool)?) throws(StorageError) -> Bool {
        counts.withLock { $0.list += 1 }
        try check()
        try slowly(isCancelled)
        return objects.withLock { $0.keys.contains { $0.hasPrefix(prefix) } }
    }

    public func metadata(of name: String, isCancelled: (@Sendable () -> Bool)?) throws(StorageError) -> ObjectMetadata {
        counts.withLock { $0.metadata += 1 }
        try check()
        try slowly(isCancelled)
        guard let m = objects.withLock({ $0[name]?.0 }) else { throw StorageError(.notFound, "no \(name)", httpStatus: 404) }
        return m
    }

    /// Takes the buffer after the read's delay, as the HTTP client takes it at the first byte.
    @discardableResult
    public func read(_ name: String, generation: Int64, offset: Int64, into target: RangeBuffer,
                     isCancelled: (@Sendable () -> Bool)?, connection: ConnectionClaim?) throws(StorageError) -> ReadTiming {
        counts.withLock { $0.read += 1 }
        try check()
        let end = Date().addingTimeInterval(delay.withLock { $0 })
        while Date() < end {
            if let isCancelled, isCancelled() { throw StorageError(.cancelled, "cancelled") }
            usleep(5_000)
        }
        readBytes.withLock { $0 += target.count }
        let reported = firstByte.withLock { $0 }
        if let reported { fastest.note(reported) }
        guard let (m, bytes) = objects.withLock({ $0[name] }), m.generation == generation else {
            throw StorageError(.generationChanged, "gone", httpStatus: 404)
        }
        precondition(target.count > 0 && offset + Int64(target.count) <= m.size, "read outside the object")
        let buffer = target.bytes
        bytes.withUnsafeBytes { src in
            buffer.copyMemory(from: UnsafeRawBufferPointer(rebasing: src[Int(offset)..<(Int(offset) + buffer.count)]))
        }
        if corruptions.withLock({ c -> Bool in
            guard c > 0 else { return false }
            c -= 1
            return true
        }) {
            buffer[buffer.count / 2] ^= 0x10
        }
        return ReadTiming(firstByte: reported ?? 0)
    }

    /// No pool of connections to claim from.
    public func claimIdleConnection() -> ConnectionClaim? { nil }

    public func checkAccess(prefix: String) throws(StorageError) -> ListPage? {
        try check()
        return nil
    }
}
