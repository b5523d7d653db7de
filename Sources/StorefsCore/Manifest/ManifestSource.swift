import Foundation
import Glibc

/// A manifest problem, as the one line the user sees: which file, which line, what is wrong
/// and, where it helps, what to do (docs/manifest.md).
public struct ManifestError: Error, Sendable, CustomStringConvertible {
    public let message: String

    init(_ message: String) { self.message = message }

    /// `manifest FILE line N: WHY`.
    init(file: String, line: Int, _ why: String) {
        message = "manifest \(Log.escaped(file)) line \(line): \(why)"
    }

    public var description: String { message }
}

/// What `manifest=PATH` names, resolved to the data files to read (docs/manifest.md, "Mounting from one"):
///
/// - a data file: CSV with a header row, or JSON Lines, either optionally gzipped;
/// - a Storage Insights report manifest (`…_manifest.json`, the file an inventory report
///   writes beside its shards): its `report_shards_file_names`, each from the manifest's own
///   directory, all required, and together holding exactly `records_processed` rows;
/// - a directory: every data file in it (`*.csv`, `*.jsonl`, `*.ndjson`, each optionally
///   `.gz`), in byte order of their names.
public struct ManifestSource: Sendable, Equatable {
    public struct File: Sendable, Equatable {
        public let path: String
        let device: UInt64
        let inode: UInt64
        let size: Int64
        let mtimeSeconds: Int64
        let mtimeNanos: Int64
    }

    /// The data files, in the order they are read.
    public let files: [File]
    /// The report manifest the files come from, if any (part of the identity).
    public let reportManifest: File?
    /// Rows the report manifest says its shards hold (`records_processed`).
    public let expectedRows: Int?

    static let dataSuffixes = [".csv", ".csv.gz", ".jsonl", ".jsonl.gz", ".ndjson", ".ndjson.gz"]
    /// A report manifest is small; anything bigger is not one.
    static let maxReportManifestBytes = 16 << 20

    /// Resolves `path` (made absolute by the caller). Throws a one-line reason.
    public init(path: String) throws(ManifestError) {
        var st = stat()
        guard stat(path, &st) == 0 else {
            throw ManifestError("manifest \(Log.escaped(path)): \(String(cString: strerror(errno)))")
        }
        if st.st_mode & S_IFMT == S_IFDIR {
            files = try Self.dataFiles(in: path)
            reportManifest = nil
            expectedRows = nil
            return
        }
        let file = try Self.describe(path)
        if path.hasSuffix(".json"), let report = try Self.reportManifest(file) {
            reportManifest = file
            files = report.shards
            expectedRows = report.rows
            return
        }
        files = [file]
        reportManifest = nil
        expectedRows = nil
    }

    /// The bytes that identify this manifest's contents without reading them: every file's
    /// path, device, inode, size and modification time (a changed manifest has a new identity,
    /// so its index is built again).
    public var identity: [UInt8] {
        var out: [UInt8] = []
        for f in (reportManifest.map { [$0] } ?? []) + files {
            out += Array(f.path.utf8) + [0]
            for v in [f.device, f.inode, UInt64(bitPattern: f.size), UInt64(bitPattern: f.mtimeSeconds), UInt64(bitPattern: f.mtimeNanos)] {
                withUnsafeBytes(of: v.littleEndian) { out += $0 }
            }
        }
        return out
    }

    /// Total bytes of the data files (for progress).
    public var totalBytes: Int64 { files.reduce(0) { $0 + $1.size } }

    static func describe(_ path: String) throws(ManifestError) -> File {
        var st = stat()
        guard stat(path, &st) == 0 else {
            throw ManifestError("manifest \(Log.escaped(path)): \(String(cString: strerror(errno)))")
        }
        guard st.st_mode & S_IFMT == S_IFREG else {
            throw ManifestError("manifest \(Log.escaped(path)) is not a regular file: give a manifest file, a report's _manifest.json, or a directory of shards")
        }
        return File(path: path, device: UInt64(st.st_dev), inode: UInt64(st.st_ino), size: Int64(st.st_size),
                    mtimeSeconds: Int64(st.st_mtim.tv_sec), mtimeNanos: Int64(st.st_mtim.tv_nsec))
    }

    private static func dataFiles(in dir: String) throws(ManifestError) -> [File] {
        let names: [String]
        do {
            names = try FileManager.default.contentsOfDirectory(atPath: dir)
        } catch {
            throw ManifestError("manifest directory \(Log.escaped(dir)) cannot be read: \(error.localizedDescription)")
        }
        let data = names.filter { n in dataSuffixes.contains { n.hasSuffix($0) } && !n.hasPrefix(".") }
            .sorted { ByteName($0) < ByteName($1) }
        guard !data.isEmpty else {
            throw ManifestError("manifest directory \(Log.escaped(dir)) holds no manifest files (*.csv, *.jsonl or *.ndjson, optionally .gz)")
        }
        var out: [File] = []
        for n in data { out.append(try describe(dir + "/" + n)) }
        return out
    }

    /// The shards and row count of a Storage Insights report manifest; nil when the JSON file
    /// is not one (then it is read as JSON Lines).
    private static func reportManifest(_ file: File) throws(ManifestError) -> (shards: [File], rows: Int?)? {
        guard file.size <= maxReportManifestBytes, let data = FileManager.default.contents(atPath: file.path),
              let object = try? JSONSerialization.jsonObject(with: data) as? [String: Any],
              let listed = object["report_shards_file_names"] else { return nil }
        let shown = Log.escaped(file.path)
        guard let names = listed as? [String] else {
            throw ManifestError("report manifest \(shown): report_shards_file_names is not a list of file names")
        }
        if let count = (object["shard_count"] as? NSNumber)?.intValue, count != names.count {
            throw ManifestError("report manifest \(shown) lists \(names.count) shards but says shard_count \(count): the report is incomplete")
        }
        guard !names.isEmpty else { throw ManifestError("report manifest \(shown) lists no shards") }
        let dir = (file.path as NSString).deletingLastPathComponent
        var shards: [File] = []
        for name in names {
            // Shards are named by their object name in the destination bucket; they are read
            // from beside the manifest, by their last component only.
            let base = String(name.split(separator: "/", omittingEmptySubsequences: true).last ?? "")
            guard !base.isEmpty, base != ".", base != ".." else {
                throw ManifestError("report manifest \(shown) lists a shard with no file name (\(Log.escaped(name)))")
            }
            let path = dir + "/" + base
            guard access(path, F_OK) == 0 else {
                throw ManifestError("report manifest \(shown) lists shard \(Log.escaped(base)), which is not in \(Log.escaped(dir)): copy every shard of the report beside its manifest")
            }
            shards.append(try describe(path))
        }
        let rows = (object["records_processed"] as? NSNumber)?.intValue
        return (shards, rows)
    }
}
