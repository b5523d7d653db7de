import StorefsCore

/// The FUSE operations storefs answers, as counted and logged (docs/operations.md): the
/// adapter names them to `Metrics` at start and counts them by their raw value.
enum FuseOp: Int, Sendable, CaseIterable {
    case lookup, forget, getattr, readlink, opendir, readdir, readdirplus, releasedir, open, read, release
    case getxattr, listxattr, statfs
    // Everything that would change the bucket (EROFS).
    case setattr, mknod, mkdir, unlink, rmdir, symlink, rename, link, create, write, setxattr, removexattr, fallocate

    var name: String { String(describing: self) }

    /// Tells `Metrics` the operations' names, in this order.
    static func nameForMetrics() {
        Metrics.shared.nameOperations(allCases.map(\.name))
    }
}
