import Foundation
import Glibc
import StorageClient

/// What a running mount tells about itself (docs/operations.md): the `user.storefs.stats`
/// document on the mount's root, Prometheus text for `metrics=`, `user.storefs.cached` per
/// file, and `statfs`.
extension Filesystem {
    static let statsAttribute = xattrPrefix + "stats"
    static let cachedAttribute = xattrPrefix + "cached"
    /// Asked by `storefs cache clear --force` on the mount's root: empties the block cache.
    /// A read of it has this effect; it is never listed.
    static let clearCacheAttribute = xattrPrefix + "control.clear_cache"

    /// Numbers that are states, not counts.
    public struct Gauges: Sendable {
        public var cacheDirectory = ""
        public var cacheUsedBytes: Int64 = 0
        public var cacheCapacityBytes: Int64 = 0
        public var cacheObjects = 0
        public var cachePaused = false
        public var inFlightBytes: Int64 = 0
        public var memoryLimitBytes: Int64 = 0
        public var readAheadBytes: Int64 = 0
        public var parallel = 0
        public var partBytes: Int64 = 0
        public var partsRunning = 0
        public var adaptive = false
        public var inodes = 0
        public var knownPaths = 0
        public var listings = 0
        public var offline = false
    }

    public func gauges() -> Gauges {
        var g = Gauges()
        if let cache = reader.cache {
            g.cacheDirectory = cache.directory
            g.cacheUsedBytes = cache.usedBytes
            g.cacheCapacityBytes = cache.capacity
            g.cacheObjects = cache.objectCount
            g.cachePaused = cache.isDegraded
        }
        g.inFlightBytes = reader.budget.inUse
        g.memoryLimitBytes = reader.config.memoryLimit
        g.readAheadBytes = reader.config.readAhead
        g.parallel = reader.transfers.parts
        g.partBytes = reader.transfers.partSize
        g.partsRunning = reader.transfers.running
        g.adaptive = reader.config.adaptive
        g.inodes = table.withLock { $0.nodes.count }
        g.knownPaths = known.withLock { $0.count }
        g.listings = listings.withLock { $0.count }
        g.offline = health.outage != nil
        return g
    }

    /// The `user.storefs.stats` document: one JSON object (README, "Stats and metrics").
    public func statsDocument() -> [UInt8] {
        let m = Metrics.shared.snapshot()
        let g = gauges()
        var ops: [String: Any] = [:]
        for op in FuseOp.allCases where m.ops[op.rawValue] > 0 { ops[op.name] = m.ops[op.rawValue] }
        var errors: [String: Any] = [:]
        for (e, n) in m.errors { errors[Errno.name(e)] = n }
        var requests: [String: Any] = [:]
        for (kind, byStatus) in m.requests {
            var statuses: [String: Any] = [:]
            for (status, n) in byStatus { statuses[String(status)] = n }
            requests[kind.rawValue] = statuses
        }
        var downloaded: [String: Any] = [:]
        for (kind, n) in m.downloadedBytes { downloaded[kind.rawValue] = n }
        let doc: [String: Any] = [
            "uptime_s": (m.uptime * 1000).rounded() / 1000,
            "fuse": ["ops": ops, "errors": errors, "read_bytes": m.readBytes] as [String: Any],
            "storage": [
                "requests": requests,
                "downloaded_bytes": downloaded,
                "downloaded_bytes_total": m.downloadedBytes.values.reduce(0, +),
                "retries": m.retries,
                "offline": g.offline,
            ] as [String: Any],
            "cache": [
                "dir": g.cacheDirectory,
                "used_bytes": g.cacheUsedBytes,
                "capacity_bytes": g.cacheCapacityBytes,
                "objects": g.cacheObjects,
                "paused": g.cachePaused,
                "hits": m.cacheHits,
                "misses": m.cacheMisses,
                "hit_bytes": m.cacheHitBytes,
                "miss_bytes": m.cacheMissBytes,
                "evicted_blocks": m.evictedBlocks,
                "evicted_bytes": m.evictedBytes,
            ] as [String: Any],
            "memory": ["in_flight_bytes": g.inFlightBytes, "limit_bytes": g.memoryLimitBytes] as [String: Any],
            "read_ahead": ["max_window_bytes": g.readAheadBytes, "parallel": g.parallel, "part_bytes": g.partBytes,
                           "parts_running": g.partsRunning, "adaptive": g.adaptive] as [String: Any],
            "namespace": ["inodes": g.inodes, "known_paths": g.knownPaths, "listings": g.listings] as [String: Any],
        ]
        let data = (try? JSONSerialization.data(withJSONObject: doc, options: [.sortedKeys])) ?? Data("{}".utf8)
        return Array(data)
    }

    /// The one-line summary SIGUSR1 logs.
    public func summaryFields() -> [(String, String)] {
        let m = Metrics.shared.snapshot()
        let g = gauges()
        let requests = m.requests.values.reduce(0) { $0 + $1.values.reduce(0, +) }
        return [("uptime_s", String(Int(m.uptime))), ("ops", String(m.ops.reduce(0, +))), ("read_bytes", String(m.readBytes)),
                ("requests", String(requests)), ("downloaded_bytes", String(m.downloadedBytes.values.reduce(0, +))),
                ("retries", String(m.retries)), ("errors", String(m.errors.values.reduce(0, +))),
                ("cache_used_bytes", String(g.cacheUsedBytes)), ("cache_capacity_bytes", String(g.cacheCapacityBytes)),
                ("cache_hits", String(m.cacheHits)), ("cache_misses", String(m.cacheMisses)),
                ("in_flight_bytes", String(g.inFlightBytes)), ("memory_limit_bytes", String(g.memoryLimitBytes)),
                ("parts", String(g.parallel)), ("part_bytes", String(g.partBytes))]
    }

    /// The same numbers in Prometheus's text format (version 0.0.4), for `metrics=`.
    public func prometheusText() -> String {
        PrometheusText.render(Metrics.shared.snapshot(), gauges())
    }

    /// `user.storefs.stats` (the mount's root only) and `user.storefs.cached` (files): nil for
    /// any other name. The stats are the mounting user's and root's only.
    func statisticsAttribute(_ inode: UInt64, name: String, requester uid: UInt32) throws(FilesystemError) -> [UInt8]? {
        if name == Self.statsAttribute, inode == Self.rootInode {
            guard uid == 0 || uid == config.downloadURL.ownerUID else {
                throw FilesystemError(.permissionDenied, "stats are readable by the mounting user and root only")
            }
            return statsDocument()
        }
        if name == Self.clearCacheAttribute, inode == Self.rootInode {
            guard uid == 0 || uid == config.downloadURL.ownerUID else {
                throw FilesystemError(.permissionDenied, "only the mounting user and root may clear the cache")
            }
            guard let cache = reader.cache else { throw FilesystemError(.noAttribute, "this mount has no block cache") }
            let (before, after) = cache.clear()
            Log.info("cache cleared on request", ["dir": cache.directory, "before_bytes": String(before), "after_bytes": String(after)])
            return Array("{\"dir\":\(LogLine.jsonString(cache.directory)),\"before_bytes\":\(before),\"after_bytes\":\(after)}".utf8)
        }
        if name == Self.cachedAttribute, let bytes = cachedBytes(inode) {
            // What was just read tells what another user is reading: the mounting user's and root's.
            guard uid == 0 || uid == config.downloadURL.ownerUID else {
                throw FilesystemError(.permissionDenied, "cached is readable by the mounting user and root only")
            }
            return Array(String(bytes).utf8)
        }
        return nil
    }

    /// Bytes of a file's current generation held in the block cache now; nil for a directory.
    /// It never waits: a download's cache copy is written after the read it answered was
    /// replied to, so a count taken right after a read may still grow for a moment.
    func cachedBytes(_ inode: UInt64) -> Int64? {
        guard let node = table.withLock({ $0.nodes[inode] }), case .file(let record) = node.kind else { return nil }
        guard let cache = reader.cache else { return 0 }
        return cache.cachedBytes(endpoint: reader.endpoint, bucket: reference.bucket, name: objectName(of: node.path),
                                 generation: record.generation, size: record.size)
    }

    /// `statfs`: the block cache's capacity and what is free in it (README, "Stats and metrics").
    public struct Usage: Sendable {
        public var blockSize: Int
        public var blocks: UInt64
        public var freeBlocks: UInt64
        public var files: UInt64
        public var freeFiles: UInt64
        /// The longest name a directory shows (`f_namemax`).
        public var maxNameLength = DirectoryListing.maxNameBytes
    }

    public func usage() -> Usage {
        let g = gauges()
        let bs = 1 << 20
        let total = UInt64(max(0, g.cacheCapacityBytes) / Int64(bs))
        let used = UInt64((max(0, g.cacheUsedBytes) + Int64(bs) - 1) / Int64(bs))
        let names = UInt64(config.metadataCacheSize)
        return Usage(blockSize: bs, blocks: total, freeBlocks: total > used ? total - used : 0,
                     files: names, freeFiles: names > UInt64(g.knownPaths) ? names - UInt64(g.knownPaths) : 0)
    }
}

/// Prometheus exposition of `Metrics` (docs/operations.md, "Metrics").
enum PrometheusText {
    static func render(_ m: Metrics.Snapshot, _ g: Filesystem.Gauges) -> String {
        var out = ""
        func family(_ name: String, _ type: String, _ help: String) {
            out += "# HELP \(name) \(help)\n# TYPE \(name) \(type)\n"
        }
        func sample(_ name: String, _ labels: [(String, String)], _ value: String) {
            let l = labels.isEmpty ? "" : "{" + labels.map { "\($0.0)=\"\(escape($0.1))\"" }.joined(separator: ",") + "}"
            out += "\(name)\(l) \(value)\n"
        }
        func plain(_ name: String, _ value: String) { sample(name, [], value) }
        func histogram(_ name: String, _ labels: [(String, String)], _ h: Histogram) {
            var cumulative: UInt64 = 0
            for (i, bound) in Histogram.bounds.enumerated() {
                cumulative += h.counts[i]
                sample(name + "_bucket", labels + [("le", number(bound))], String(cumulative))
            }
            sample(name + "_bucket", labels + [("le", "+Inf")], String(h.count))
            sample(name + "_sum", labels, number(h.sum))
            sample(name + "_count", labels, String(h.count))
        }

        family("storefs_uptime_seconds", "gauge", "Seconds since the daemon started.")
        plain("storefs_uptime_seconds", number(m.uptime))
        family("storefs_fuse_operations_total", "counter", "FUSE operations answered, by operation.")
        for op in FuseOp.allCases { sample("storefs_fuse_operations_total", [("op", op.name)], String(m.ops[op.rawValue])) }
        family("storefs_fuse_errors_total", "counter", "FUSE operations answered with an error, by errno.")
        for (e, n) in m.errors.sorted(by: { $0.key < $1.key }) { sample("storefs_fuse_errors_total", [("errno", Errno.name(e))], String(n)) }
        family("storefs_fuse_read_bytes_total", "counter", "Bytes returned to the kernel by reads.")
        plain("storefs_fuse_read_bytes_total", String(m.readBytes))
        family("storefs_fuse_read_duration_seconds", "histogram", "Time from a FUSE read's arrival to its reply.")
        histogram("storefs_fuse_read_duration_seconds", [], m.readLatency)

        family("storefs_http_requests_total", "counter", "HTTP requests to the storage server, by kind and status (0: no answer).")
        for kind in RequestKind.allCases {
            for (status, n) in (m.requests[kind] ?? [:]).sorted(by: { $0.key < $1.key }) {
                sample("storefs_http_requests_total", [("kind", kind.rawValue), ("status", String(status))], String(n))
            }
        }
        family("storefs_http_received_bytes_total", "counter", "Body bytes received from the storage server, by kind.")
        for kind in RequestKind.allCases { sample("storefs_http_received_bytes_total", [("kind", kind.rawValue)], String(m.downloadedBytes[kind] ?? 0)) }
        family("storefs_http_request_duration_seconds", "histogram", "Duration of HTTP requests, by kind.")
        for kind in RequestKind.allCases { histogram("storefs_http_request_duration_seconds", [("kind", kind.rawValue)], m.requestLatency[kind] ?? Histogram()) }
        family("storefs_http_retries_total", "counter", "Failed tries that were tried again.")
        plain("storefs_http_retries_total", String(m.retries))

        family("storefs_cache_hits_total", "counter", "Reads answered from the block cache without the network.")
        plain("storefs_cache_hits_total", String(m.cacheHits))
        family("storefs_cache_misses_total", "counter", "Reads that needed the network.")
        plain("storefs_cache_misses_total", String(m.cacheMisses))
        family("storefs_cache_hit_bytes_total", "counter", "Bytes of reads answered from the block cache.")
        plain("storefs_cache_hit_bytes_total", String(m.cacheHitBytes))
        family("storefs_cache_miss_bytes_total", "counter", "Bytes of reads that needed the network.")
        plain("storefs_cache_miss_bytes_total", String(m.cacheMissBytes))
        family("storefs_cache_evicted_blocks_total", "counter", "Blocks evicted from the block cache.")
        plain("storefs_cache_evicted_blocks_total", String(m.evictedBlocks))
        family("storefs_cache_evicted_bytes_total", "counter", "Disk bytes freed by evictions.")
        plain("storefs_cache_evicted_bytes_total", String(m.evictedBytes))
        family("storefs_cache_used_bytes", "gauge", "Disk bytes the block cache holds.")
        plain("storefs_cache_used_bytes", String(g.cacheUsedBytes))
        family("storefs_cache_capacity_bytes", "gauge", "The block cache's cap (cache_size).")
        plain("storefs_cache_capacity_bytes", String(g.cacheCapacityBytes))
        family("storefs_cache_objects", "gauge", "Object generations with a cache file.")
        plain("storefs_cache_objects", String(g.cacheObjects))

        family("storefs_memory_in_flight_bytes", "gauge", "Bytes held by downloads in flight.")
        plain("storefs_memory_in_flight_bytes", String(g.inFlightBytes))
        family("storefs_memory_limit_bytes", "gauge", "The bound on downloads in flight (memory_limit).")
        plain("storefs_memory_limit_bytes", String(g.memoryLimitBytes))
        family("storefs_read_ahead_max_bytes", "gauge", "The largest read-ahead window of a reader (read_ahead).")
        plain("storefs_read_ahead_max_bytes", String(g.readAheadBytes))
        family("storefs_read_ahead_parallel", "gauge", "Read-ahead parts allowed in flight now (found from the link, or parallel=).")
        plain("storefs_read_ahead_parallel", String(g.parallel))
        family("storefs_read_ahead_part_bytes", "gauge", "Size of read-ahead parts now.")
        plain("storefs_read_ahead_part_bytes", String(g.partBytes))
        family("storefs_read_ahead_parts_running", "gauge", "Read-ahead parts downloading now.")
        plain("storefs_read_ahead_parts_running", String(g.partsRunning))
        family("storefs_inodes", "gauge", "Inodes the kernel holds references to.")
        plain("storefs_inodes", String(g.inodes))
        family("storefs_known_paths", "gauge", "Paths remembered beyond the kernel's references.")
        plain("storefs_known_paths", String(g.knownPaths))
        family("storefs_offline", "gauge", "1 while the bucket does not answer.")
        plain("storefs_offline", g.offline ? "1" : "0")
        return out
    }

    static func number(_ d: Double) -> String {
        if d == d.rounded(), abs(d) < 1e15 { return String(Int64(d)) }
        return String(d)
    }

    static func escape(_ s: String) -> String {
        s.replacingOccurrences(of: "\\", with: "\\\\").replacingOccurrences(of: "\"", with: "\\\"")
            .replacingOccurrences(of: "\n", with: "\\n")
    }
}
