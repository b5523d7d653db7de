/// Everything that can go wrong talking to a bucket, as one value type.
///
/// The `code` is what callers branch on (StorefsCore turns it into an errno in exactly one
/// place); `message` is for people and never contains a token, a key or a signed URL.
public struct StorageError: Error, Sendable, CustomStringConvertible {
    public enum Code: Sendable, Equatable {
        /// 404 on an object or bucket.
        case notFound
        /// 401: the credentials were refused (after a refresh, where one is possible).
        case unauthenticated
        /// 403: rules or IAM deny the request.
        case unauthorized
        /// 402 / 429 still failing after retries.
        case quotaExceeded
        /// 412, or the object's generation is no longer the one pinned at open.
        case generationChanged
        /// 5xx, 408, resets and timeouts still failing after retries.
        case retryLimitExceeded
        /// The endpoint could not be reached at all (DNS, refused connection).
        case unreachable
        /// No trusted TLS session came about: the certificate is not trusted, names another
        /// host or is out of date, or the handshake failed (`TLSFailure`). Never retried.
        case tlsFailure
        /// A checksum of received or cached bytes did not match.
        case checksumMismatch
        /// The caller gave up (the reading process was interrupted).
        case cancelled
        /// The server answered something this client cannot use (bad JSON, bad Content-Range).
        case invalidResponse
        /// Bad input from our side (a malformed source, option or name).
        case invalidArgument
    }

    public let code: Code
    public let message: String
    /// HTTP status when the error came from a response.
    public let httpStatus: Int?
    /// Seconds the server asked us to wait before trying again (`Retry-After`), if it said.
    public var retryAfter: Double?
    /// The error body was not a storage API's JSON error (`{"error": {...}}`): what answered
    /// may not be a storage API at all (a web server at the wrong endpoint).
    public var notAnAPIAnswer = false
    /// The store answered other requests while this operation was failing (`RetryPolicy`):
    /// the request failed, the bucket is not down (no outage is assumed from it).
    public var answeredOthers = false
    public let file: String
    public let line: Int

    public init(_ code: Code, _ message: String, httpStatus: Int? = nil, retryAfter: Double? = nil,
                file: String = #fileID, line: Int = #line) {
        self.code = code
        self.message = message
        self.httpStatus = httpStatus
        self.retryAfter = retryAfter
        self.file = file
        self.line = line
    }

    public var description: String {
        if let httpStatus { return "\(message) (HTTP \(httpStatus))" }
        return message
    }

    /// Classifies an HTTP status the way the errno table (README, "Errors") expects.
    public static func fromStatus(_ status: Int, what: String, file: String = #fileID, line: Int = #line) -> StorageError {
        let code: Code
        switch status {
        case 404: code = .notFound
        case 401: code = .unauthenticated
        case 403: code = .unauthorized
        case 402, 429: code = .quotaExceeded
        case 412: code = .generationChanged
        case 400, 405, 411, 413, 414, 416: code = .invalidResponse
        default: code = .retryLimitExceeded
        }
        return StorageError(code, what, httpStatus: status, file: file, line: line)
    }

    /// Whether an answer with this status says the server serves requests: a success, or an
    /// error `fromStatus` makes final (not a 408, 429 or 5xx, which are retried).
    static func servesRequests(_ status: Int) -> Bool {
        if (200..<300).contains(status) { return true }
        let code = fromStatus(status, what: "").code
        return code != .retryLimitExceeded && code != .quotaExceeded
    }
}
