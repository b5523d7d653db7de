import Foundation
import StorageClient

// What a running mount tells about itself, rendered (docs/operations.md, "Metrics"): the
// counters (`Metrics`) and the gauges (`Gauges`) as the `user.storefs.stats` JSON document,
// the SIGUSR1 summary line, and Prometheus text.

/// Numbers that are states, not counts: the read path reports its own (`BlockReader.report`),
/// the namespace its own (`Filesystem.gauges`).
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

/// The `user.storefs.stats` document: one JSON object (README, "Stats and metrics").
enum StatsDocument {
    static func render(_ m: Metrics.Snapshot, _ g: Gauges) -> [UInt8] {
        var ops: [String: Any] = [:]
        for (name, n) in zip(m.opNames, m.ops) where n > 0 { ops[name] = n }
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
}

/// The one-line summary SIGUSR1 logs.
enum SummaryLine {
    static func fields(_ m: Metrics.Snapshot, _ g: Gauges) -> [(String, String)] {
        let requests = m.requests.values.reduce(0) { $0 + $1.values.reduce(0, +) }
        return [("uptime_s", String(Int(m.uptime))), ("ops", String(m.ops.reduce(0, +))), ("read_bytes", String(m.readBytes)),
                ("requests", String(requests)), ("downloaded_bytes", String(m.downloadedBytes.values.reduce(0, +))),
                ("retries", String(m.retries)), ("errors", String(m.errors.values.reduce(0, +))),
                ("cache_used_bytes", String(g.cacheUsedBytes)), ("cache_capacity_bytes", String(g.cacheCapacityBytes)),
                ("cache_hits", String(m.cacheHits)), ("cache_misses", String(m.cacheMisses)),
                ("in_flight_bytes", String(g.inFlightBytes)), ("memory_limit_bytes", String(g.memoryLimitBytes)),
                ("parts", String(g.parallel)), ("part_bytes", String(g.partBytes))]
    }
}

/// Prometheus exposition of `Metrics` (docs/operations.md, "Metrics").
enum PrometheusText {
    static func render(_ m: Metrics.Snapshot, _ g: Gauges) -> String {
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
        for (name, n) in zip(m.opNames, m.ops) { sample("storefs_fuse_operations_total", [("op", name)], String(n)) }
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
