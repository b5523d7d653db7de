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

    public init(size: Int64, generation: Int64, modified: Timestamp, crc32c: String? = nil) {
        self.size = size
        self.generation = generation
        self.modified = modified
        self.crc32c = crc32c
    }

    public init(_ meta: ObjectMetadata) {
        self.init(size: meta.size, generation: meta.generation, modified: meta.modificationTime,
                  crc32c: meta.crc32c.flatMap { $0.utf8.count <= 15 ? $0 : nil })
    }

    /// The object resource a read needs (name, bucket, size, generation, crc32c): rebuilt at
    /// open from the record, so the read path never depends on what was kept for `stat`.
    func objectMetadata(name: String, bucket: String) -> ObjectMetadata {
        ObjectMetadata(name: name, bucket: bucket, size: size, generation: generation, updated: modified, crc32c: crc32c)
    }
}
