import Foundation

/// What both protocols share: credentials on every request (one forced refresh after a 401),
/// retries with backoff, status → `StorageError`, and JSON bodies.
struct AuthorizedHTTP: Sendable {
    /// The API origin without a trailing `/`.
    let endpoint: String
    let http: HTTPClient
    let credentials: Credentials
    let retry: RetryPolicy
    /// How fast the server has answered (its first bytes), storage requests only.
    let fastest = FastestAnswer()
    /// Answers that say the server serves requests: what lets a failing request retry on
    /// while others succeed (`RetryPolicy.run`).
    let answers = AnswerCount()

    init(endpoint: String, http: HTTPClient, credentials: Credentials, retry: RetryPolicy) throws(StorageError) {
        var e = endpoint
        while e.hasSuffix("/") { e.removeLast() }
        self.endpoint = e
        self.http = http
        self.credentials = credentials
        self.retry = retry
        guard URLOrigin(e) != nil else {
            throw StorageError(.invalidArgument, "endpoint \(HTTPClient.origin(of: e)) is not an http:// or https:// URL")
        }
        if credentials.sendsSecrets, let why = URLOrigin.refusalToSendSecrets(to: e) {
            throw StorageError(.invalidArgument, why)
        }
    }

    private func authorization(rejected: String?) throws(StorageError) -> (value: String?, headers: [String]) {
        guard let auth = try credentials.authorization(rejected: rejected) else { return (nil, []) }
        return (auth, ["Authorization: \(auth)"])
    }

    /// One authorised exchange (no retries), refreshing the credentials once after a 401.
    func exchange(_ what: String, _ send: ([String]) throws(StorageError) -> HTTPResponse) throws(StorageError) -> HTTPResponse {
        let first = try authorization(rejected: nil)
        var response = try send(first.headers)
        if response.status == 401 && credentials.sendsSecrets, let used = first.value {
            let renewed = try authorization(rejected: used)
            if renewed.value != used { response = try send(renewed.headers) }
        }
        // Any answer took the server's distance, a 404 as much as the bytes.
        fastest.note(response.firstByte)
        if StorageError.servesRequests(response.status) { answers.note() }
        guard (200..<300).contains(response.status) else {
            var error = StorageError.fromStatus(response.status, what: "\(what): \(Self.errorMessage(response))")
            error.retryAfter = response.headers["retry-after"].flatMap { Double($0.trimmingCharacters(in: .whitespaces)) }
                .flatMap { $0 >= 0 && $0.isFinite ? $0 : nil }
            error.notAnAPIAnswer = !Self.isAPIError(response)
            throw error
        }
        return response
    }

    /// The largest JSON answer taken: a listing page of 1,000 items with metadata is ~1–2 MB;
    /// parsing costs tens of times the text in memory, so a hostile 60 MB page is refused.
    static let jsonLimit = 8 << 20

    /// GET a JSON object, with retries, within the policy's time budget.
    func getJSON(_ url: String, what: String, policy: RetryPolicy? = nil,
                 isCancelled: (@Sendable () -> Bool)? = nil) throws(StorageError) -> [String: Any] {
        try Self.jsonObject(try getJSONBytes(url, what: what, policy: policy, isCancelled: isCancelled))
    }

    /// The options of one try of a request: its number, the caller's cancellation, and a
    /// connection set aside for the operation (taken by its first try; later ones find it used).
    private func options(_ t: RetryPolicy.Try, _ isCancelled: (@Sendable () -> Bool)?, _ connection: ConnectionClaim?) -> RequestOptions {
        RequestOptions(attempt: t.number, isCancelled: isCancelled, connection: connection)
    }

    /// The body of a JSON answer, unparsed (listing pages are read by `ListPageParser`).
    func getJSONBytes(_ url: String, what: String, policy: RetryPolicy? = nil,
                      isCancelled: (@Sendable () -> Bool)? = nil, connection: ConnectionClaim? = nil) throws(StorageError) -> [UInt8] {
        try (policy ?? retry).run(isCancelled: isCancelled, answered: answers) { t throws(StorageError) -> HTTPResponse in
            try exchange(what) { h throws(StorageError) in
                try http.get(url, headers: h, limit: Self.jsonLimit, deadline: t.deadline,
                             options: options(t, isCancelled, connection))
            }
        }.body
    }

    /// Ranged GET into `buffer`, with retries, within the time budget.
    func getRange(_ url: String, what: String, start: Int64, into buffer: RangeBuffer, untilEnd: Bool = false,
                  isCancelled: (@Sendable () -> Bool)?, connection: ConnectionClaim? = nil) throws(StorageError) -> HTTPResponse {
        try retry.run(isCancelled: isCancelled, answered: answers) { t throws(StorageError) -> HTTPResponse in
            try exchange(what) { h throws(StorageError) in
                try http.getRange(url, headers: h, start: start, into: buffer, untilEnd: untilEnd, deadline: t.deadline,
                                  options: options(t, isCancelled, connection))
            }
        }
    }

    static func jsonObject(_ body: [UInt8]) throws(StorageError) -> [String: Any] {
        guard let obj = (try? JSONSerialization.jsonObject(with: Data(body))) as? [String: Any] else {
            throw StorageError(.invalidResponse, "the server's answer is not a JSON object")
        }
        return obj
    }

    /// Whether an error body is a storage API's: a JSON object with an `error` member.
    static func isAPIError(_ response: HTTPResponse) -> Bool {
        (try? JSONSerialization.jsonObject(with: Data(response.body)) as? [String: Any])?["error"] != nil
    }

    /// The human part of an error body (JSON `error.message`, or the first line of text).
    static func errorMessage(_ response: HTTPResponse) -> String {
        if let obj = try? JSONSerialization.jsonObject(with: Data(response.body)) as? [String: Any],
           let err = obj["error"] as? [String: Any], let msg = err["message"] as? String {
            return msg
        }
        let text = String(decoding: response.body.prefix(200), as: UTF8.self)
        return text.split(separator: "\n").first.map(String.init) ?? "HTTP \(response.status)"
    }

    /// Start-up errors, reworded for the person at the prompt.
    static func explainAccessError(_ error: StorageError, bucket: String, prefix: String, endpoint: String) -> StorageError {
        switch error.code {
        case .notFound where error.notAnAPIAnswer:
            return StorageError(.notFound,
                                "\(endpoint) answered HTTP 404 with something that is not a storage API error: is endpoint= the origin of a GCS JSON API or Firebase Storage server?",
                                httpStatus: error.httpStatus)
        case .notFound:
            return StorageError(.notFound, "bucket '\(bucket)' does not exist at \(endpoint)", httpStatus: error.httpStatus)
        case .unauthenticated, .unauthorized:
            if error.httpStatus == nil { return error }  // the token service said no: its message says why
            return StorageError(error.code,
                                "the credentials may not read gs://\(bucket)/\(prefix) (HTTP \(error.httpStatus ?? 0)): check token_file=, credentials=, api_key= or the bucket's rules/IAM",
                                httpStatus: error.httpStatus)
        case .unreachable:
            return StorageError(.unreachable, "\(error.message): check endpoint= (or the emulator host variable) and the network")
        default:
            return error
        }
    }
}

extension StorageError {
    /// This error of a start-up check of gs://`bucket`/`prefix` said the way `checkAccess`
    /// says it (a wrong bucket, endpoint or credential, by name).
    public func explainedForAccess(bucket: String, prefix: String, endpoint: String) -> StorageError {
        AuthorizedHTTP.explainAccessError(self, bucket: bucket, prefix: prefix, endpoint: endpoint)
    }
}
