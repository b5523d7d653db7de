import StorageClient

/// What the namespace keeps about one file: what `stat` and a read need, and nothing else
/// (48 bytes, no heap: the crc32c is 8 base64 characters, a Swift small string). The whole
/// object resource (content type, custom metadata, download tokens) is kept only briefly,
/// for extended attributes (`Filesystem.FullMetadata`): a million remembered files must not
/// cost a million object resources (docs/architecture.md, "Metadata memory").
public struct FileRecord: Sendable, Equatable {
    public var size: Int64
    /// Content identity: a new generation is a new object, a new inode, new cache blocks.
    public var generation: Int64
    /// What `stat` shows (`ObjectMetadata.modificationTime`).
    public var modified: Timestamp
    /// base64 crc32c of the whole object, when the server gave one (end-to-end checks).
    public var crc32c: String?
    /// POSIX metadata of `gsutil -P` / `gcloud storage cp --preserve-posix` uploads
    /// (`goog-reserved-posix-mode/uid/gid`): permission bits (nil when absent) and owner.
    public var posixMode: UInt16?
    public var posixUID: UInt32?
    public var posixGID: UInt32?
    /// A symbolic link as gcsfuse stores it (README, "Compatibility"): the target in the
    /// custom metadata (`gcsfuse_symlink_target`, legacy) or as the object's bytes
    /// (`goog-reserved-file-is-symlink: true`).
    public var symlink: SymlinkStyle?
    /// A legacy symlink's target length (its `stat` size; the object itself is empty).
    public var metadataTargetLength: UInt16 = 0

    public enum SymlinkStyle: UInt8, Sendable, Equatable {
        case targetInMetadata = 1
        case targetInContent = 2
    }

    public static let legacySymlinkKey = "gcsfuse_symlink_target"
    public static let standardSymlinkKey = "goog-reserved-file-is-symlink"

    public init(size: Int64, generation: Int64, modified: Timestamp, crc32c: String? = nil, posixMode: UInt16? = nil,
                posixUID: UInt32? = nil, posixGID: UInt32? = nil, symlink: SymlinkStyle? = nil) {
        self.size = size
        self.generation = generation
        self.modified = modified
        self.crc32c = crc32c
        self.posixMode = posixMode
        self.posixUID = posixUID
        self.posixGID = posixGID
        self.symlink = symlink
    }

    public init(_ meta: ObjectMetadata) {
        let custom = meta.custom
        // The mode may be written with its file-type bits (`100755`) or without (`755`).
        let mode = custom["goog-reserved-posix-mode"].flatMap { UInt32($0, radix: 8) }.map { UInt16($0 & 0o777) }
        var symlink: SymlinkStyle? = nil
        if let target = custom[Self.legacySymlinkKey], !target.isEmpty {
            symlink = .targetInMetadata
        } else if custom[Self.standardSymlinkKey] == "true" {
            symlink = .targetInContent
        }
        self.init(size: meta.size,
                  generation: meta.generation, modified: meta.modificationTime,
                  crc32c: meta.crc32c.flatMap { $0.utf8.count <= 15 ? $0 : nil }, posixMode: mode,
                  posixUID: custom["goog-reserved-posix-uid"].flatMap { UInt32($0) },
                  posixGID: custom["goog-reserved-posix-gid"].flatMap { UInt32($0) }, symlink: symlink)
        if symlink == .targetInMetadata { metadataTargetLength = UInt16(min(custom[Self.legacySymlinkKey]!.utf8.count, 0xFFFF)) }
    }

    /// What `stat` shows as the size of the symlink: its target's length.
    var symlinkSize: Int64 { symlink == .targetInMetadata ? Int64(metadataTargetLength) : size }

    /// The object resource a read needs (name, bucket, size, generation, crc32c): rebuilt at
    /// open from the record, so the read path never depends on what was kept for `stat`.
    func objectMetadata(name: String, bucket: String) -> ObjectMetadata {
        ObjectMetadata(name: name, bucket: bucket, size: size, generation: generation, updated: modified, crc32c: crc32c)
    }
}
