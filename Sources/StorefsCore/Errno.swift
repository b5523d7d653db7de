import Glibc
import StorageClient

/// The one place where storefs decides an errno (README, "Errors").
///
/// Exhaustive on purpose: adding a case to `FilesystemError.Code` or `StorageError.Code`
/// fails the build until its errno is chosen here.
public enum Errno {
    public static func value(for code: FilesystemError.Code) -> Int32 {
        switch code {
        case .storage(let storage): return value(for: storage)
        case .noEntry: return ENOENT
        case .readOnly: return EROFS
        case .notDirectory: return ENOTDIR
        case .isDirectory: return EISDIR
        case .nameTooLong: return ENAMETOOLONG
        case .noAttribute: return ENODATA
        case .attributeNamespaceUnsupported: return EOPNOTSUPP  // `ls -l` then stops asking the mount
        case .permissionDenied: return EACCES
        case .bufferTooSmall: return ERANGE
        case .staleHandle: return EBADF
        case .invalidArgument: return EINVAL
        case .isSymlink: return ELOOP            // open of a symlink (the kernel follows them itself)
        case .wouldBlock: return EAGAIN          // retried on a worker by the adapter, never replied
        }
    }

    public static func value(for code: StorageError.Code) -> Int32 {
        switch code {
        case .notFound: return ENOENT             // objectNotFound, 404
        case .unauthenticated: return EACCES      // 401 after one refresh
        case .unauthorized: return EACCES         // 403: rules or IAM deny
        case .quotaExceeded: return EAGAIN        // 402, 429 after retries
        case .generationChanged: return ESTALE    // 412 / the pinned generation is gone
        case .retryLimitExceeded: return EIO      // 5xx, 408, resets, timeouts after retries
        case .unreachable: return EIO
        case .tlsFailure: return EIO              // certificate not trusted, handshake failed
        case .checksumMismatch: return EIO        // nonMatchingChecksum
        case .cancelled: return EINTR             // the reading process was interrupted
        case .invalidResponse: return EIO
        case .invalidArgument: return EINVAL
        }
    }
}

extension Errno {
    /// The symbolic name of an errno value, for logs and metrics ("ENOENT"); unknown values
    /// as their number.
    public static func name(_ value: Int32) -> String {
        switch value {
        case 0: return "OK"
        case ENOENT: return "ENOENT"
        case EROFS: return "EROFS"
        case ENOTDIR: return "ENOTDIR"
        case EISDIR: return "EISDIR"
        case ENAMETOOLONG: return "ENAMETOOLONG"
        case ENODATA: return "ENODATA"
        case EACCES: return "EACCES"
        case ERANGE: return "ERANGE"
        case EBADF: return "EBADF"
        case EINVAL: return "EINVAL"
        case ELOOP: return "ELOOP"
        case EAGAIN: return "EAGAIN"
        case ESTALE: return "ESTALE"
        case EIO: return "EIO"
        case EINTR: return "EINTR"
        case ENOSYS: return "ENOSYS"
        case EOPNOTSUPP: return "EOPNOTSUPP"
        default: return "E\(value)"
        }
    }
}
