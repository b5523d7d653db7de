import Foundation

/// The Google and Firebase token endpoints (docs/protocol.md §3.2, §5.7). `authEndpoint` replaces
/// the origin for emulators and tests: `{authEndpoint}/{production host}{path}`, the
/// Auth-emulator convention.
public struct TokenServices: Sendable {
    public var authEndpoint: String?
    let http: HTTPClient

    public init(authEndpoint: String?, http: HTTPClient) {
        var e = authEndpoint
        while e?.hasSuffix("/") == true { e?.removeLast() }
        self.authEndpoint = e
        self.http = http
    }

    func url(host: String, path: String) -> String {
        if let authEndpoint { return "\(authEndpoint)/\(host)\(path)" }
        return "https://\(host)\(path)"
    }

    var oauthTokenURL: String { url(host: "oauth2.googleapis.com", path: "/token") }

    /// Refuses to send a secret anywhere but https or loopback (URLOrigin's rule).
    func checkTransport(_ url: String) throws(StorageError) {
        if let why = URLOrigin.refusalToSendSecrets(to: url) { throw StorageError(.invalidArgument, why) }
    }

    /// POSTs a form or JSON body and returns the JSON answer; token-service errors become
    /// `unauthenticated` with the service's own reason (never the secret that was sent).
    func post(_ url: String, form: [(String, String)]? = nil, json: [String: Any]? = nil,
              what: String) throws(StorageError) -> [String: Any] {
        try checkTransport(url)
        let body: [UInt8]
        let contentType: String
        if let form {
            body = Array(ObjectName.query(form).utf8)
            contentType = "application/x-www-form-urlencoded"
        } else {
            body = Array((try? JSONSerialization.data(withJSONObject: json ?? [:])) ?? Data())
            contentType = "application/json"
        }
        let response = try RetryPolicy(attempts: 3, budget: 30).run { t throws(StorageError) -> HTTPResponse in
            let r = try http.post(url, headers: ["Content-Type: \(contentType)"], body: body, deadline: t.deadline, attempt: t.number)
            if r.status >= 500 || r.status == 429 || r.status == 408 {
                throw StorageError.fromStatus(r.status, what: "\(what): token service answered \(r.status)")
            }
            return r
        }
        let answer = (try? JSONSerialization.jsonObject(with: Data(response.body))) as? [String: Any]
        guard (200..<300).contains(response.status), let answer else {
            let reason = ((answer?["error"] as? [String: Any])?["message"] as? String)
                ?? (answer?["error_description"] as? String) ?? (answer?["error"] as? String) ?? "HTTP \(response.status)"
            // No httpStatus: this is the token service speaking, not the bucket.
            throw StorageError(.unauthenticated, "\(what) failed: \(reason)")
        }
        return answer
    }

    func get(_ url: String, headers: [String], what: String) throws(StorageError) -> [String: Any] {
        let response = try RetryPolicy(attempts: 3, budget: 30).run { t throws(StorageError) -> HTTPResponse in
            try http.get(url, headers: headers, limit: 1 << 20, deadline: t.deadline, options: RequestOptions(attempt: t.number))
        }
        guard (200..<300).contains(response.status),
              let answer = (try? JSONSerialization.jsonObject(with: Data(response.body))) as? [String: Any] else {
            throw StorageError(.unauthenticated, "\(what) failed: HTTP \(response.status)", httpStatus: response.status)
        }
        return answer
    }

    static func expiry(_ answer: [String: Any], key: String) -> Double {
        let seconds = (answer[key] as? String).flatMap(Double.init) ?? (answer[key] as? NSNumber)?.doubleValue ?? 3600
        return wallClock() + seconds
    }

    static func token(_ answer: [String: Any], key: String, what: String) throws(StorageError) -> String {
        guard let t = answer[key] as? String, !t.isEmpty else {
            throw StorageError(.unauthenticated, "\(what): the answer has no \(key)")
        }
        return t
    }
}
