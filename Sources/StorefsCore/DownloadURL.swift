import Foundation
import StorageClient
import Synchronization

/// `user.storefs.download_url` (README, "Extended attributes"): the Firebase token URL
/// when the object has a download token, else a V4 signed URL when a service-account key is at
/// hand, else the public `storage.googleapis.com` URL. A URL is a capability, so who may read
/// the attribute is a policy of its own (`url_xattr=`).
public final class DownloadURL: Sendable {
    public static let firebaseHost = "https://firebasestorage.googleapis.com"
    public static let publicHost = "https://storage.googleapis.com"

    public enum Access: String, Sendable {
        /// The mounting user and root only (the default; matters with allow_other).
        case owner
        case all
        /// No download_url attribute at all.
        case off
    }

    /// Origin of token URLs: the mount's own Firebase endpoint on the v0 protocol, or its
    /// endpoint when that is not Google's (an emulator serves both APIs on one origin).
    public let tokenHost: String
    /// Origin of public URLs: `storage.googleapis.com` (`/BUCKET/OBJECT`), or the mount's
    /// endpoint when that is not Google's, as a JSON API media URL (which any GCS-API server,
    /// an emulator included, serves).
    public let publicHost: String
    public let signer: URLSigner?
    public let access: Access
    public let ownerUID: UInt32
    private let signed = Mutex([String: (url: String, until: Int64)]())

    public init(tokenHost: String = firebaseHost, publicHost: String = publicHost, signer: URLSigner? = nil,
                access: Access = .owner, ownerUID: UInt32 = 0) {
        func trimmed(_ host: String) -> String {
            var h = host
            while h.hasSuffix("/") { h.removeLast() }
            return h
        }
        self.tokenHost = trimmed(tokenHost)
        self.publicHost = trimmed(publicHost)
        self.signer = signer
        self.access = access
        self.ownerUID = ownerUID
    }

    /// Whether `uid` may read the URL.
    public func allows(_ uid: UInt32) -> Bool {
        switch access {
        case .all: return true
        case .off: return false
        case .owner: return uid == 0 || uid == ownerUID
        }
    }

    public static func tokenURL(_ meta: ObjectMetadata, token: String, host: String = firebaseHost) -> String {
        "\(host)/v0/b/\(ObjectName.encode(meta.bucket))/o/\(ObjectName.encode(meta.name))?alt=media&token=\(ObjectName.encode(token))"
    }

    public static func publicURL(_ meta: ObjectMetadata, host: String = publicHost) -> String {
        if host != publicHost {
            return "\(host)/download/storage/v1/b/\(ObjectName.encode(meta.bucket))/o/\(ObjectName.encode(meta.name))?alt=media"
        }
        return "\(host)/\(ObjectName.encode(meta.bucket))/\(ObjectName.encode(meta.name, keepingSlash: true))"
    }

    /// The URL for an object. A signed URL is reused for half its lifetime, so that the size
    /// query and the read of one getxattr see the same string.
    public func url(for meta: ObjectMetadata) -> String {
        if let token = meta.downloadTokens.first { return Self.tokenURL(meta, token: token, host: tokenHost) }
        guard let signer else { return Self.publicURL(meta, host: publicHost) }
        let key = "\(meta.bucket)\u{0}\(meta.name)\u{0}\(meta.generation)"
        let now = Int64(Date().timeIntervalSince1970)
        if let hit = signed.withLock({ $0[key] }), hit.until > now { return hit.url }
        do throws(StorageError) {
            let url = try signer.sign(bucket: meta.bucket, name: meta.name, now: now)
            signed.withLock { s in
                if s.count > 10_000 { s.removeAll() }
                s[key] = (url, now + Int64(signer.expiry / 2))
            }
            return url
        } catch {
            Log.warn("cannot sign a download URL for \(meta.name): \(error.message)")
            return Self.publicURL(meta, host: publicHost)
        }
    }
}
