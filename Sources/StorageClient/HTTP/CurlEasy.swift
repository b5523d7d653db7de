internal import CChecksum
internal import CCurl
import Foundation

/// Owns one libcurl easy handle. A handle keeps its connection alive between requests, so
/// `HTTPClient` pools these rather than creating one per request.
final class CurlEasy {
    let handle: UnsafeMutableRawPointer
    /// The client's share (TLS sessions, DNS), kept alive while this handle uses it.
    private let share: ShareBox

    init(share: ShareBox) {
        CurlGlobal.ensureInitialised()
        guard let h = curl_easy_init() else { fatalError("curl_easy_init failed: out of memory") }
        handle = h
        self.share = share
        _ = ccurl_setopt_share(h, share.handle)
    }

    deinit { curl_easy_cleanup(handle) }
}

/// `curl_global_init` must run once, before any other thread uses libcurl; OpenSSL is
/// initialised first, without its exit-time clean-up (ccurl.h says why).
public enum CurlGlobal {
    private static let initialised: Bool = {
        _ = ccurl_openssl_init_without_atexit()
        curl_global_init(ccurl_global_default())
        return true
    }()

    /// Call before anything else uses OpenSSL (the trust store, signing keys): the process's
    /// first step.
    public static func ensureInitialised() { _ = initialised }
}

/// Per-request state that libcurl's C callbacks reach through their userdata pointer.
/// It lives on the performing thread's stack frame for the duration of `curl_easy_perform`.
final class CurlTransfer {
    enum Sink {
        /// Keep the body (JSON answers), refusing more than `limit` bytes.
        case collect(limit: Int)
        /// Copy the bytes of `[start, start + buffer.count)` into `buffer`, whether the server
        /// answers 206 for that range or 200 with the whole object.
        case window(buffer: RangeBuffer, start: Int64)
    }

    let sink: Sink
    let isCancelled: (@Sendable () -> Bool)?
    /// The easy handle performing this transfer (for `CURLINFO_RESPONSE_CODE` in callbacks).
    var handle: UnsafeMutableRawPointer?
    var status = 0
    var headers: [String: String] = [:]
    var body: [UInt8] = []
    /// Set once the first body byte arrives and the status has been examined.
    private var bodyMode: BodyMode = .undecided
    private var skip: Int64 = 0
    /// For a whole-object answer (200) that says its CRC32C (`x-goog-hash: crc32c=…`): the
    /// expected value and the CRC of every body byte so far (docs/integrity.md, level 2).
    var expectedCRC: UInt32?
    var bodyCRC: UInt32 = 0
    var filled = 0
    /// The window was full and the transfer was stopped on purpose (a 200 answer to a range).
    var stoppedEarly = false
    var failure: StorageError?
    /// libcurl's words for a failure (CURLOPT_ERRORBUFFER): OpenSSL's reason for a TLS one.
    let errorBuffer = UnsafeMutablePointer<CChar>.allocate(capacity: Int(CURL_ERROR_SIZE))

    private enum BodyMode { case undecided, collect, window, error }

    /// `isCancelled` is asked at most this often: curl calls back for every chunk it receives
    /// and between them, and the adapter's check takes libfuse's session lock and
    /// `FuseContext.session`, locks every transfer and FUSE thread shares (docs/experiments.md,
    /// "2026-12-07, night"). A cancelled request then stops within this much more time.
    static let cancelCheckInterval = 0.01
    private var cancelSeen = false
    private var nextCancelCheck = 0.0

    /// Whether the request was cancelled: `isCancelled` asked at once the first time, then at
    /// most every `cancelCheckInterval`; once true, true for good. Called on the transfer's
    /// own thread only (curl's callbacks).
    func cancelledNow() -> Bool {
        guard let isCancelled else { return false }
        if cancelSeen { return true }
        let now = monotonicNow()
        guard now >= nextCancelCheck else { return false }
        nextCancelCheck = now + Self.cancelCheckInterval
        cancelSeen = isCancelled()
        return cancelSeen
    }

    init(sink: Sink, isCancelled: (@Sendable () -> Bool)?) {
        self.sink = sink
        self.isCancelled = isCancelled
        errorBuffer.initialize(to: 0)
    }

    deinit { errorBuffer.deallocate() }

    /// The error buffer's text, bounded and with control characters dropped (it may quote a
    /// server's certificate subject).
    var errorDetail: String {
        let bytes = UnsafeBufferPointer(start: errorBuffer, count: Int(CURL_ERROR_SIZE))
            .prefix { $0 != 0 }.map { UInt8(bitPattern: $0) }.filter { $0 >= 0x20 && $0 != 0x7f }
        var text = String(decoding: bytes, as: UTF8.self)
        while text.hasSuffix(" ") || text.hasSuffix(".") { text.removeLast() }
        return text
    }

    func header(line: UnsafeBufferPointer<UInt8>) {
        if line.starts(with: "HTTP/".utf8) {
            headers.removeAll(keepingCapacity: true)
            return
        }
        guard let colon = line.firstIndex(of: UInt8(ascii: ":")) else { return }
        // Byte-level: Foundation's lowercased()/trimmingCharacters cost ~30 µs per answer here.
        let name = String(unsafeUninitializedCapacity: colon) { out in
            for i in 0..<colon {
                let c = line[i]
                out[i] = (c >= UInt8(ascii: "A") && c <= UInt8(ascii: "Z")) ? c | 0x20 : c
            }
            return colon
        }
        var from = colon + 1
        var to = line.count
        func isSpace(_ c: UInt8) -> Bool { c == 0x20 || c == 0x09 || c == 0x0d || c == 0x0a }
        while from < to, isSpace(line[from]) { from += 1 }
        while to > from, isSpace(line[to - 1]) { to -= 1 }
        let value = String(decoding: UnsafeBufferPointer(rebasing: line[from..<to]), as: UTF8.self)
        if let old = headers[name] { headers[name] = old + "," + value } else { headers[name] = value }
    }

    /// Returns how many bytes were consumed; anything less than `data.count` aborts the transfer.
    func body(_ data: UnsafeRawBufferPointer, status: Int) -> Int {
        if cancelledNow() {
            failure = StorageError(.cancelled, "transfer cancelled")
            return 0
        }
        if bodyMode == .undecided { decide(status: status) }
        switch bodyMode {
        case .undecided:
            return 0
        case .collect, .error:
            let limit: Int
            if case .collect(let l) = sink, bodyMode == .collect { limit = l } else { limit = 64 * 1024 }
            if body.count + data.count > limit {
                if bodyMode == .error {
                    // Error bodies are only informative: keep their start, stop the transfer
                    // (an endless 500 body must not hold the reader).
                    body.append(contentsOf: data.prefix(limit - body.count))
                    stoppedEarly = true
                    return 0
                }
                failure = StorageError(.invalidResponse, "response body larger than \(limit) bytes")
                return 0
            }
            body.append(contentsOf: data)
            return data.count
        case .window:
            guard case .window(let buffer, _) = sink else { return 0 }
            if expectedCRC != nil { bodyCRC = cchecksum_crc32c(bodyCRC, data.baseAddress, data.count) }
            var chunk = data
            if skip > 0 {
                let drop = Int(min(skip, Int64(chunk.count)))
                skip -= Int64(drop)
                chunk = UnsafeRawBufferPointer(rebasing: chunk[drop...])
            }
            let room = buffer.count - filled
            let n = min(room, chunk.count)
            if n > 0 {
                buffer.bytes.baseAddress!.advanced(by: filled).copyMemory(from: chunk.baseAddress!, byteCount: n)
                filled += n
            }
            if n < chunk.count {
                if status == 200 {
                    stoppedEarly = true  // the whole object came back; we have our slice
                } else {
                    failure = StorageError(.retryLimitExceeded, "server sent more bytes than the requested range")
                }
                return 0
            }
            return data.count
        }
    }

    private func decide(status: Int) {
        self.status = status
        guard (200..<300).contains(status) else {
            bodyMode = .error
            return
        }
        switch sink {
        case .collect:
            bodyMode = .collect
        case .window(let buffer, let start):
            if status == 206 {
                guard let range = headers["content-range"].flatMap(ContentRange.init(header:)),
                      range.first == start, range.last - range.first < Int64(buffer.count)
                else {
                    // A transfer fault (a proxy or server mixing answers up): tried again.
                    failure = StorageError(.retryLimitExceeded,
                                           "206 answer whose Content-Range '\(headers["content-range"] ?? "")' does not match the requested range starting at \(start)")
                    bodyMode = .error
                    return
                }
                skip = 0
            } else {
                skip = start  // 200: the whole body; slice our window out of it
                expectedCRC = headers["x-goog-hash"].flatMap(Self.crc32c(fromGoogHash:))
            }
            bodyMode = .window
        }
    }
}

extension CurlTransfer {
    /// The `crc32c=` of an `x-goog-hash` header (`crc32c=BASE64,md5=BASE64`): 4 big-endian bytes.
    static func crc32c(fromGoogHash header: String) -> UInt32? {
        for part in header.split(separator: ",") {
            let item = part.trimmingCharacters(in: .whitespaces)
            guard item.hasPrefix("crc32c="), let data = Data(base64Encoded: String(item.dropFirst(7))), data.count == 4 else { continue }
            return data.reduce(UInt32(0)) { $0 << 8 | UInt32($1) }
        }
        return nil
    }

    /// The answer stopped where the object ends: a 206 whose Content-Range ends at its total,
    /// every byte of it received, or a 200 (the whole object) read to its end.
    var reachedObjectEnd: Bool {
        guard case .window(_, let start) = sink else { return false }
        if status == 206 {
            guard let r = headers["content-range"].flatMap(ContentRange.init(header:)), let total = r.total else { return false }
            return r.first == start && r.last + 1 == total && Int64(filled) == r.last - r.first + 1
        }
        return status == 200 && !stoppedEarly
    }

    /// A whole-object answer read to its end whose bytes do not match its own crc32c: a
    /// transfer fault (retried), never data. nil when it matches or cannot be checked.
    var wholeBodyMismatch: StorageError? {
        guard let expectedCRC, !stoppedEarly, bodyCRC != expectedCRC else { return nil }
        return StorageError(.retryLimitExceeded, "the answer's bytes do not match its x-goog-hash crc32c")
    }
}

/// `Content-Range: bytes first-last/total` (total may be `*`).
struct ContentRange: Equatable {
    var first: Int64
    var last: Int64
    var total: Int64?

    init(first: Int64, last: Int64, total: Int64?) {
        self.first = first
        self.last = last
        self.total = total
    }

    init?(header: String) {
        var t = Substring(header)
        while t.first == " " || t.first == "\t" { t = t.dropFirst() }
        while t.last == " " || t.last == "\t" { t = t.dropLast() }
        guard t.prefix(6).lowercased() == "bytes " else { return nil }
        let spec = t.dropFirst(6)
        let parts = spec.split(separator: "/", maxSplits: 1)
        guard parts.count == 2 else { return nil }
        let range = parts[0].split(separator: "-", maxSplits: 1)
        guard range.count == 2, let f = Int64(range[0]), let l = Int64(range[1]), f <= l else { return nil }
        first = f
        last = l
        total = parts[1] == "*" ? nil : Int64(parts[1])
        if total == nil && parts[1] != "*" { return nil }
    }
}

// C callbacks: capture nothing, find the transfer through userdata.
let curlWriteCallback: ccurl_data_cb = { ptr, size, nmemb, userdata in
    let transfer = Unmanaged<CurlTransfer>.fromOpaque(userdata!).takeUnretainedValue()
    let count = size * nmemb
    var status = transfer.status
    if status == 0, let h = transfer.handle {
        var code: Int = 0
        _ = ccurl_getinfo_long(h, CURLINFO_RESPONSE_CODE, &code)
        status = code
    }
    let used = transfer.body(UnsafeRawBufferPointer(start: ptr, count: count), status: status)
    return used
}

let curlProgressCallback: ccurl_xferinfo_cb = { userdata, _, _, _, _ in
    let transfer = Unmanaged<CurlTransfer>.fromOpaque(userdata!).takeUnretainedValue()
    if transfer.cancelledNow() {
        transfer.failure = StorageError(.cancelled, "transfer cancelled")
        return 1
    }
    return 0
}

let curlHeaderCallback: ccurl_data_cb = { ptr, size, nmemb, userdata in
    let transfer = Unmanaged<CurlTransfer>.fromOpaque(userdata!).takeUnretainedValue()
    let count = size * nmemb
    ptr!.withMemoryRebound(to: UInt8.self, capacity: count) {
        transfer.header(line: UnsafeBufferPointer(start: $0, count: count))
    }
    return count
}
