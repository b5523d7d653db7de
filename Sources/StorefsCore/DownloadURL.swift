import Foundation
import StorageClient
import Synchronization
import Locking

/// `user.storefs.download_url` (README, "Download URLs"): the Firebase token URL when the
/// object has a download token, else a V4 signed URL when a service-account key is at hand,
/// else the public `storage.googleapis.com` URL. On a GCS JSON API endpoint that is not
/// Google's (fake-gcs-server, a proxy) a token object gets the endpoint's JSON API media URL
/// instead, because such a server is only known to speak the JSON API and may serve no v0 path
/// at all (fake-gcs-server does not). A URL is a capability, so who may read the attribute is a
/// policy of its own (`url_xattr=`).
public final class DownloadURL: Sendable {
    public static let firebaseHost = "https://firebasestorage.googleapis.com"
    public static let publicHost = "https://storage.googleapis.com"

    /// What an object with a Firebase download token gets.
    public enum TokenObjects: Sendable, Equatable {
        /// The Firebase token URL on `tokenHost` (`…/v0/b/B/o/NAME?alt=media&token=T`).
        case firebaseTokenURL
        /// The public URL on `publicHost`, which for an endpoint that is not Google's is the
        /// JSON API media URL; the token is left out (the JSON API does not read it).
        case publicURL
    }

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
    public let tokenObjects: TokenObjects
    public let signer: URLSigner?
    public let access: Access
    public let ownerUID: UInt32
    private let signed = OrderedMutex(.signedURLs, [String: (url: String, until: Int64)]())

    public init(tokenHost: String = firebaseHost, publicHost: String = publicHost,
                tokenObjects: TokenObjects = .firebaseTokenURL, signer: URLSigner? = nil,
                access: Access = .owner, ownerUID: UInt32 = 0) {
        func trimmed(_ host: String) -> String {
            var h = host
            while h.hasSuffix("/") { h.removeLast() }
            return h
        }
        self.tokenHost = trimmed(tokenHost)
        self.publicHost = trimmed(publicHost)
        self.tokenObjects = tokenObjects
        self.signer = signer
        self.access = access
        self.ownerUID = ownerUID
    }

    /// The URLs a mount hands out: they point where the mount reads.
    /// - Google's endpoints: token URLs on `firebasestorage.googleapis.com`, public URLs on
    ///   `storage.googleapis.com`.
    /// - `protocol=firebase` on another endpoint (the Firebase emulator): token URLs on it.
    /// - `protocol=gcs` on another endpoint: every object, token or not, gets the endpoint's
    ///   JSON API media URL, the one URL such a server is known to serve.
    public static func forMount(protocol storageProtocol: StorageProtocol, endpoint: String,
                                signer: URLSigner? = nil, access: Access = .owner, ownerUID: UInt32 = 0) -> DownloadURL {
        var origin = endpoint
        while origin.hasSuffix("/") { origin.removeLast() }
        let isGoogle = [GCSJSONStore.defaultEndpoint, FirebaseV0Store.defaultEndpoint].contains(origin)
        let tokenHost = storageProtocol == .firebase || !isGoogle ? origin : firebaseHost
        let tokenObjects: TokenObjects = storageProtocol == .gcs && !isGoogle ? .publicURL : .firebaseTokenURL
        return DownloadURL(tokenHost: tokenHost, publicHost: isGoogle ? publicHost : origin, tokenObjects: tokenObjects,
                           signer: signer, access: access, ownerUID: ownerUID)
    }

    /// One line for the mount's debug log: which URL a token object and a plain object get.
    public var summary: String {
        let token = tokenObjects == .firebaseTokenURL ? "firebase token URL on \(tokenHost)" : "JSON API media URL on \(publicHost) (no v0 path assumed)"
        let plain = signer != nil ? "signed URL" : publicHost == Self.publicHost ? "public URL on \(publicHost)" : "JSON API media URL on \(publicHost)"
        return "download_url token-objects=\"\(token)\" others=\"\(plain)\""
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
        if let token = meta.downloadTokens.first {
            switch tokenObjects {
            case .firebaseTokenURL: return Self.tokenURL(meta, token: token, host: tokenHost)
            case .publicURL: return Self.publicURL(meta, host: publicHost)
            }
        }
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
