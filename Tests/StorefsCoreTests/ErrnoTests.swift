import Glibc
import Testing
import StorageClient
@testable import StorefsCore

@Suite struct ErrnoTests {
    /// The README's "Errors" table, row by row.
    @Test(arguments: [
        (StorageError.Code.notFound, ENOENT), (.unauthenticated, EACCES), (.unauthorized, EACCES),
        (.quotaExceeded, EAGAIN), (.generationChanged, ESTALE), (.retryLimitExceeded, EIO),
        (.checksumMismatch, EIO), (.cancelled, EINTR), (.unreachable, EIO), (.invalidResponse, EIO),
    ])
    func storageConditions(code: StorageError.Code, errno expected: Int32) {
        #expect(Errno.value(for: code) == expected)
        #expect(Errno.value(for: .storage(code)) == expected)
    }

    @Test(arguments: [
        (FilesystemError.Code.noEntry, ENOENT), (.readOnly, EROFS), (.noAttribute, ENODATA), (.attributeNamespaceUnsupported, EOPNOTSUPP),
        (.bufferTooSmall, ERANGE), (.nameTooLong, ENAMETOOLONG), (.notDirectory, ENOTDIR), (.isDirectory, EISDIR),
    ])
    func filesystemConditions(code: FilesystemError.Code, errno expected: Int32) {
        #expect(Errno.value(for: code) == expected)
    }

    @Test func httpStatusesEndAtTheTableErrno() {
        #expect(Errno.value(for: StorageError.fromStatus(404, what: "").code) == ENOENT)
        #expect(Errno.value(for: StorageError.fromStatus(403, what: "").code) == EACCES)
        #expect(Errno.value(for: StorageError.fromStatus(401, what: "").code) == EACCES)
        #expect(Errno.value(for: StorageError.fromStatus(429, what: "").code) == EAGAIN)
        #expect(Errno.value(for: StorageError.fromStatus(412, what: "").code) == ESTALE)
        #expect(Errno.value(for: StorageError.fromStatus(503, what: "").code) == EIO)
    }
}
