import Glibc

/// One manifest file as a sequence of records (rows), gzip or not: read in 1 MiB pieces, so
/// memory stays the same whatever the file's size. A record is a line, except that in CSV a
/// line ending inside a quoted field does not end it. Records longer than
/// `ManifestParser.maxRecordBytes` are an error, as is a gzip stream that is damaged or cut
/// short (a copy that did not finish).
final class ManifestInput {
    let path: String
    private let fd: Int32
    private var gzip: GzipDecoder?
    /// Compressed bytes read ahead of the decoder (gzip only).
    private var pending: UnsafeMutableRawBufferPointer
    private var pendingStart = 0
    private var pendingEnd = 0
    private var fileAtEnd = false
    /// Inside a gzip member (false between members and before the first).
    private var inMember = false
    private(set) var bytesRead: Int64 = 0

    static let pieceBytes = 1 << 20

    init(path: String) throws(ManifestError) {
        self.path = path
        fd = open(path, O_RDONLY | O_CLOEXEC | O_NOCTTY)
        guard fd >= 0 else { throw ManifestError("manifest \(Log.escaped(path)): \(String(cString: strerror(errno)))") }
        pending = .allocate(byteCount: Self.pieceBytes, alignment: 16)
        var magic = [UInt8](repeating: 0, count: 2)
        let n = magic.withUnsafeMutableBytes { pread(fd, $0.baseAddress, 2, 0) }
        if n == 2 && magic == [0x1F, 0x8B] {
            guard let decoder = GzipDecoder() else {
                close(fd)
                pending.deallocate()
                throw ManifestError("manifest \(Log.escaped(path)): out of memory for a gzip decoder")
            }
            gzip = decoder
        }
    }

    deinit {
        close(fd)
        pending.deallocate()
    }

    private func readFile(into buffer: UnsafeMutableRawBufferPointer) throws(ManifestError) -> Int {
        while true {
            let n = read(fd, buffer.baseAddress, buffer.count)
            if n >= 0 {
                bytesRead += Int64(n)
                return n
            }
            if errno == EINTR { continue }
            throw ManifestError("manifest \(Log.escaped(path)): read failed: \(String(cString: strerror(errno)))")
        }
    }

    /// Up to `buffer.count` bytes of the (decompressed) text; 0 at its end.
    func fill(_ buffer: UnsafeMutableRawBufferPointer) throws(ManifestError) -> Int {
        guard let gzip else { return try readFile(into: buffer) }
        while true {
            if pendingStart == pendingEnd && !fileAtEnd {
                pendingStart = 0
                pendingEnd = try readFile(into: pending)
                fileAtEnd = pendingEnd == 0
            }
            if pendingStart == pendingEnd && fileAtEnd {
                if inMember {
                    throw ManifestError("manifest \(Log.escaped(path)): the gzip stream ends in the middle (the file is cut short: copy it again)")
                }
                return 0
            }
            if !inMember {
                guard gzip.reset() else { throw ManifestError("manifest \(Log.escaped(path)): gzip reset failed") }
                inMember = true
            }
            let input = UnsafeRawBufferPointer(rebasing: pending[pendingStart..<pendingEnd])
            let step: GzipDecoder.Step
            do throws(GzipError) {
                step = try gzip.decode(input, into: buffer)
            } catch {
                throw ManifestError("manifest \(Log.escaped(path)): the gzip data is damaged (\(error.reason)) near byte \(bytesRead - Int64(pendingEnd - pendingStart))")
            }
            switch step {
            case .progress(let consumed, let produced):
                pendingStart += consumed
                if produced > 0 { return produced }
                if consumed == 0 && pendingStart < pendingEnd {
                    throw ManifestError("manifest \(Log.escaped(path)): the gzip decoder makes no progress")
                }
            case .memberEnd(let consumed, let produced):
                pendingStart += consumed
                inMember = false
                if produced > 0 { return produced }
            }
        }
    }

    /// Calls `body` with each record (without its line ending) and the line it starts on.
    /// `isCSV` is asked once, with the first byte of the text (after a UTF-8 byte order mark):
    /// whether quotes can hold line endings. `progress` gets the file bytes read so far.
    func records(isCSV: (UInt8) -> Bool, progress: ((Int64) -> Void)?,
                 _ body: (UnsafeRawBufferPointer, Int) throws(ManifestError) -> Void) throws(ManifestError) {
        let capacity = Self.pieceBytes
        let buffer = UnsafeMutableRawBufferPointer.allocate(byteCount: capacity, alignment: 16)
        defer { buffer.deallocate() }
        var start = 0, end = 0
        /// Where the search for the record's end goes on, and the quotes before it.
        var scan = 0, quotes = 0
        /// Line of the record at `start`; line endings inside its quotes.
        var line = 1, inner = 0
        var csv: Bool? = nil
        var atEnd = false
        var firstFill = true
        let maxRecord = ManifestParser.maxRecordBytes
        let newline = Int32(UInt8(ascii: "\n")), quote = Int32(UInt8(ascii: "\""))
        while true {
            let base = buffer.baseAddress!
            if let isCSV = csv, scan < end, let hit = memchr(base + scan, newline, end - scan) {
                let p = base.distance(to: UnsafeMutableRawPointer(hit))
                if isCSV {
                    var q = scan
                    while q < p, let h = memchr(base + q, quote, p - q) {
                        quotes += 1
                        q = base.distance(to: UnsafeMutableRawPointer(h)) + 1
                    }
                    if quotes % 2 == 1 {
                        // A line ending inside quotes: part of the field.
                        inner += 1
                        scan = p + 1
                        continue
                    }
                }
                var stop = p
                if stop > start && buffer[stop - 1] == UInt8(ascii: "\r") { stop -= 1 }
                if stop - start > maxRecord { throw tooLong(line) }
                try body(UnsafeRawBufferPointer(rebasing: buffer[start..<stop]), line)
                line += 1 + inner
                inner = 0
                quotes = 0
                start = p + 1
                scan = start
                continue
            }
            if let isCSV = csv, isCSV {
                var q = scan
                while q < end, let h = memchr(base + q, quote, end - q) {
                    quotes += 1
                    q = base.distance(to: UnsafeMutableRawPointer(h)) + 1
                }
            }
            scan = end
            if end - start > maxRecord { throw tooLong(line) }
            if atEnd {
                if start < end {
                    if quotes % 2 == 1 {
                        throw ManifestError(file: path, line: line, "a quoted field is never closed (the file ends inside it: cut short?)")
                    }
                    var stop = end
                    if buffer[stop - 1] == UInt8(ascii: "\r") { stop -= 1 }
                    try body(UnsafeRawBufferPointer(rebasing: buffer[start..<stop]), line)
                }
                return
            }
            // Move the unfinished record to the front and read more behind it.
            if start > 0 {
                let carried = end - start
                if carried > 0 { memmove(base, base + start, carried) }
                scan -= start
                end = carried
                start = 0
            }
            let n = try fill(UnsafeMutableRawBufferPointer(rebasing: buffer[end..<capacity]))
            if n == 0 {
                atEnd = true
            } else {
                if firstFill && n >= 3 && buffer[0] == 0xEF && buffer[1] == 0xBB && buffer[2] == 0xBF {
                    // A UTF-8 byte order mark (spreadsheet exports) is not part of the text.
                    start = 3
                    scan = 3
                }
                firstFill = false
                end += n
                if csv == nil && end > start { csv = isCSV(buffer[start]) }
            }
            progress?(bytesRead)
        }
    }

    private func tooLong(_ line: Int) -> ManifestError {
        ManifestError(file: path, line: line,
                      "longer than \(ManifestParser.maxRecordBytes) bytes: not a manifest row (object names are at most 1024 bytes)")
    }
}
