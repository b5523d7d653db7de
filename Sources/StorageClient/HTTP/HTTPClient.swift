internal import CCurl
import Foundation
import Synchronization
import Locking

/// A finished HTTP exchange. Header names are lower-cased; repeated headers are comma-joined.
public struct HTTPResponse: Sendable {
    public var status: Int
    public var headers: [String: String]
    /// The collected body (JSON answers, error bodies); empty for window reads.
    public var body: [UInt8]
    /// Bytes written into the caller's buffer by a window read.
    public var bytesRead: Int
    /// The HTTP version the exchange used: "1.1" or "2" ("1.0" from an old server).
    public var httpVersion: String = ""
    /// Seconds from the request's start to its first byte, the connection's set-up left out
    /// (`HTTPClient.firstByteDelay`): how far away the server is.
    public var firstByte: Double = 0
}

/// What one request carries besides its URL and headers: which try of its operation it is
/// (`RetryPolicy.Try`; logs and metrics show it), who may cancel it, and the connection set
/// aside for it (`ConnectionClaim`), if any.
public struct RequestOptions: Sendable {
    public var attempt: Int
    public var isCancelled: (@Sendable () -> Bool)?
    public var connection: ConnectionClaim?

    public init(attempt: Int = 1, isCancelled: (@Sendable () -> Bool)? = nil, connection: ConnectionClaim? = nil) {
        self.attempt = attempt
        self.isCancelled = isCancelled
        self.connection = connection
    }
}

/// Blocking HTTP over libcurl with connection reuse.
///
/// Each call runs `curl_easy_perform` on the calling thread, so callers must be threads we own
/// (FUSE workers, the fetch pool), never Swift's cooperative pool. Easy handles are pooled:
/// a handle keeps its TCP/TLS connection, so consecutive requests skip the handshake.
/// Automatic decompression is never enabled: gzip objects are read as their stored bytes.
public final class HTTPClient: Sendable {
    /// docs/security.md, "Time bounds". The whole-request deadline comes with each call.
    public struct Timeouts: Sendable {
        /// Seconds to set up a connection (TCP and TLS): `connect_timeout=`.
        public var connect: Double = 10
        /// Seconds a request may wait for the first byte of the answer, and a transfer may move
        /// less than `minimumSpeed` bytes per second, before it is abandoned: `response_timeout=`.
        public var response: Double = 10
        /// Below this many bytes per second for `response` seconds, a transfer has stalled
        /// (a 2 B/s trickle is a stall, not a download).
        public var minimumSpeed = 1024
        public init(connect: Double = 10, response: Double = 10) {
            self.connect = connect
            self.response = response
        }
    }

    private struct Handles: ~Copyable { var idle: [CurlEasyBox] = [] }
    private struct CurlEasyBox: @unchecked Sendable { let easy: CurlEasy }

    private let pool = OrderedMutex(.httpPool, Handles())
    /// Handles out of the pool, running a request.
    private let busy = Atomic<Int>(0)
    /// `scheme://authority` of each origin asked about, and whether it is this machine.
    private let loopbackOrigins = OrderedMutex(.httpLoopback, [(origin: [UInt8], isLoopback: Bool)]())
    private let timeouts: Timeouts
    private let userAgent: String
    private let httpVersion: HTTPVersion
    /// The certificates https is verified against: given at init, or the system store loaded
    /// at the first https request (`TrustStore`). Set once, then only read.
    private let trust: OrderedMutex<TrustStore?>
    /// TLS sessions and DNS answers shared by every handle, so a new connection resumes the
    /// TLS session of an earlier one (an abbreviated handshake) instead of a full one.
    private let share: ShareBox

    /// `trust` nil: the system store. `httpVersion` applies to https; plain http is HTTP/1.1.
    public init(timeouts: Timeouts = Timeouts(), userAgent: String, httpVersion: HTTPVersion = .http1_1,
                trust: TrustStore? = nil) {
        self.timeouts = timeouts
        self.userAgent = userAgent
        self.httpVersion = httpVersion
        self.trust = OrderedMutex(.httpTrust, trust)
        CurlGlobal.ensureInitialised()
        self.share = ShareBox()
    }

    /// The store for an https request, loading the system one the first time.
    private func trustStore() throws(StorageError) -> TrustStore {
        try trust.withLock { (held: inout TrustStore?) throws(StorageError) -> TrustStore in
            if let held { return held }
            let loaded = try TrustStore.system()
            held = loaded
            return loaded
        }
    }

    /// GET `url` and collect at most `limit` bytes of body. `deadline` (monotonic seconds)
    /// ends the request however far it got.
    public func get(_ url: String, headers: [String], limit: Int = 1 << 20, deadline: Double? = nil,
                    options: RequestOptions = RequestOptions()) throws(StorageError) -> HTTPResponse {
        try perform(url, headers: headers, sink: .collect(limit: limit), deadline: deadline, options: options)
    }

    /// GET `url` with `Range: bytes=start-(start+buffer.count-1)` and copy exactly those bytes into
    /// `buffer`. A 206 must carry a matching Content-Range; a 200 (whole object) is sliced.
    /// `untilEnd`: the object may end inside the range (its size is not known yet); an answer
    /// that stops where the object ends is whole (`bytesRead` says how much came).
    public func getRange(_ url: String, headers: [String], start: Int64, into buffer: UnsafeMutableRawBufferPointer,
                         untilEnd: Bool = false, deadline: Double? = nil,
                         options: RequestOptions = RequestOptions()) throws(StorageError) -> HTTPResponse {
        try getRange(url, headers: headers, start: start, into: RangeBuffer(buffer), untilEnd: untilEnd, deadline: deadline,
                     options: options)
    }

    /// `getRange` into a buffer that may be taken only when the first body byte arrives.
    public func getRange(_ url: String, headers: [String], start: Int64, into buffer: RangeBuffer,
                         untilEnd: Bool = false, deadline: Double? = nil,
                         options: RequestOptions = RequestOptions()) throws(StorageError) -> HTTPResponse {
        precondition(buffer.count > 0, "no Range request for zero bytes")
        let last = start + Int64(buffer.count) - 1
        return try perform(url, headers: headers + ["Range: bytes=\(start)-\(last)"],
                           sink: .window(buffer: buffer, start: start), deadline: deadline, options: options,
                           untilEnd: untilEnd)
    }

    /// POST a body (token endpoints); answers are collected like `get`.
    public func post(_ url: String, headers: [String], body: [UInt8], limit: Int = 1 << 20,
                     deadline: Double? = nil, attempt: Int = 1) throws(StorageError) -> HTTPResponse {
        try perform(url, headers: headers, sink: .collect(limit: limit), deadline: deadline,
                    options: RequestOptions(attempt: attempt), postBody: body)
    }

    /// Takes the warm connection (the handle most recently put back) for a request that must
    /// not wait for a new connection's set-up, before requests made after it can take it:
    /// nil when none is idle. The request it is given to (`RequestOptions.connection`) takes it.
    public func claimIdleConnection() -> ConnectionClaim? {
        guard let box = pool.withLock({ $0.idle.popLast() }) else { return nil }
        return ConnectionClaim(box.easy, client: self)
    }

    /// A new connection for the request it is given to, never an idle one: for opening a
    /// connection ahead of need, which then joins the pool.
    public func claimNewConnection() -> ConnectionClaim { ConnectionClaim(newEasy(), client: self) }

    /// Connections in the pool or in use (one set aside by a claim not yet used is not counted;
    /// a pooled one the server has closed since is: curl opens it again on use).
    public var connectionCount: Int { pool.withLock { $0.idle.count } + busy.load(ordering: .relaxed) }

    private func checkout(_ claim: ConnectionClaim?) -> CurlEasy {
        if let claimed = claim?.take() { return claimed }
        if let box = pool.withLock({ $0.idle.popLast() }) { return box.easy }
        return newEasy()
    }

    /// A handle of this client's: it shares TLS sessions and DNS answers with the others
    /// (curl_easy_reset keeps the share).
    private func newEasy() -> CurlEasy {
        CurlEasy(share: share)
    }

    fileprivate func checkin(_ easy: CurlEasy) {
        let box = CurlEasyBox(easy: easy)
        pool.withLock { $0.idle.append(box) }
    }

    /// One exchange, reported to `StorageTelemetry.onExchange` (logs and metrics) when set.
    private func perform(_ url: String, headers: [String], sink: CurlTransfer.Sink, deadline: Double?,
                         options: RequestOptions, postBody: [UInt8]? = nil,
                         untilEnd: Bool = false) throws(StorageError) -> HTTPResponse {
        guard let observe = StorageTelemetry.onExchange else {
            return try transfer(url, headers: headers, sink: sink, deadline: deadline, options: options, postBody: postBody,
                                untilEnd: untilEnd)
        }
        let started = monotonicNow()
        var ranged = false
        if case .window = sink { ranged = true }
        var record = HTTPExchangeRecord(method: postBody == nil ? "GET" : "POST",
                                        kind: RequestKind.of(url: url, isPost: postBody != nil, isRanged: ranged),
                                        url: url, status: 0, bytes: 0, seconds: 0,
                                        attempt: max(1, options.attempt), failure: nil)
        do {
            let response = try transfer(url, headers: headers, sink: sink, deadline: deadline, options: options, postBody: postBody,
                                        untilEnd: untilEnd)
            record.status = response.status
            record.bytes = ranged ? response.bytesRead : response.body.count
            record.httpVersion = response.httpVersion
            record.seconds = monotonicNow() - started
            observe(record)
            return response
        } catch {
            record.status = error.httpStatus ?? 0
            record.failure = error.message
            record.seconds = monotonicNow() - started
            observe(record)
            throw error
        }
    }

    private func transfer(_ url: String, headers: [String], sink: CurlTransfer.Sink, deadline: Double?,
                          options: RequestOptions, postBody: [UInt8]?, untilEnd: Bool) throws(StorageError) -> HTTPResponse {
        let isCancelled = options.isCancelled
        if let isCancelled, isCancelled() { throw StorageError(.cancelled, "transfer cancelled") }
        var timeLeftMS = 0
        if let deadline {
            let left = deadline - monotonicNow()
            guard left > 0.001 else {
                throw StorageError(.retryLimitExceeded, "no time left for a request to \(Self.origin(of: url)) (request_timeout)")
            }
            timeLeftMS = max(1, Int(left * 1000))
        }
        let isTLS = url.utf8.starts(with: "https:".utf8)
        let store = isTLS ? try trustStore() : nil
        let easy = checkout(options.connection)
        busy.add(1, ordering: .relaxed)
        defer { busy.subtract(1, ordering: .relaxed) }
        let h = easy.handle
        curl_easy_reset(h)  // keeps the live connection and DNS cache, forgets per-request options
        let transfer = CurlTransfer(sink: sink, isCancelled: isCancelled)
        transfer.handle = h
        var list: UnsafeMutablePointer<curl_slist>? = nil
        for header in headers + ["Accept-Encoding: gzip", "Expect:"] { list = curl_slist_append(list, header) }
        defer { curl_slist_free_all(list) }

        _ = ccurl_setopt_str(h, CURLOPT_URL, url)
        // Nothing but http(s), even if a URL from a server or a key file says otherwise.
        _ = ccurl_setopt_str(h, CURLOPT_PROTOCOLS_STR, "http,https")
        _ = ccurl_setopt_str(h, CURLOPT_REDIR_PROTOCOLS_STR, "http,https")
        // Requests to this machine carry tokens over plain http: no proxy variable may
        // reroute them elsewhere. Remote requests keep the environment's proxy (https is
        // end-to-end through it).
        if isLoopback(url) { _ = ccurl_setopt_str(h, CURLOPT_PROXY, "") }
        if let store {
            // Verification always on, against exactly this store (no option turns it off).
            _ = ccurl_setopt_trust(h, store.store)
            _ = ccurl_setopt_long(h, CURLOPT_HTTP_VERSION,
                                  Int(httpVersion == .http2 ? CURL_HTTP_VERSION_2TLS : CURL_HTTP_VERSION_1_1))
        } else {
            _ = ccurl_setopt_long(h, CURLOPT_HTTP_VERSION, Int(CURL_HTTP_VERSION_1_1))
        }
        _ = ccurl_setopt_ptr(h, CURLOPT_ERRORBUFFER, transfer.errorBuffer)
        _ = ccurl_setopt_long(h, CURLOPT_NOSIGNAL, 1)
        _ = ccurl_setopt_long(h, CURLOPT_TCP_KEEPALIVE, 1)
        _ = ccurl_setopt_long(h, CURLOPT_CONNECTTIMEOUT_MS, Int(timeouts.connect * 1000))
        // Waiting for the answer counts as "slow" too: a server that accepts and never answers
        // is abandoned after `response` seconds, like one that trickles.
        _ = ccurl_setopt_long(h, CURLOPT_LOW_SPEED_LIMIT, timeouts.minimumSpeed)
        _ = ccurl_setopt_long(h, CURLOPT_LOW_SPEED_TIME, max(1, Int(timeouts.response.rounded(.up))))
        if timeLeftMS > 0 { _ = ccurl_setopt_long(h, CURLOPT_TIMEOUT_MS, timeLeftMS) }
        if isCancelled != nil {
            // Called about once a second even while nothing arrives: an interrupted reader is
            // noticed while it waits for headers, not only when body bytes come.
            _ = ccurl_setopt_long(h, CURLOPT_NOPROGRESS, 0)
            _ = ccurl_setopt_xferinfofn(h, curlProgressCallback)
        }
        _ = ccurl_setopt_str(h, CURLOPT_USERAGENT, userAgent)
        _ = ccurl_setopt_slist(h, CURLOPT_HTTPHEADER, list)
        // A larger receive buffer than curl's 16 KiB for multi-MiB parts (fewer recv calls),
        // but not much larger: curl allocates it per transfer and frees it at the transfer's
        // end, so each part's buffer is fresh pages, faulted and zeroed on first use (a VM
        // exit each here). 512 KiB cost 14–17k page faults per GiB read through `wan`, 64 KiB
        // 3–4k, and 48 parts in flight held 24 MiB of them (docs/architecture.md, "Adaptive
        // transfers", curl's receive buffer). Small ranged reads and JSON answers keep the
        // default.
        if case .window(let buffer, _) = sink, buffer.count >= 1 << 20 {
            _ = ccurl_setopt_long(h, CURLOPT_BUFFERSIZE, 64 * 1024)
        }
        _ = ccurl_setopt_writefn(h, curlWriteCallback)
        _ = ccurl_setopt_headerfn(h, curlHeaderCallback)
        let opaque = Unmanaged.passUnretained(transfer).toOpaque()
        _ = ccurl_setopt_ptr(h, CURLOPT_WRITEDATA, opaque)
        _ = ccurl_setopt_ptr(h, CURLOPT_HEADERDATA, opaque)
        if isCancelled != nil { _ = ccurl_setopt_ptr(h, CURLOPT_XFERINFODATA, opaque) }

        let rc: CURLcode
        if let postBody {
            rc = postBody.withUnsafeBufferPointer { buf -> CURLcode in
                _ = ccurl_setopt_long(h, CURLOPT_POST, 1)
                _ = ccurl_setopt_long(h, CURLOPT_POSTFIELDSIZE, buf.count)
                _ = ccurl_setopt_ptr(h, CURLOPT_POSTFIELDS, UnsafeMutableRawPointer(mutating: buf.baseAddress))
                let rc = curl_easy_perform(h)
                _ = ccurl_setopt_ptr(h, CURLOPT_POSTFIELDS, nil)
                return rc
            }
        } else {
            rc = curl_easy_perform(h)
        }
        withExtendedLifetime(transfer) {}
        var status = 0
        _ = ccurl_getinfo_long(h, CURLINFO_RESPONSE_CODE, &status)
        var firstByte = 0.0, connected = 0.0, secured = 0.0
        _ = ccurl_getinfo_double(h, CURLINFO_STARTTRANSFER_TIME, &firstByte)
        _ = ccurl_getinfo_double(h, CURLINFO_CONNECT_TIME, &connected)
        _ = ccurl_getinfo_double(h, CURLINFO_APPCONNECT_TIME, &secured)
        let firstByteDelay = Self.firstByteDelay(firstByte: firstByte, setUp: max(connected, secured))

        if rc == CURLE_OK || (rc == CURLE_WRITE_ERROR && transfer.stoppedEarly) {
            checkin(easy)
            if let failure = transfer.failure, transfer.status == 0 || (200..<300).contains(status) {
                throw failure
            }
            if let mismatch = transfer.wholeBodyMismatch { throw mismatch }
            if case .window(let buffer, _) = sink, (200..<300).contains(status), transfer.filled < buffer.count,
               !(untilEnd && transfer.reachedObjectEnd) {
                // A cut-short answer is a transfer fault: tried again, like a reset.
                throw StorageError(.retryLimitExceeded,
                                   "short ranged answer: got \(transfer.filled) of \(buffer.count) bytes", httpStatus: status)
            }
            var version = 0
            _ = ccurl_getinfo_long(h, CURLINFO_HTTP_VERSION, &version)
            return HTTPResponse(status: status, headers: transfer.headers, body: transfer.body, bytesRead: transfer.filled,
                                httpVersion: Self.versionName(version), firstByte: firstByteDelay)
        }
        // A failed transfer may leave the connection in an unknown state: drop the handle.
        if let failure = transfer.failure { throw failure }
        let reason = String(cString: curl_easy_strerror(rc))
        let detail = transfer.errorDetail
        switch rc {
        case CURLE_PEER_FAILED_VERIFICATION:
            var result = 0
            _ = ccurl_getinfo_long(h, CURLINFO_SSL_VERIFYRESULT, &result)
            if let e = TLSFailure.error(.verification(verifyResult: result), detail: detail, origin: Self.origin(of: url)) { throw e }
        case CURLE_SSL_CONNECT_ERROR, CURLE_SSL_CIPHER:
            if let e = TLSFailure.error(.handshake, detail: detail, origin: Self.origin(of: url)) { throw e }
            throw StorageError(.retryLimitExceeded, "the TLS handshake with \(Self.origin(of: url)) was cut short: \(detail.isEmpty ? reason : detail)")
        case CURLE_SSL_CACERT_BADFILE, CURLE_SSL_CERTPROBLEM, CURLE_SSL_ISSUER_ERROR:
            if let e = TLSFailure.error(.localSetUp, detail: detail, origin: Self.origin(of: url)) { throw e }
        default:
            break
        }
        switch rc {
        case CURLE_COULDNT_RESOLVE_HOST, CURLE_COULDNT_CONNECT, CURLE_COULDNT_RESOLVE_PROXY:
            throw StorageError(.unreachable, "cannot reach \(Self.origin(of: url)): \(reason)")
        case CURLE_ABORTED_BY_CALLBACK:
            throw StorageError(.cancelled, "transfer cancelled")
        case CURLE_OPERATION_TIMEDOUT:
            throw StorageError(.retryLimitExceeded,
                               "no answer from \(Self.origin(of: url)) in time (connect_timeout, response_timeout or request_timeout): \(reason)")
        default:
            throw StorageError(.retryLimitExceeded, "transfer from \(Self.origin(of: url)) failed: \(reason)")
        }
    }

    /// Seconds from a request's start to its first byte, the connection's set-up (TCP, TLS;
    /// 0 on a reused connection) left out: a new connection is a one-off, the server's
    /// distance is paid by every request. Whatever else the calling thread waited for counts
    /// too, so a busy machine can make a server look farther, never nearer. (Counted from
    /// curl's PRETRANSFER mark, as it was, a wait of the thread after the request had gone out
    /// hid the server's distance: a part through the `wan` link, 30 ms away, measured 2.7 ms,
    /// and the read-ahead took the server for near mid-read; docs/architecture.md, "Adaptive
    /// transfers", Start.)
    static func firstByteDelay(firstByte: Double, setUp: Double) -> Double {
        max(0, firstByte - setUp)
    }

    /// CURLINFO_HTTP_VERSION's value as logs show it.
    static func versionName(_ version: Int) -> String {
        switch version {
        case Int(CURL_HTTP_VERSION_1_0): return "1.0"
        case Int(CURL_HTTP_VERSION_1_1): return "1.1"
        case Int(CURL_HTTP_VERSION_2_0): return "2"
        case Int(CURL_HTTP_VERSION_3): return "3"
        default: return ""
        }
    }

    /// Whether `url` names this machine. Called for every request, so the answer is kept per
    /// `scheme://authority` (a mount talks to one or two origins), found by comparing bytes:
    /// no search through String's generic algorithms, no new String, no hashing.
    func isLoopback(_ url: String) -> Bool {
        var url = url
        let known = url.withUTF8 { bytes -> Bool? in
            guard let end = Self.originEnd(bytes) else { return false }
            return loopbackOrigins.withLock { origins in
                origins.first { $0.origin.count == end && $0.origin.elementsEqual(bytes[0..<end]) }?.isLoopback
            }
        }
        if let known { return known }
        let answer = URLOrigin(url)?.isLoopback == true
        url.withUTF8 { bytes in
            guard let end = Self.originEnd(bytes) else { return }
            loopbackOrigins.withLock { if $0.count < 64 { $0.append((Array(bytes[0..<end]), answer)) } }
        }
        return answer
    }

    /// Where `scheme://authority` ends in a URL's bytes (at its path or query); nil without "://".
    private static func originEnd(_ bytes: UnsafeBufferPointer<UInt8>) -> Int? {
        var i = 0
        while i + 2 < bytes.count, !(bytes[i] == UInt8(ascii: ":") && bytes[i + 1] == UInt8(ascii: "/") && bytes[i + 2] == UInt8(ascii: "/")) {
            i += 1
        }
        guard i + 2 < bytes.count else { return nil }
        var end = i + 3
        while end < bytes.count, bytes[end] != UInt8(ascii: "/"), bytes[end] != UInt8(ascii: "?") { end += 1 }
        return end
    }

    /// `scheme://host:port` of a URL, for error messages that must not carry query strings.
    /// A user name or password in the URL is left out too.
    static func origin(of url: String) -> String {
        guard let r = url.range(of: "://") else { return String(url.prefix { $0 != "?" && $0 != "#" }) }
        let rest = url[r.upperBound...]
        let end = rest.firstIndex(where: { $0 == "/" || $0 == "?" || $0 == "#" }) ?? rest.endIndex
        var authority = rest[..<end]
        if let at = authority.lastIndex(of: "@") { authority = authority[authority.index(after: at)...] }
        return String(url[..<r.upperBound]) + authority
    }
}

/// The curl share handle of one client (TLS sessions, DNS); it lives as long as the process's
/// clients do, and is never cleaned up while a handle may still use it.
/// The curl share handle of one client (TLS sessions, DNS). Each handle that uses it holds it
/// (`CurlEasy.share`), so it is cleaned up only after the last of them.
final class ShareBox: @unchecked Sendable {
    let handle: UnsafeMutableRawPointer?

    init() { handle = ccurl_share_new() }

    deinit { if let handle { curl_share_cleanup(handle) } }
}

/// A warm connection set aside for one piece of work (`HTTPClient.claimIdleConnection`): the
/// first request it is given to (`RequestOptions.connection`) takes it, on whatever thread. A
/// lookup's directory page takes the connection the previous request freed this way, while the
/// lookup's own probes, sent after it, open new ones (docs/architecture.md, "Lookups in one
/// round trip"). A claim nobody used goes back to the pool when it is let go.
public final class ConnectionClaim: @unchecked Sendable {
    private let lock = OrderedLock(.connectionClaim)
    private var easy: CurlEasy?
    private let client: HTTPClient

    fileprivate init(_ easy: CurlEasy, client: HTTPClient) {
        self.easy = easy
        self.client = client
    }

    deinit { if let easy { client.checkin(easy) } }

    fileprivate func take() -> CurlEasy? {
        lock.lock()
        defer { lock.unlock() }
        let e = easy
        easy = nil
        return e
    }

}
