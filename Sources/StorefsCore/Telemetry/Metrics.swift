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

    /// Adds `other`'s observations (a snapshot sums the stripes).
    mutating func add(_ other: Histogram) {
        for i in counts.indices { counts[i] += other.counts[i] }
        sum += other.sum
        count += other.count
    }
}

/// The daemon's counters since it started (docs/operations.md, "Metrics"): FUSE operations,
/// HTTP requests, the block cache. One process, one mount: a shared instance.
///
/// Counted in stripes, a thread's stripe chosen by its `pthread_self`: every FUSE reply and
/// every request is counted, and one lock for them all made the FUSE threads wait for each
/// other (4% of the daemon's CPU in the files row went to that lock, docs/experiments.md,
/// "2026-12-08"). A snapshot adds the stripes up.
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

    /// One stripe's counters: each lock guards the fields of its group in its `Snapshot`.
    private final class Stripe: Sendable {
        let fuse = OrderedMutex(.metricsFuse, Snapshot())
        let http = OrderedMutex(.metricsHTTP, Snapshot())
        let cache = OrderedMutex(.metricsCache, Snapshot())
    }

    static let stripeBits = 5
    static let stripeCount = 1 << stripeBits
    private let started = monotonicNow()
    private let stripes = (0..<Metrics.stripeCount).map { _ in Stripe() }
    /// Set once, before the first operation is counted.
    private let opNames = OrderedMutex(.metricsFuse, [String]())

    /// The calling thread's stripe.
    private var stripe: Stripe { stripes[Self.stripeIndex(of: pthread_self())] }

    /// A thread's stripe: its `pthread_t` (the address of its thread control block, a
    /// stack's size apart from the next thread's) hashed, so that threads whose addresses
    /// differ only in high bits spread too.
    static func stripeIndex(of thread: pthread_t) -> Int {
        Int((UInt64(thread) &* 0x9E37_79B9_7F4A_7C15) >> (64 - stripeBits))
    }

    /// The operations the FUSE adapter answers, in its order (its `FuseOp`): named once, at
    /// start, and counted by index from then on.
    public func nameOperations(_ names: [String]) {
        opNames.withLock { $0 = names }
        for stripe in stripes {
            stripe.fuse.withLock { $0.ops = [UInt64](repeating: 0, count: names.count) }
        }
    }

    /// One answered operation (by its index among `nameOperations`): `errno` 0 for success; a
    /// read's bytes and time go to the read counters.
    public func operation(_ index: Int, errno: Int32, seconds: Double, bytes: Int = 0, isRead: Bool = false) {
        stripe.fuse.withLock { s in
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
        stripe.fuse.withLock { s in if index < s.ops.count { s.ops[index] += UInt64(count) } }
    }

    public func exchange(_ r: HTTPExchangeRecord) {
        stripe.http.withLock { s in
            s.requests[r.kind, default: [:]][r.status, default: 0] += 1
            s.downloadedBytes[r.kind, default: 0] += UInt64(r.bytes)
            s.requestLatency[r.kind, default: Histogram()].observe(r.seconds)
        }
    }

    public func retried() { stripe.http.withLock { $0.retries += 1 } }

    public func cacheRead(hit: Bool, bytes: Int) {
        stripe.cache.withLock { s in
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
        stripe.cache.withLock { s in
            s.evictedBlocks += UInt64(blocks)
            s.evictedBytes += UInt64(max(0, bytes))
        }
    }

    public func snapshot() -> Snapshot {
        var out = Snapshot()
        out.opNames = opNames.withLock { $0 }
        out.ops = [UInt64](repeating: 0, count: out.opNames.count)
        for stripe in stripes {
            let f = stripe.fuse.withLock { $0 }
            for (i, n) in f.ops.enumerated() where i < out.ops.count { out.ops[i] += n }
            out.errors.merge(f.errors, uniquingKeysWith: +)
            out.readBytes += f.readBytes
            out.readLatency.add(f.readLatency)
            let h = stripe.http.withLock { $0 }
            out.requests.merge(h.requests) { $0.merging($1, uniquingKeysWith: +) }
            out.downloadedBytes.merge(h.downloadedBytes, uniquingKeysWith: +)
            out.requestLatency.merge(h.requestLatency) { a, b in
                var sum = a
                sum.add(b)
                return sum
            }
            out.retries += h.retries
            let c = stripe.cache.withLock { $0 }
            out.cacheHits += c.cacheHits
            out.cacheMisses += c.cacheMisses
            out.cacheHitBytes += c.cacheHitBytes
            out.cacheMissBytes += c.cacheMissBytes
            out.evictedBlocks += c.evictedBlocks
            out.evictedBytes += c.evictedBytes
        }
        out.uptime = monotonicNow() - started
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
