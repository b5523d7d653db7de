import StorageClient

/// What a read returns: the bytes to reply with, and what must happen once the reply is sent.
///
/// The bytes lie either in the caller's buffer (copied from the block cache or from a
/// download), or in a landed download's own buffer, borrowed: replying from it saves a copy of
/// every byte (~5% of the daemon's CPU with 8 readers on loopback). A borrowed buffer stays
/// valid until the reply is finished. What follows the reply (the cache copy of a download the
/// read made, letting the borrowed buffer go) runs when it is finished, on the thread that
/// finishes it: after the reply, not in front of it (docs/architecture.md, "The data path").
///
/// The core never replies to the kernel: the FUSE adapter sends `bytes`, then calls `finish()`.
/// A reply dropped without `finish()` finishes as it goes.
public struct ReadReply: ~Copyable {
    /// What to reply with: `count` bytes, possibly none (at or past the end of the file).
    public let bytes: UnsafeRawBufferPointer
    /// Whether `bytes` are borrowed from a download rather than in the caller's buffer.
    public let isBorrowed: Bool
    private let after: AfterReply?

    init(bytes: UnsafeRawBufferPointer, borrowed: Bool = false, after: AfterReply? = nil) {
        self.bytes = bytes
        self.isBorrowed = borrowed
        self.after = after
    }

    /// Nothing to reply with: the read starts at or past the end of the file.
    static var empty: ReadReply { ReadReply(bytes: UnsafeRawBufferPointer(start: nil, count: 0)) }

    /// The reply has been sent: runs what follows it (a cache copy), then lets go of what it
    /// borrowed.
    public consuming func finish() {}

    deinit { after?.run() }
}

/// The answer to a read that may not wait for the network (`Network.never`, a FUSE thread).
public enum ReadAnswer: ~Copyable {
    /// Served from what is here: the block cache, or downloads that have landed.
    case reply(ReadReply)
    /// Some of it must be downloaded: ask again with `Network.allowed` on a thread that may
    /// wait. `wait` says about how long that will be, for the adapter to choose the thread.
    case miss(MissWait)

    /// Whether it was served (`.reply`).
    public var isReply: Bool {
        switch self {
        case .reply: return true
        case .miss: return false
        }
    }
}

/// How long a read that missed will wait for the network.
public enum MissWait: Sendable, Equatable {
    /// About a millisecond: the server is near (`TransferPlan.isNear`), so the wait costs less
    /// than a hop to another thread and back (docs/architecture.md, "Threads").
    case brief
    /// A round trip to a far server or more.
    case long
}

/// Work a read leaves for after its reply, and what it holds until then (the download whose
/// buffer the reply borrows). Filled by the read path of one read only, run once.
final class AfterReply: @unchecked Sendable {
    private var work: [@Sendable () -> Void] = []
    private var held: [AnyObject] = []

    /// Runs `job` after the reply.
    func add(_ job: @escaping @Sendable () -> Void) { work.append(job) }

    /// Keeps `object` (a download whose buffer the reply borrows) until the reply is finished.
    func hold(_ object: AnyObject) { held.append(object) }

    var isEmpty: Bool { work.isEmpty && held.isEmpty }

    /// The jobs, for a read that failed: its error reply must not wait for them.
    func takeWork() -> [@Sendable () -> Void] {
        defer { work.removeAll() }
        return work
    }

    func run() {
        // What the reply borrowed goes first: the jobs (a cache write) can take milliseconds.
        held.removeAll()
        for job in work { job() }
        work.removeAll()
    }
}
