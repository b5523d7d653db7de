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

    /// The mount's gauges: the read path's (`BlockReader.report`) and the namespace's.
    public func gauges() -> Gauges {
        var g = Gauges()
        reader.report(into: &g)
        g.inodes = table.withLock { $0.nodes.count }
        g.knownPaths = known.withLock { $0.count }
        g.listings = listings.withLock { $0.count }
        g.offline = health.outage != nil
        return g
    }

    /// The `user.storefs.stats` document: one JSON object (README, "Stats and metrics").
    public func statsDocument() -> [UInt8] { StatsDocument.render(Metrics.shared.snapshot(), gauges()) }

    /// The one-line summary SIGUSR1 logs.
    public func summaryFields() -> [(String, String)] { SummaryLine.fields(Metrics.shared.snapshot(), gauges()) }

    /// The same numbers in Prometheus's text format (version 0.0.4), for `metrics=`.
    public func prometheusText() -> String { PrometheusText.render(Metrics.shared.snapshot(), gauges()) }

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
