import Foundation
import Glibc
import StorageClient

/// What one manifest row says about an object, besides its name: what `stat` and a read need.
struct ManifestRecord: Equatable {
    var size: Int64
    var generation: Int64
    /// What `stat` shows: `mtime` where the row has one (storefs's own manifests, for objects
    /// with custom mtime metadata), else `updated`, else `timeCreated`, else 0.
    var modified: Timestamp
    var crc32c: UInt32?
}

/// Reads manifests (docs/manifest.md, "Formats"), trusting nothing in them: every row is
/// checked, and the first bad one is a one-line error naming its file and line, never a row
/// left out. Rows are handed to a sink one at a time, their name borrowed for the call only:
/// nothing here grows with the manifest.
///
/// - CSV (RFC 4180: quoted fields, `""` inside quotes, CRLF or LF), first row a header naming
///   the columns. `name`, `size` and `generation` are required; `updated`, `timeCreated`,
///   `crc32c`, `mtime`, `bucket` and `timeDeleted` are read when present; any other column is
///   ignored. This is the layout of Storage Insights inventory reports and of
///   `storefs manifest`.
/// - JSON Lines: one object per line with the same keys (values as strings or numbers, as
///   in object resources); other keys are ignored.
///
/// Either may be gzipped (detected from the bytes). A row whose `timeDeleted` is set (a
/// deleted or noncurrent version in an inventory) is skipped and counted.
struct ManifestParser {
    /// Rows naming another bucket are an error (nil: not checked).
    let bucket: String?

    /// The longest row accepted: object names are at most 1,024 bytes, so a longer row is
    /// not a manifest row (and reading it whole would let a file hold any amount of memory).
    static let maxRecordBytes = 64 << 10
    static let maxNameBytes = 1024

    struct Stats: Equatable {
        /// Data rows read (skipped ones included).
        var rows = 0
        /// Rows skipped because their `timeDeleted` is set.
        var deleted = 0
    }

    typealias Sink = (UnsafeRawBufferPointer, ManifestRecord) throws(ManifestError) -> Void

    /// Reads every file of `source` in order; checks a report's row count.
    func read(_ source: ManifestSource, progress: ((Int64) -> Void)? = nil, _ sink: Sink) throws(ManifestError) -> Stats {
        var total = Stats()
        var bytesBefore: Int64 = 0
        for file in source.files {
            let s = try read(path: file.path, progress: progress.map { p in { p(bytesBefore + $0) } }, sink)
            total.rows += s.rows
            total.deleted += s.deleted
            bytesBefore += file.size
        }
        if let expected = source.expectedRows, expected != total.rows {
            let m = Log.escaped(source.reportManifest?.path ?? "")
            throw ManifestError("report manifest \(m) says the report holds \(expected) rows, but its shards hold \(total.rows): a shard is missing rows (copied while being written, or cut short)")
        }
        return total
    }

    /// Reads one file (CSV or JSON Lines, maybe gzipped). `progress` gets the file bytes read.
    func read(path: String, progress: ((Int64) -> Void)? = nil, _ sink: Sink) throws(ManifestError) -> Stats {
        let input = try ManifestInput(path: path)
        var stats = Stats()
        var format: Format? = nil
        var csv: CSVLayout? = nil
        var sawBytes = false
        var fields: [CSVField] = []
        try input.records(isCSV: { first in
            sawBytes = true
            let isJSON = first == UInt8(ascii: "{")
            format = isJSON ? .jsonLines : .csv
            return !isJSON
        }, progress: progress) { (record, line) throws(ManifestError) in
            switch format {
            case .jsonLines?:
                if Self.isBlank(record) { return }
                stats.rows += 1
                try jsonRow(record, path: path, line: line, stats: &stats, sink)
            default:
                guard let layout = csv else {
                    csv = try CSVLayout(header: record, path: path, line: line)
                    return
                }
                if record.isEmpty { return }
                stats.rows += 1
                try csvRow(record, layout, path: path, line: line, fields: &fields, stats: &stats, sink)
            }
        }
        if !sawBytes { throw ManifestError("manifest \(Log.escaped(path)) is empty (not even a header row): the copy may have failed") }
        if format == .csv && csv == nil { throw ManifestError("manifest \(Log.escaped(path)) has no header row") }
        return stats
    }

    enum Format { case csv, jsonLines }

    static func isBlank(_ b: UnsafeRawBufferPointer) -> Bool {
        b.allSatisfy { $0 == 0x20 || $0 == 0x09 || $0 == 0x0D }
    }

    // MARK: CSV

    /// Which column holds what (indexes into a row's fields).
    struct CSVLayout {
        var count: Int
        var name: Int
        var size: Int
        var generation: Int
        var updated: Int?
        var created: Int?
        var crc32c: Int?
        var mtime: Int?
        var bucket: Int?
        var deleted: Int?

        init(header: UnsafeRawBufferPointer, path: String, line: Int) throws(ManifestError) {
            var fields: [CSVField] = []
            guard CSVField.split(header, into: &fields) else {
                throw ManifestError(file: path, line: line, "the header row is not valid CSV (a quote out of place)")
            }
            var columns: [String: Int] = [:]
            var order: [String] = []
            for (i, f) in fields.enumerated() {
                let text = try f.withValue(in: header) { String(decoding: $0, as: UTF8.self) }.trimmingCharacters(in: .whitespaces)
                if columns[text] != nil {
                    throw ManifestError(file: path, line: line, "the header names column \(Log.escaped(text)) twice")
                }
                columns[text] = i
                order.append(text)
            }
            func required(_ name: String) throws(ManifestError) -> Int {
                guard let i = columns[name] else {
                    let shown = order.prefix(20).map(Log.escaped).joined(separator: ",")
                    throw ManifestError(file: path, line: line,
                                        "the header has no \(name) column (it has: \(shown)); a manifest needs name, size and generation (an inventory report configuration must include them)")
                }
                return i
            }
            count = fields.count
            name = try required("name")
            size = try required("size")
            generation = try required("generation")
            updated = columns["updated"]
            created = columns["timeCreated"]
            crc32c = columns["crc32c"]
            mtime = columns["mtime"]
            bucket = columns["bucket"]
            deleted = columns["timeDeleted"]
        }
    }

    private func csvRow(_ row: UnsafeRawBufferPointer, _ layout: CSVLayout, path: String, line: Int, fields: inout [CSVField],
                        stats: inout Stats, _ sink: Sink) throws(ManifestError) {
        fields.removeAll(keepingCapacity: true)
        guard CSVField.split(row, into: &fields) else {
            throw ManifestError(file: path, line: line, "not valid CSV (a quote out of place, or a quoted field that goes on after its closing quote)")
        }
        guard fields.count == layout.count else {
            throw ManifestError(file: path, line: line, "\(fields.count) fields, but the header has \(layout.count) columns")
        }
        // Fields other than the name are read as they lie: a value with a doubled quote in it
        // is no number, time or checksum anyway, and fails as written.
        let f = fields
        func raw(_ i: Int?) -> UnsafeRawBufferPointer? {
            guard let i else { return nil }
            let v = UnsafeRawBufferPointer(rebasing: row[f[i].start..<f[i].end])
            return v.isEmpty ? nil : v
        }
        if raw(layout.deleted) != nil {
            stats.deleted += 1
            return
        }
        if let b = raw(layout.bucket) { try checkBucket(b, path: path, line: line) }
        let record = try ManifestRecord(path: path, line: line) { column in
            switch column {
            case .size: return raw(layout.size)
            case .generation: return raw(layout.generation)
            case .updated: return raw(layout.updated)
            case .created: return raw(layout.created)
            case .mtime: return raw(layout.mtime)
            case .crc32c: return raw(layout.crc32c)
            }
        }
        try f[layout.name].withValue(in: row) { name throws(ManifestError) in
            try Self.checkName(name, path: path, line: line)
            try sink(name, record)
        }
    }

    private func checkBucket(_ b: UnsafeRawBufferPointer, path: String, line: Int) throws(ManifestError) {
        guard let bucket, !b.elementsEqual(bucket.utf8) else { return }
        throw ManifestError(file: path, line: line,
                            "an object of bucket \(Log.escaped(String(decoding: b, as: UTF8.self))), but the mount is of bucket \(Log.escaped(bucket)): use that bucket's manifest")
    }

    static func checkName(_ name: UnsafeRawBufferPointer, path: String, line: Int) throws(ManifestError) {
        guard !name.isEmpty else { throw ManifestError(file: path, line: line, "the name is empty") }
        guard name.count <= maxNameBytes else {
            throw ManifestError(file: path, line: line, "the name is \(name.count) bytes long; object names are at most \(maxNameBytes)")
        }
        guard UTF8Check.isValid(name) else {
            throw ManifestError(file: path, line: line, "the name is not valid UTF-8 (object names are Unicode text)")
        }
    }

    // MARK: JSON Lines

    private func jsonRow(_ row: UnsafeRawBufferPointer, path: String, line: Int, stats: inout Stats,
                         _ sink: Sink) throws(ManifestError) {
        var scanner = JSONScanner(Array(row), what: "manifest \(Log.escaped(path)) line \(line)", subject: "the line")
        var name: String? = nil
        // The values read, one after another in `text`, and where each lies.
        var text: [UInt8] = []
        var ranges: [ManifestRecord.Column: Range<Int>] = [:]
        var bucketName: String? = nil
        var deleted = false
        do throws(StorageError) {
            try scanner.object { (s, key) throws(StorageError) in
                func keep(_ column: ManifestRecord.Column) throws(StorageError) {
                    let v: String?
                    switch try s.scalar() {
                    case .string(let t): v = t
                    case .number(let t): v = t
                    case .null: v = nil
                    case .bool(let b): v = b ? "true" : "false"
                    }
                    guard let v, !v.isEmpty else { return }
                    ranges[column] = text.count..<(text.count + v.utf8.count)
                    text += v.utf8
                }
                switch key {
                case "name": name = try s.optionalString()
                case "size": try keep(.size)
                case "generation": try keep(.generation)
                case "updated": try keep(.updated)
                case "timeCreated": try keep(.created)
                case "mtime": try keep(.mtime)
                case "crc32c": try keep(.crc32c)
                case "bucket": bucketName = try s.optionalString()
                case "timeDeleted": deleted = try s.optionalString().map { !$0.isEmpty } ?? false
                default: try s.skip()
                }
            }
            try scanner.finish()
        } catch {
            throw ManifestError(error.message)
        }
        if deleted {
            stats.deleted += 1
            return
        }
        if var b = bucketName, !b.isEmpty {
            try b.withUTF8Bytes { u throws(ManifestError) in try checkBucket(u, path: path, line: line) }
        }
        let record = try text.withBytes { t throws(ManifestError) in
            try ManifestRecord(path: path, line: line) { column in ranges[column].map { UnsafeRawBufferPointer(rebasing: t[$0]) } }
        }
        guard var name else { throw ManifestError(file: path, line: line, "no \"name\"") }
        try name.withUTF8Bytes { b throws(ManifestError) in
            try Self.checkName(b, path: path, line: line)
            try sink(b, record)
        }
    }
}

extension ManifestRecord {
    enum Column: Hashable { case size, generation, updated, created, mtime, crc32c }

    /// A row's values (`value(column)`: its text, nil when absent or empty), checked.
    init(path: String, line: Int, _ value: (Column) -> UnsafeRawBufferPointer?) throws(ManifestError) {
        func fail(_ why: String) -> ManifestError { ManifestError(file: path, line: line, why) }
        guard let sizeText = value(.size) else { throw fail("no size") }
        guard let s = Self.integer(sizeText), s <= ObjectMetadata.maxSize else {
            throw fail("size \(Self.shown(sizeText)) is not a whole number of bytes")
        }
        guard let generationText = value(.generation) else {
            throw fail("no generation (reads need it: they fetch exactly that generation)")
        }
        guard let g = Self.integer(generationText), g > 0 else {
            throw fail("generation \(Self.shown(generationText)) is not a positive whole number")
        }
        func time(_ column: Column, _ what: String) throws(ManifestError) -> Timestamp? {
            guard let text = value(column) else { return nil }
            guard let t = Self.timestamp(text) else { throw fail("\(what) \(Self.shown(text)) is not an RFC 3339 time") }
            return t
        }
        // Each present time is checked, whichever is shown.
        let mtime = try time(.mtime, "mtime"), updated = try time(.updated, "updated"), created = try time(.created, "timeCreated")
        var crc: UInt32? = nil
        if let text = value(.crc32c) {
            guard let v = Self.crc32c(base64: text) else { throw fail("crc32c \(Self.shown(text)) is not the base64 of 4 bytes") }
            crc = v
        }
        self.init(size: s, generation: g, modified: mtime ?? updated ?? created ?? Timestamp(seconds: 0), crc32c: crc)
    }

    static func shown(_ text: UnsafeRawBufferPointer) -> String {
        Log.escaped(String(decoding: text.prefix(40), as: UTF8.self)) + (text.count > 40 ? "…" : "")
    }

    /// Decimal digits only (no sign, no spaces), at most 18 of them.
    static func integer(_ text: UnsafeRawBufferPointer) -> Int64? {
        guard !text.isEmpty, text.count <= 18 else { return nil }
        var v: Int64 = 0
        for c in text {
            guard c >= 0x30 && c <= 0x39 else { return nil }
            v = v * 10 + Int64(c - 0x30)
        }
        return v
    }

    /// RFC 3339 (`T` or a space between date and time), or the same with ` UTC` for the zone.
    static func timestamp(_ text: UnsafeRawBufferPointer) -> Timestamp? {
        if let t = Timestamp.parseRFC3339(bytes: text) { return t }
        let utc = " UTC".utf8
        guard text.count > utc.count, text.suffix(utc.count).elementsEqual(utc) else { return nil }
        return (Array(text.dropLast(utc.count)) + [UInt8(ascii: "Z")]).withUnsafeBytes { Timestamp.parseRFC3339(bytes: $0) }
    }

    /// `crc32c` as the APIs give it: base64 of the 4 big-endian bytes (`AAAAAA==`).
    static func crc32c(base64 text: UnsafeRawBufferPointer) -> UInt32? {
        guard text.count == 8, text[6] == UInt8(ascii: "="), text[7] == UInt8(ascii: "=") else { return nil }
        var bits: UInt64 = 0
        for c in text[0..<6] {
            let d: UInt8
            switch c {
            case UInt8(ascii: "A")...UInt8(ascii: "Z"): d = c - UInt8(ascii: "A")
            case UInt8(ascii: "a")...UInt8(ascii: "z"): d = c - UInt8(ascii: "a") + 26
            case UInt8(ascii: "0")...UInt8(ascii: "9"): d = c - UInt8(ascii: "0") + 52
            case UInt8(ascii: "+"): d = 62
            case UInt8(ascii: "/"): d = 63
            default: return nil
            }
            bits = bits << 6 | UInt64(d)
        }
        // 36 bits for 32: the last 4 must be zero (canonical base64).
        guard bits & 0xF == 0 else { return nil }
        return UInt32(truncatingIfNeeded: bits >> 4)
    }
}

/// One CSV field of a row: where its text lies, and whether it holds `""` to collapse.
struct CSVField {
    var start: Int
    var end: Int
    var escaped: Bool

    /// Calls `body` with the field's text: a view into `row`, or (for an escaped field) a
    /// copy with each `""` made one `"`.
    func withValue<R>(in row: UnsafeRawBufferPointer, _ body: (UnsafeRawBufferPointer) throws(ManifestError) -> R) throws(ManifestError) -> R {
        let raw = UnsafeRawBufferPointer(rebasing: row[start..<end])
        guard escaped else { return try body(raw) }
        var out: [UInt8] = []
        out.reserveCapacity(raw.count)
        var i = 0
        while i < raw.count {
            out.append(raw[i])
            i += raw[i] == UInt8(ascii: "\"") ? 2 : 1
        }
        return try out.withBytes { b throws(ManifestError) in try body(b) }
    }

    /// Splits a row (no line ending) into fields; false when its quoting is broken.
    static func split(_ row: UnsafeRawBufferPointer, into fields: inout [CSVField]) -> Bool {
        let quote = UInt8(ascii: "\""), comma = UInt8(ascii: ",")
        var i = 0
        let n = row.count
        while true {
            if i < n && row[i] == quote {
                // Quoted: up to the next quote not doubled, which must end the field.
                var j = i + 1
                var escaped = false
                while true {
                    guard j < n else { return false }
                    if row[j] == quote {
                        if j + 1 < n && row[j + 1] == quote {
                            escaped = true
                            j += 2
                            continue
                        }
                        break
                    }
                    j += 1
                }
                fields.append(CSVField(start: i + 1, end: j, escaped: escaped))
                i = j + 1
                if i == n { return true }
                guard row[i] == comma else { return false }
                i += 1
                if i == n {
                    fields.append(CSVField(start: n, end: n, escaped: false))
                    return true
                }
            } else {
                var j = i
                while j < n && row[j] != comma { j += 1 }
                fields.append(CSVField(start: i, end: j, escaped: false))
                if j == n { return true }
                i = j + 1
                if i == n {
                    fields.append(CSVField(start: n, end: n, escaped: false))
                    return true
                }
            }
        }
    }
}

/// Strict UTF-8 (RFC 3629): no overlong forms, no surrogates, nothing past U+10FFFF.
enum UTF8Check {
    static func isValid(_ b: UnsafeRawBufferPointer) -> Bool {
        var i = 0
        let n = b.count
        while i < n {
            let c = b[i]
            if c < 0x80 {
                i += 1
                continue
            }
            let need: Int
            var lo: UInt8 = 0x80, hi: UInt8 = 0xBF
            switch c {
            case 0xC2...0xDF: need = 1
            case 0xE0: need = 2; lo = 0xA0
            case 0xE1...0xEC, 0xEE...0xEF: need = 2
            case 0xED: need = 2; hi = 0x9F
            case 0xF0: need = 3; lo = 0x90
            case 0xF1...0xF3: need = 3
            case 0xF4: need = 3; hi = 0x8F
            default: return false
            }
            guard i + need < n, b[i + 1] >= lo, b[i + 1] <= hi else { return false }
            var k = 2
            while k <= need {
                guard b[i + k] & 0xC0 == 0x80 else { return false }
                k += 1
            }
            i += need + 1
        }
        return true
    }
}
