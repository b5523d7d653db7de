import StorageClient

/// `user.storefs.download_url` (design.md §1, "Extended attributes").
public enum DownloadURL {
    public static let firebaseHost = "https://firebasestorage.googleapis.com"
    public static let publicHost = "https://storage.googleapis.com"

    /// The Firebase token URL when the object has a download token (the first one, as the SDKs
    /// do, protocol.md §2.5), otherwise the public `storage.googleapis.com` URL.
    public static func forObject(_ meta: ObjectMetadata, firebaseHost: String = firebaseHost) -> String {
        if let token = meta.downloadTokens.first {
            return "\(firebaseHost)/v0/b/\(ObjectName.encode(meta.bucket))/o/\(ObjectName.encode(meta.name))"
                + "?alt=media&token=\(ObjectName.encode(token))"
        }
        return "\(publicHost)/\(ObjectName.encode(meta.bucket))/\(ObjectName.encode(meta.name, keepingSlash: true))"
    }
}
