import StorageClient

/// What a filesystem operation can fail with. `Errno.swift` turns the code into an errno;
/// nothing else in storefs decides errno values.
public struct FilesystemError: Error, Sendable, CustomStringConvertible {
    public enum Code: Sendable, Equatable {
        /// The bucket said no (or could not be reached); see `StorageError.Code`.
        case storage(StorageError.Code)
        /// No such entry in the namespace (including names storefs hides).
        case noEntry
        /// Any operation that would modify the bucket.
        case readOnly
        case notDirectory
        case isDirectory
        /// A path component longer than 255 bytes.
        case nameTooLong
        /// The extended attribute does not exist for this inode.
        case noAttribute
        /// An extended attribute outside the `user.` namespace (security.*, system.*,
        /// trusted.*): storefs has none, and says so the way a filesystem without that
        /// namespace does, so tools stop asking (README, "Extended attributes").
        case attributeNamespaceUnsupported
        /// This caller may not see this (a capability attribute under url_xattr=owner).
        case permissionDenied
        /// The caller's buffer is smaller than the value (getxattr/listxattr size protocol).
        case bufferTooSmall
        /// An inode or handle number the filesystem does not know (a kernel/adapter bug).
        case staleHandle
        case invalidArgument
        /// An operation on a symbolic link that only files allow (open), or readlink of a
        /// file.
        case isSymlink
        /// The answer needs the bucket and the caller said `Network.never` (a FUSE thread):
        /// the adapter asks again from a metadata worker. Never replied to the kernel.
        case wouldBlock
    }

    public let code: Code
    public let message: String
    public let underlying: StorageError?

    public init(_ code: Code, _ message: String, underlying: StorageError? = nil) {
        self.code = code
        self.message = message
        self.underlying = underlying
    }

    public init(_ error: StorageError) {
        self.init(.storage(error.code), error.message, underlying: error)
    }

    public var description: String { message }
}
