import Foundation
import StorageClient
@testable import StorefsCore

/// A read's reply kept past the read, to be finished later (as a FUSE thread does once it has
/// replied): its cache copy is written when it is finished.
final class HeldReply: @unchecked Sendable {
    private var reply: ReadReply?
    private let lock = NSLock()

    init() {}

    func hold(_ r: consuming ReadReply) {
        lock.lock()
        defer { lock.unlock() }
        reply = Optional(consume r)
    }

    /// Finishes the reply held (runs what follows it); nothing if none.
    func finish() {
        lock.lock()
        let r = reply.take()
        lock.unlock()
        r?.finish()
    }
}

/// How the tests read: the adapter's two steps, each with its answer's bytes copied into the
/// caller's buffer (from a download's buffer too, when the reply borrowed it).
extension ReadReply {
    /// Copies the reply's bytes into `dst` (if they are not there already); returns the count.
    borrowing func copy(into dst: UnsafeMutableRawBufferPointer) -> Int {
        if isBorrowed, let base = bytes.baseAddress, bytes.count > 0 {
            dst.baseAddress!.copyMemory(from: base, byteCount: bytes.count)
        }
        return bytes.count
    }
}

extension BlockReader {
    /// Serves a read from what is here only (`Network.never`, a FUSE thread): true, and the
    /// bytes in `dst`, on a hit. `borrowed` hears the bytes of a reply made from a download's
    /// buffer, which are then not copied into `dst`.
    @discardableResult
    func readHere(_ stream: Stream, at offset: Int64, into dst: UnsafeMutableRawBufferPointer,
                  borrowed: ((UnsafeRawBufferPointer) -> Void)? = nil) -> Bool {
        guard let answer = try? read(stream, at: offset, into: dst, network: .never) else { return false }
        switch consume answer {
        case .reply(let reply):
            if reply.isBorrowed, let borrowed { borrowed(reply.bytes) } else { _ = reply.copy(into: dst) }
            reply.finish()
            return true
        case .miss:
            return false
        }
    }

    /// Serves a read that may wait for the network (`Network.allowed`), the bytes copied into
    /// `dst`. `held` keeps the reply unfinished (its cache copy not written) until the test
    /// finishes it; `borrowed` hears the bytes of a reply made from a download's buffer, which
    /// are then not copied into `dst`.
    func readWaiting(_ stream: Stream, at offset: Int64, into dst: UnsafeMutableRawBufferPointer,
                     isCancelled: (@Sendable () -> Bool)? = nil, held: HeldReply? = nil,
                     borrowed: ((UnsafeRawBufferPointer) -> Void)? = nil) throws(StorageError) {
        let answer = try read(stream, at: offset, into: dst, network: .allowed(isCancelled: isCancelled))
        switch consume answer {
        case .reply(let reply):
            if reply.isBorrowed, let borrowed { borrowed(reply.bytes) } else { _ = reply.copy(into: dst) }
            if let held { held.hold(reply) } else { reply.finish() }
        case .miss:
            preconditionFailure("a read that may wait is always replied")
        }
    }
}

extension Filesystem {
    /// `read` as a FUSE thread asks first (`Network.never`): the count on a hit, nil on a miss.
    func readHere(_ handle: UInt64, at offset: Int64, into buffer: UnsafeMutableRawBufferPointer) throws(FilesystemError) -> Int? {
        let answer = try read(handle, at: offset, into: buffer, network: .never)
        switch consume answer {
        case .reply(let reply):
            let n = reply.copy(into: buffer)
            reply.finish()
            return n
        case .miss:
            return nil
        }
    }

    /// `read` as a worker asks (`Network.allowed`): the count, bytes copied into `buffer`.
    /// `held` keeps the reply unfinished until the test finishes it.
    func readWaiting(_ handle: UInt64, at offset: Int64, into buffer: UnsafeMutableRawBufferPointer,
                     isCancelled: (@Sendable () -> Bool)? = nil, held: HeldReply? = nil) throws(FilesystemError) -> Int {
        let answer = try read(handle, at: offset, into: buffer, network: .allowed(isCancelled: isCancelled))
        switch consume answer {
        case .reply(let reply):
            let n = reply.copy(into: buffer)
            if let held { held.hold(reply) } else { reply.finish() }
            return n
        case .miss:
            preconditionFailure("a read that may wait is always replied")
        }
    }
}
