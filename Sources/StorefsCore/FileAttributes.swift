import StorageClient

/// What `stat` shows for an inode, independent of FUSE.
public struct FileAttributes: Sendable, Equatable {
    public enum Kind: Sendable, Equatable { case file, directory, symlink }

    public var inode: UInt64
    public var kind: Kind
    public var size: Int64
    /// Permission bits only; the adapter adds the file-type bits.
    public var mode: UInt32
    public var uid: UInt32
    public var gid: UInt32
    public var modified: Timestamp
    public var linkCount: UInt32
}

/// One readdir entry with the offset of the entry after it.
public struct DirectoryEntry: Sendable, Equatable {
    public var name: String
    public var inode: UInt64
    public var kind: FileAttributes.Kind
    public var nextOffset: Int
}
