/// The storage side of storefs: what the filesystem needs from a bucket, for either protocol.
///
/// All calls block the calling thread (they are made from threads storefs owns) and throw
/// `StorageError`; names are full object names, never URL-encoded. `isCancelled`, where given,
/// is polled while a request waits (about once a second, and between retries): true ends it
/// with `.cancelled` (an interrupted caller).
public protocol ObjectStore: Sendable {
    var bucket: String { get }
    /// One page of `prefix` listed with `delimiter=/`, on `connection` if one is set aside.
    func list(prefix: String, pageToken: String?, isCancelled: (@Sendable () -> Bool)?,
              connection: ConnectionClaim?) throws(StorageError) -> ListPage
    /// Whether anything (objects, sub-prefixes, a placeholder) lies under `prefix` (ends in `/`):
    /// one small list request, used to tell a directory from a file.
    func hasChildren(prefix: String, isCancelled: (@Sendable () -> Bool)?) throws(StorageError) -> Bool
    /// The object's current metadata.
    func metadata(of name: String, isCancelled: (@Sendable () -> Bool)?) throws(StorageError) -> ObjectMetadata
    /// Copies bytes `[offset, offset + buffer.count)` of generation `generation` into `buffer`
    /// (taken when the first byte arrives, if it was made so: `RangeBuffer`), on `connection`
    /// if one is set aside. The caller clamps the range to the object's size; `buffer` is
    /// never empty. Returns how long the answer took to start.
    @discardableResult
    func read(_ name: String, generation: Int64, offset: Int64, into buffer: RangeBuffer,
              isCancelled: (@Sendable () -> Bool)?, connection: ConnectionClaim?) throws(StorageError) -> ReadTiming
    /// Proves the bucket exists and the credentials may list `prefix` (start-up check). Where
    /// listings carry sizes (GCS JSON), the check is the first listing page of `prefix`
    /// itself, returned so that it answers lookups there with no request of their own; nil
    /// where they do not (Firebase v0).
    @discardableResult
    func checkAccess(prefix: String) throws(StorageError) -> ListPage?
    /// Whether a listing's items carry sizes and generations (GCS JSON; not Firebase v0,
    /// whose listings give names only, docs/protocol.md §2.4).
    var listingsCarrySizes: Bool { get }
    /// The first `buffer.count` bytes of `name` (fewer if it is smaller), whatever its
    /// generation: asked beside a lookup, before the generation is known. nil where the store
    /// does not do this (its lookups need no second round trip).
    func readStart(_ name: String, into buffer: UnsafeMutableRawBufferPointer,
                   isCancelled: (@Sendable () -> Bool)?) throws(StorageError) -> ObjectStart?
}

/// How a store's connections may be steered, where it keeps a pool of them (the HTTP stores):
/// the read path opens connections ahead of need and sets a warm one aside for a request that
/// must go first (docs/architecture.md, "Adaptive transfers"). Apart from `ObjectStore`: what
/// a bucket answers is one thing, how its connections are used another.
public protocol ConnectionTuning: Sendable {
    /// Sets the warm connection aside for a request that must go first
    /// (`HTTPClient.claimIdleConnection`); nil when none is idle.
    func claimIdleConnection() -> ConnectionClaim?
    /// Connections to the bucket in the pool or in use (`HTTPClient.connectionCount`); nil
    /// where the store cannot tell.
    var connectionCount: Int? { get }
    /// Seconds to the first byte of the fastest answer the bucket's server has given this store
    /// (`FastestAnswer`); nil before any.
    var fastestFirstByte: Double? { get }
    /// Opens one connection more and leaves it in the pool, with the smallest request made the
    /// way reads of `name` are (its first byte): blocks for a connection's set-up and one round
    /// trip, and reports nothing (it is only a head start for the reads that follow).
    func openConnection(forReading name: String, generation: Int64)
}

/// How long a read's answer took to start: seconds from the request to its first byte, the
/// connection's set-up left out (`HTTPClient.firstByteDelay`); 0 where the store does not
/// measure. Read-ahead learns from it how far away the server is.
public struct ReadTiming: Sendable, Equatable {
    public var firstByte: Double

    public init(firstByte: Double) { self.firstByte = firstByte }
}

/// What `ObjectStore.readStart` brought: the generation the bytes are of, the object's size
/// where the answer says it, and how many bytes came.
public struct ObjectStart: Sendable, Equatable {
    public var generation: Int64
    public var size: Int64?
    public var count: Int

    public init(generation: Int64, size: Int64?, count: Int) {
        self.generation = generation
        self.size = size
        self.count = count
    }
}

extension ObjectStore {
    public var listingsCarrySizes: Bool { true }

    public func readStart(_ name: String, into buffer: UnsafeMutableRawBufferPointer,
                          isCancelled: (@Sendable () -> Bool)?) throws(StorageError) -> ObjectStart? { nil }

    @discardableResult
    public func read(_ name: String, generation: Int64, offset: Int64, into buffer: RangeBuffer,
                     isCancelled: (@Sendable () -> Bool)?) throws(StorageError) -> ReadTiming {
        try read(name, generation: generation, offset: offset, into: buffer, isCancelled: isCancelled, connection: nil)
    }

    @discardableResult
    public func read(_ name: String, generation: Int64, offset: Int64, into buffer: UnsafeMutableRawBufferPointer,
                     isCancelled: (@Sendable () -> Bool)?) throws(StorageError) -> ReadTiming {
        try read(name, generation: generation, offset: offset, into: RangeBuffer(buffer), isCancelled: isCancelled, connection: nil)
    }

    public func list(prefix: String, pageToken: String?, isCancelled: (@Sendable () -> Bool)?) throws(StorageError) -> ListPage {
        try list(prefix: prefix, pageToken: pageToken, isCancelled: isCancelled, connection: nil)
    }

    public func list(prefix: String, pageToken: String?) throws(StorageError) -> ListPage {
        try list(prefix: prefix, pageToken: pageToken, isCancelled: nil, connection: nil)
    }

    public func hasChildren(prefix: String) throws(StorageError) -> Bool { try hasChildren(prefix: prefix, isCancelled: nil) }

    public func metadata(of name: String) throws(StorageError) -> ObjectMetadata { try metadata(of: name, isCancelled: nil) }
}

extension ObjectStore {
    /// `ConnectionTuning.openConnection` for a store whose reads go through `http`.
    func openConnection(through http: HTTPClient, forReading name: String, generation: Int64) {
        let byte = UnsafeMutableRawBufferPointer.allocate(byteCount: 1, alignment: 1)
        defer { byte.deallocate() }
        _ = try? read(name, generation: generation, offset: 0, into: RangeBuffer(byte), isCancelled: nil,
                      connection: http.claimNewConnection())
    }
}
