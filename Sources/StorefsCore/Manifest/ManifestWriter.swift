import Foundation
import Glibc
import StorageClient

/// Writes a manifest (`storefs manifest`, docs/manifest.md): one row per object with what a
/// mount from it needs, in CSV (the columns of a Storage Insights inventory report, so one
/// reader serves both) or JSON Lines, optionally gzipped.
///
///     name,size,generation,updated,crc32c,mtime
///     {"name":"…","size":"…","generation":"…","updated":"…","crc32c":"…","mtime":"…"}
///
/// `mtime` is written only for objects whose shown time is not `updated` (custom `mtime` or
/// `goog-reserved-file-mtime` metadata), `crc32c` only where the listing gave one.
public final class ManifestWriter {
    public enum Format: String, Sendable {
        case csv
        case jsonl
    }

    private let fd: Int32
    private let format: Format
    private let gzip: GzipEncoder?
    private var buffer: [UInt8] = []
    public private(set) var objects = 0
    public private(set) var bytesWritten: Int64 = 0

    static let header = "name,size,generation,updated,crc32c,mtime\n"

    public init(fd: Int32, format: Format, gzip: Bool) throws(ManifestError) {
        self.fd = fd
        self.format = format
        if gzip {
            guard let encoder = GzipEncoder() else { throw ManifestError("out of memory for a gzip encoder") }
            self.gzip = encoder
        } else {
            self.gzip = nil
        }
        buffer.reserveCapacity(1 << 20)
        if format == .csv { buffer += Self.header.utf8 }
    }

    /// An object's `crc32c` as the manifest writes it, the JSON API's base64 of the 4
    /// big-endian bytes: as given, or from the decimal the Firebase emulator's v0 metadata
    /// gives (docs/protocol.md); nil for anything else (the row then has none).
    static func base64CRC32C(_ text: String) -> String? {
        if Checksum.crc32c(base64: text) != nil { return text }
        guard let v = UInt32(text) else { return nil }
        return Data([UInt8(v >> 24), UInt8(v >> 16 & 0xFF), UInt8(v >> 8 & 0xFF), UInt8(v & 0xFF)]).base64EncodedString()
    }

    /// One object's row.
    public func write(_ meta: ObjectMetadata) throws(ManifestError) {
        let updated = Self.rfc3339(meta.updated)
        let shown = meta.modificationTime
        let mtime = shown == meta.updated ? "" : Self.rfc3339(shown)
        let crc = meta.crc32c.flatMap(Self.base64CRC32C) ?? ""
        switch format {
        case .csv:
            buffer += Self.csvField(meta.name).utf8
            buffer += ",\(meta.size),\(meta.generation),\(updated),\(Self.csvField(crc)),\(mtime)\n".utf8
        case .jsonl:
            var line = "{\"name\":\(LogLine.jsonString(meta.name)),\"size\":\"\(meta.size)\",\"generation\":\"\(meta.generation)\""
            line += ",\"updated\":\"\(updated)\""
            if !crc.isEmpty { line += ",\"crc32c\":\(LogLine.jsonString(crc))" }
            if !mtime.isEmpty { line += ",\"mtime\":\"\(mtime)\"" }
            buffer += (line + "}\n").utf8
        }
        objects += 1
        if buffer.count >= 1 << 20 { try flush(finish: false) }
    }

    /// Writes what is buffered and ends the gzip stream.
    public func finish() throws(ManifestError) {
        try flush(finish: true)
    }

    private func flush(finish: Bool) throws(ManifestError) {
        let pending = buffer
        buffer.removeAll(keepingCapacity: true)
        if let gzip {
            try pending.withBytes { b throws(ManifestError) in
                try gzip.encode(b, finish: finish) { out throws(ManifestError) in try self.put(out) }
            }
        } else {
            try pending.withBytes { b throws(ManifestError) in try put(b) }
        }
    }

    private func put(_ bytes: UnsafeRawBufferPointer) throws(ManifestError) {
        var done = 0
        while done < bytes.count {
            let n = Glibc.write(fd, bytes.baseAddress! + done, bytes.count - done)
            if n < 0 && errno == EINTR { continue }
            guard n > 0 else { throw ManifestError("cannot write the manifest: \(String(cString: strerror(errno))) (what was written is incomplete)") }
            done += n
        }
        bytesWritten += Int64(bytes.count)
    }

    /// A CSV field: quoted when it holds a comma, a quote or a line ending.
    static func csvField(_ s: String) -> String {
        guard s.utf8.contains(where: { $0 == UInt8(ascii: ",") || $0 == UInt8(ascii: "\"") || $0 == 0x0A || $0 == 0x0D }) else {
            return s
        }
        return "\"" + s.replacingOccurrences(of: "\"", with: "\"\"") + "\""
    }

    /// `2024-05-06T07:08:09.123Z`: UTC, the fraction to the nanosecond without trailing zeros.
    static func rfc3339(_ t: Timestamp) -> String {
        var seconds = time_t(t.seconds)
        var tm = Glibc.tm()
        gmtime_r(&seconds, &tm)
        func pad(_ n: Int, _ width: Int) -> String {
            let s = String(n)
            return String(repeating: "0", count: max(0, width - s.count)) + s
        }
        var out = "\(pad(Int(tm.tm_year) + 1900, 4))-\(pad(Int(tm.tm_mon) + 1, 2))-\(pad(Int(tm.tm_mday), 2))T"
            + "\(pad(Int(tm.tm_hour), 2)):\(pad(Int(tm.tm_min), 2)):\(pad(Int(tm.tm_sec), 2))"
        if t.nanoseconds > 0 {
            var fraction = pad(Int(t.nanoseconds), 9)
            while fraction.hasSuffix("0") { fraction.removeLast() }
            out += "." + fraction
        }
        return out + "Z"
    }
}
