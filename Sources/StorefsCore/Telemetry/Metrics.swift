import Foundation
import StorageClient
import Synchronization
import Locking

/// Cumulative buckets of a latency histogram, Prometheus-style: `counts[i]` observations
/// ≤ `bounds[i]` seconds (not cumulative in storage; cumulated when written out).
public struct Histogram: Sendable {
    public static let bounds: [Double] = [0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10]
    /// One more than `bounds`: the last counts what is above every bound.
    public var counts = [UInt64](repeating: 0, count: Histogram.bounds.count + 1)
    public var sum = 0.0
    public var count: UInt64 = 0

    public mutating func observe(_ seconds: Double) {
        var i = 0
        while i < Self.bounds.count && seconds > Self.bounds[i] { i += 1 }
        counts[i] += 1
        sum += seconds
        count += 1
    }
}

/// The daemon's counters since it started (docs/operations.md, "Metrics"): FUSE operations,
/// HTTP requests, the block cache. One process, one mount: a shared instance.
public final class Metrics: Sendable {
    public static let shared = Metrics()

    public struct Snapshot: Sendable {
        public var uptime: Double = 0
        /// Operations answered, by the adapter's index (`nameOperations`), and their names.
        public var ops: [UInt64] = []
        public var opNames: [String] = []
        /// Failed operations by errno (positive values).
        public var errors: [Int32: UInt64] = [:]
        /// Bytes the kernel received from reads.
        public var readBytes: UInt64 = 0
        public var readLatency = Histogram()
        /// Requests by kind and HTTP status (0: no answer).
        public var requests: [RequestKind: [Int: UInt64]] = [:]
        public var downloadedBytes: [RequestKind: UInt64] = [:]
        public var requestLatency: [RequestKind: Histogram] = [:]
        public var retries: UInt64 = 0
        /// Reads answered from the block cache on the FUSE thread, and reads that needed the network.
        public var cacheHits: UInt64 = 0
        public var cacheMisses: UInt64 = 0
        public var cacheHitBytes: UInt64 = 0
        public var cacheMissBytes: UInt64 = 0
        public var evictedBlocks: UInt64 = 0
        public var evictedBytes: UInt64 = 0
    }

    private let started = monotonicNow()
    private let fuse = OrderedMutex(.metricsFuse, Snapshot())
    private let http = OrderedMutex(.metricsHTTP, Snapshot())
    private let cache = OrderedMutex(.metricsCache, Snapshot())

    /// The operations the FUSE adapter answers, in its order (its `FuseOp`): named once, at
    /// start, and counted by index from then on.
    public func nameOperations(_ names: [String]) {
        fuse.withLock { s in
            s.opNames = names
            s.ops = [UInt64](repeating: 0, count: names.count)
        }
    }

    /// One answered operation (by its index among `nameOperations`): `errno` 0 for success; a
    /// read's bytes and time go to the read counters.
    public func operation(_ index: Int, errno: Int32, seconds: Double, bytes: Int = 0, isRead: Bool = false) {
        fuse.withLock { s in
            if index < s.ops.count { s.ops[index] += 1 }
            if errno != 0 { s.errors[errno, default: 0] += 1 }
            if isRead {
                s.readBytes += UInt64(bytes)
                s.readLatency.observe(seconds)
            }
        }
    }

    /// `count` answered operations of one kind at once (a batch of forgets).
    public func operations(_ index: Int, count: Int) {
        fuse.withLock { s in if index < s.ops.count { s.ops[index] += UInt64(count) } }
    }

    public func exchange(_ r: HTTPExchangeRecord) {
        http.withLock { s in
            s.requests[r.kind, default: [:]][r.status, default: 0] += 1
            s.downloadedBytes[r.kind, default: 0] += UInt64(r.bytes)
            s.requestLatency[r.kind, default: Histogram()].observe(r.seconds)
        }
    }

    public func retried() { http.withLock { $0.retries += 1 } }

    public func cacheRead(hit: Bool, bytes: Int) {
        cache.withLock { s in
            if hit {
                s.cacheHits += 1
                s.cacheHitBytes += UInt64(bytes)
            } else {
                s.cacheMisses += 1
                s.cacheMissBytes += UInt64(bytes)
            }
        }
    }

    public func evicted(blocks: Int, bytes: Int64) {
        cache.withLock { s in
            s.evictedBlocks += UInt64(blocks)
            s.evictedBytes += UInt64(max(0, bytes))
        }
    }

    public func snapshot() -> Snapshot {
        var out = fuse.withLock { $0 }
        let h = http.withLock { $0 }
        let c = cache.withLock { $0 }
        out.uptime = monotonicNow() - started
        out.requests = h.requests
        out.downloadedBytes = h.downloadedBytes
        out.requestLatency = h.requestLatency
        out.retries = h.retries
        out.cacheHits = c.cacheHits
        out.cacheMisses = c.cacheMisses
        out.cacheHitBytes = c.cacheHitBytes
        out.cacheMissBytes = c.cacheMissBytes
        out.evictedBlocks = c.evictedBlocks
        out.evictedBytes = c.evictedBytes
        return out
    }

    /// Routes the storage client's hooks here, and into debug log lines (one per request:
    /// method, kind, target without its query, status, bytes, duration, try number).
    public func observeStorage() {
        StorageTelemetry.onExchange = { [self] r in
            exchange(r)
            if Log.enabled(.debug) {
                var fields = [("method", r.method), ("kind", r.kind.rawValue), ("target", r.target), ("status", String(r.status)),
                              ("bytes", String(r.bytes)), ("dur_ms", LogLine.milliseconds(r.seconds)), ("attempt", String(r.attempt))]
                if !r.httpVersion.isEmpty { fields.append(("http", r.httpVersion)) }
                if let failure = r.failure { fields.append(("error", failure)) }
                Log.log(.debug, "http", fields: fields)
            }
        }
        StorageTelemetry.onRetry = { [self] _ in retried() }
    }
}
