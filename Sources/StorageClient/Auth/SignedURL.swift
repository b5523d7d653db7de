import Foundation

/// V4 signed URLs (GOOG4-RSA-SHA256) for `storage.googleapis.com`, docs/protocol.md §5.8: what
/// `user.storefs.download_url` holds for a token-less object when a service-account key is at hand.
public struct URLSigner: Sendable {
    public static let host = "storage.googleapis.com"
    public static let maxExpiry = 604_800

    let key: GoogleCredentials.ServiceAccountKey
    public let expiry: Int

    public init(key: GoogleCredentials.ServiceAccountKey, expiry: Int) {
        self.key = key
        self.expiry = min(max(1, expiry), Self.maxExpiry)
    }

    /// A GET URL for `bucket/name`, valid `expiry` seconds from `now` (seconds since the epoch).
    public func sign(bucket: String, name: String, now: Int64) throws(StorageError) -> String {
        var t = time_t(now)
        var tmv = tm()
        gmtime_r(&t, &tmv)
        func two(_ v: Int32) -> String { v < 10 ? "0\(v)" : "\(v)" }
        let datestamp = "\(tmv.tm_year + 1900)\(two(tmv.tm_mon + 1))\(two(tmv.tm_mday))"
        let timestamp = "\(datestamp)T\(two(tmv.tm_hour))\(two(tmv.tm_min))\(two(tmv.tm_sec))Z"
        let scope = "\(datestamp)/auto/storage/goog4_request"
        let path = "/\(ObjectName.encode(bucket))/\(ObjectName.encode(name, keepingSlash: true))"
        let query = [
            ("X-Goog-Algorithm", "GOOG4-RSA-SHA256"),
            ("X-Goog-Credential", "\(key.clientEmail)/\(scope)"),
            ("X-Goog-Date", timestamp),
            ("X-Goog-Expires", String(expiry)),
            ("X-Goog-SignedHeaders", "host"),
        ].map { (ObjectName.encode($0.0), ObjectName.encode($0.1)) }.sorted { $0 < $1 }
            .map { "\($0.0)=\($0.1)" }.joined(separator: "&")
        let canonicalRequest = ["GET", path, query, "host:\(Self.host)\n", "host", "UNSIGNED-PAYLOAD"].joined(separator: "\n")
        let stringToSign = ["GOOG4-RSA-SHA256", timestamp, scope, Crypto.hex(Crypto.sha256(Array(canonicalRequest.utf8)))]
            .joined(separator: "\n")
        let signature = try Crypto.rs256Sign(pem: key.privateKey, Array(stringToSign.utf8))
        return "https://\(Self.host)\(path)?\(query)&X-Goog-Signature=\(Crypto.hex(signature))"
    }
}
