import Foundation
import Glibc
import StorageClient
import StorefsCore

/// `storefs manifest [--format csv|jsonl] [--gzip] [-o OPT,...] SOURCE > FILE`
/// (docs/manifest.md, "Making a manifest"): one listing of SOURCE, written to standard output
/// as a manifest a mount can be made from (`-o manifest=FILE`); progress on standard error.
/// SOURCE and the `-o` options are a mount's (endpoint, protocol, credentials, TLS).
/// Also here: opening a mount's manifest before it daemonizes (`openForMount`).
enum ManifestCommand {
    static let usage = "usage: storefs manifest [--format csv|jsonl] [--gzip] [-o OPT,...] SOURCE > FILE"

    static func run(_ arguments: [String], environment env: [String: String]) -> Int32 {
        var format = ManifestWriter.Format.csv
        var gzip = false
        var rest: [String] = []
        var i = 0
        while i < arguments.count {
            let a = arguments[i]
            switch a {
            case "-h", "--help":
                print(usage)
                print("""

                    Writes every object under SOURCE (name, size, generation, updated, crc32c) as CSV (default) or
                    JSON Lines, optionally gzipped; mount from it with -o manifest=FILE (no list request).
                    -o takes the mount's options: endpoint=, protocol=, credentials=, token_file=, ca_file=, ...
                    """)
                return 0
            case "--gzip", "-z": gzip = true
            case "--format":
                i += 1
                guard i < arguments.count else { return StorefsMain.fail("--format needs csv or jsonl: \(usage)", status: 2) }
                guard let f = ManifestWriter.Format(rawValue: arguments[i]) else {
                    return StorefsMain.fail("--format \(arguments[i]) is not csv or jsonl", status: 2)
                }
                format = f
            case _ where a.hasPrefix("--format="):
                guard let f = ManifestWriter.Format(rawValue: String(a.dropFirst("--format=".count))) else {
                    return StorefsMain.fail("\(a) is not csv or jsonl", status: 2)
                }
                format = f
            case "-o":
                rest.append(a)
                i += 1
                if i < arguments.count { rest.append(arguments[i]) }
            default:
                rest.append(a)
            }
            i += 1
        }
        let o: MountOptions
        do {
            switch try MountOptions.parseManifestCommand(arguments: rest, environment: env) {
            case .mount(let parsed): o = parsed
            case .version:
                print("storefs \(StorefsMain.version)")
                return 0
            default:
                print(usage)
                return 0
            }
        } catch {
            return StorefsMain.fail(error.message, status: 2)
        }
        if o.manifest != nil {
            return StorefsMain.fail("manifest= is a mount option: storefs manifest writes a manifest (\(usage))", status: 2)
        }
        if gzip && isatty(1) == 1 {
            return StorefsMain.fail("refusing to write gzip to a terminal: redirect the output to a file (storefs manifest --gzip SOURCE > FILE.gz)", status: 2)
        }
        Log.configure(level: o.logLevel == .info ? .warn : o.logLevel, format: o.logFormat)
        StorefsMain.scrubSecretsFromCommandLine()
        let store: ObjectStore
        switch StorefsMain.connect(o, environment: env) {
        case .success(let c): store = c.store
        case .failure(let problem): return StorefsMain.fail(problem.message)
        }
        let started = now()
        let terminal = isatty(2) == 1
        var lastReport = started
        func line(_ p: ManifestListing.Progress) -> String {
            let t = now() - started
            return "storefs manifest: \(p.objects) objects (\(bytes(p.bytes))), \(p.listRequests) list requests"
                + (p.metadataRequests > 0 ? ", \(p.metadataRequests) metadata requests" : "") + String(format: ", %.1f s", t)
        }
        do throws(ManifestError) {
            let writer = try ManifestWriter(fd: 1, format: format, gzip: gzip)
            var last = ManifestListing.Progress()
            try ManifestListing.run(store: store, reference: o.source, writer: writer) { p in
                last = p
                let t = now()
                // A redrawn line on a terminal (every second), a plain line every ten seconds otherwise.
                if t - lastReport >= (terminal ? 1 : 10) {
                    lastReport = t
                    err(terminal ? "\r" + line(p) + "\u{1b}[K" : line(p) + "\n")
                }
            }
            try writer.finish()
            err((terminal ? "\r" : "") + line(last) + ", done: \(writer.bytesWritten) bytes written" + (terminal ? "\u{1b}[K\n" : "\n"))
            return 0
        } catch {
            if terminal { err("\n") }
            return StorefsMain.fail(error.message)
        }
    }

    /// Monotonic seconds (progress lines).
    private static func now() -> Double {
        var ts = timespec()
        clock_gettime(CLOCK_MONOTONIC, &ts)
        return Double(ts.tv_sec) + Double(ts.tv_nsec) / 1e9
    }

    private static func err(_ s: String) {
        _ = s.withCString { write(2, $0, strlen($0)) }
    }

    /// Opens (building when needed) the manifest of a mount, then checks the bucket with one
    /// metadata GET of the manifest's first object under the mount's root, no listing. An
    /// unreachable bucket mounts anyway with offline=auto (every name is in the manifest); the
    /// error is returned to start the mount offline. Everything else wrong is a one-line problem.
    static func openForMount(_ path: String, _ o: MountOptions, cacheDirectory: String,
                             store: ObjectStore) -> Result<(ManifestNamespace, StorageError?), StorefsMain.Problem> {
        let opened: ManifestNamespace.Opened
        do throws(ManifestError) {
            let source = try ManifestSource(path: path)
            let total = source.totalBytes
            let terminal = isatty(2) == 1
            var lastReport = now()
            opened = try ManifestNamespace.open(source, cacheDirectory: cacheDirectory, bucket: o.source.bucket, prefix: o.source.prefix,
                                                refresh: o.manifestRefresh, progress: { done in
                let t = now()
                guard terminal, t - lastReport >= 1 else { return }
                lastReport = t
                let percent = total > 0 ? Int(done * 100 / total) : 100
                err("\rstorefs: indexing the manifest: \(percent)% of \(bytes(total))\u{1b}[K")
            })
            if terminal, opened.built != nil { err("\r\u{1b}[K") }
        } catch {
            return .failure(StorefsMain.Problem(message: error.message))
        }
        let m = opened.namespace
        if let b = opened.built {
            Log.info("manifest indexed", ["files": String(b.files), "directories": String(b.directories), "rows": String(b.rows),
                                          "index": opened.indexPath, "index_bytes": String(m.indexBytes),
                                          "seconds": String(format: "%.1f", opened.seconds)])
            if b.deleted > 0 { Log.info("manifest rows of deleted objects skipped (timeDeleted set)", ["rows": String(b.deleted)]) }
            if b.duplicates > 0 {
                Log.warn("manifest names given more than once: the highest generation of each is used", ["names": String(b.duplicates)])
            }
            if b.hidden > 0 {
                Log.info("manifest names that cannot be path components are hidden (as in listings)", ["names": String(b.hidden)])
            }
            for name in b.shadowedNames { Log.info("object \(name) is hidden by the directory of the same name") }
            if b.shadowed > b.shadowedNames.count {
                Log.info("more objects are hidden by directories of the same name", ["objects": String(b.shadowed - b.shadowedNames.count)])
            }
        } else {
            Log.debug("manifest index reused", ["index": opened.indexPath, "files": String(m.fileCount)])
        }
        guard let first = m.firstFile() else {
            Log.warn("the manifest has no object under the mount's root: the mount is empty", ["source": o.source.description])
            return .success((m, nil))
        }
        let name = o.source.prefix.isEmpty ? first : o.source.prefix + "/" + first
        do throws(StorageError) {
            _ = try store.metadata(of: name, isCancelled: nil)
        } catch {
            switch error.code {
            case .notFound:
                Log.warn("the manifest's first object is not in the bucket (deleted since the manifest was made, or the manifest of another bucket?)",
                         ["object": name])
            case .unreachable where o.offline == .auto, .retryLimitExceeded where o.offline == .auto:
                Log.warn("\(error.message): mounting from the manifest while the bucket is unreachable (offline=auto); uncached reads fail with EIO until it answers")
                return .success((m, error))
            default:
                return .failure(StorefsMain.Problem(
                    message: error.explainedForAccess(bucket: o.source.bucket, prefix: o.source.prefix, endpoint: o.resolvedEndpoint).message))
            }
        }
        return .success((m, nil))
    }
}
