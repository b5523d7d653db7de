import Foundation
import Synchronization
import Locking

/// Supplies the `Authorization` header for requests. Implementations never log what they return.
public protocol Credentials: Sendable {
    /// The header value (`Bearer …`), or nil to send none. After a 401, `rejected` is the value
    /// that request carried: credentials renew it unless someone else already did (concurrent
    /// requests that fail with the same token cause one refresh, not one each). Returning
    /// `rejected` itself says there is nothing newer to try: the request is not sent again.
    func authorization(rejected: String?) throws(StorageError) -> String?
    /// Whether a request may be sent with them over plain http (loopback only, docs/protocol.md §2.1).
    var sendsSecrets: Bool { get }
}

/// No credentials: public buckets and emulators.
public struct AnonymousCredentials: Credentials {
    public init() {}
    public func authorization(rejected: String?) throws(StorageError) -> String? { nil }
    public var sendsSecrets: Bool { false }
}

/// An OAuth2 access token kept in a file (written by an outside refresher such as a sidecar or
/// `gcloud auth print-access-token > FILE`); re-read whenever the file's mtime or size changes.
public final class TokenFileCredentials: Credentials {
    private struct Cached { var token: String; var mtime: timespec; var size: Int }
    private let path: String
    private let scheme: String
    private let cache = OrderedMutex<Cached?>(.tokenFile, nil)

    public init(path: String, scheme: String = "Bearer") throws(StorageError) {
        self.path = path
        self.scheme = scheme
        _ = try authorization(rejected: "")
    }

    public var sendsSecrets: Bool { true }

    public func authorization(rejected: String?) throws(StorageError) -> String? {
        var st = stat()
        guard stat(path, &st) == 0 else {
            throw StorageError(.unauthenticated, "token_file \(path): \(String(cString: strerror(errno)))")
        }
        let current: String? = cache.withLock { c in
            guard let c, rejected == nil || "\(scheme) \(c.token)" != rejected, c.mtime.tv_sec == st.st_mtim.tv_sec, c.mtime.tv_nsec == st.st_mtim.tv_nsec,
                  c.size == st.st_size else { return nil }
            return c.token
        }
        if let current { return "\(scheme) \(current)" }
        guard let data = FileManager.default.contents(atPath: path) else {
            throw StorageError(.unauthenticated, "token_file \(path) cannot be read")
        }
        let token = String(decoding: data, as: UTF8.self).trimmingCharacters(in: .whitespacesAndNewlines)
        guard !token.isEmpty, !token.contains(where: { $0.isNewline || $0 == " " }) else {
            throw StorageError(.unauthenticated, "token_file \(path) must hold exactly one token")
        }
        cache.withLock { $0 = Cached(token: token, mtime: st.st_mtim, size: Int(st.st_size)) }
        return "\(scheme) \(token)"
    }
}
