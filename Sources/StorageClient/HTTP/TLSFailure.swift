/// What a failed TLS set-up means to the person at the prompt (docs/security.md, "TLS").
///
/// libcurl gives one code for every certificate problem; OpenSSL's verify result says which.
/// These failures are final (never retried: a wrong certificate stays wrong, and a request
/// retried past it would still not be sent) and never taken as an outage. A handshake cut by
/// a reset or an early end of the stream is a transfer fault instead, retried like a reset.
enum TLSFailure {
    /// What went wrong, from libcurl's code and OpenSSL's verify result.
    enum Kind: Equatable {
        /// CURLE_PEER_FAILED_VERIFICATION with `X509_V_*` `verifyResult` (libcurl's own host
        /// name check, after a chain OpenSSL accepted, leaves 1, `!X509_V_OK`).
        case verification(verifyResult: Int)
        /// CURLE_SSL_CONNECT_ERROR, CURLE_SSL_CIPHER: no TLS session came about.
        case handshake
        /// The CA store or a client certificate could not be used (CURLE_SSL_CACERT_BADFILE,
        /// CURLE_SSL_CERTPROBLEM, CURLE_SSL_ISSUER_ERROR).
        case localSetUp
    }

    // OpenSSL's X509_V_ERR_* values (openssl/x509_vfy.h), stable across 1.1 and 3.x.
    static let curlHostCheck = 1, unableToGetIssuer = 2, notYetValid = 9, expired = 10, selfSignedLeaf = 18, selfSignedInChain = 19,
               unableToGetIssuerLocally = 20, unableToVerifyLeaf = 21, untrusted = 27, hostMismatch = 62, ipMismatch = 64

    /// The error for a failed TLS set-up with `origin` (`https://host:port`), or nil when the
    /// failure is a transfer fault (a reset or an early end during the handshake).
    /// `detail` is libcurl's error buffer (OpenSSL's words), shown in parentheses.
    static func error(_ kind: Kind, detail: String, origin: String) -> StorageError? {
        let host = URLOrigin(origin)?.host ?? origin
        let because = detail.isEmpty ? "" : " (\(detail))"
        switch kind {
        case .verification(let result):
            switch result {
            case unableToGetIssuer, unableToGetIssuerLocally, unableToVerifyLeaf, selfSignedLeaf, selfSignedInChain, untrusted:
                return StorageError(.tlsFailure,
                                    "the TLS certificate of \(origin) is not signed by a CA storefs trusts\(because): give the CA's PEM file with -o ca_file=FILE, or add it to the system store (update-ca-certificates)")
            case expired:
                return StorageError(.tlsFailure, "the TLS certificate of \(origin) has expired\(because): the server must renew it (or check this machine's clock)")
            case notYetValid:
                return StorageError(.tlsFailure, "the TLS certificate of \(origin) is not valid yet\(because): check this machine's clock")
            case 0, curlHostCheck, hostMismatch, ipMismatch:
                return StorageError(.tlsFailure,
                                    "the TLS certificate of \(origin) does not name \(host)\(because): use a host name the certificate carries in endpoint=, or give the server a certificate for \(host)")
            default:
                return StorageError(.tlsFailure, "the TLS certificate of \(origin) was refused\(because)")
            }
        case .handshake:
            let lower = detail.lowercased()
            if ["reset", "unexpected eof", "broken pipe", "timed out", "connection refused"].contains(where: { lower.contains($0) }) {
                return nil
            }
            return StorageError(.tlsFailure,
                                "the TLS handshake with \(origin) failed\(because): is it an https server (http:// for a plain one), and does it speak TLS 1.2 or 1.3?")
        case .localSetUp:
            return StorageError(.tlsFailure, "the TLS set-up for \(origin) failed\(because): check ca_file=")
        }
    }
}
