/// Where the body of a ranged GET goes (`HTTPClient.getRange`): a buffer in hand, or one taken
/// when the first body byte arrives.
///
/// A read-ahead part through a far link waits a round trip or more for its first byte; memory
/// taken then instead of when the request goes out is not held while it waits
/// (docs/architecture.md, "Adaptive transfers", Buffers taken at the first byte).
public final class RangeBuffer: @unchecked Sendable {
    /// Bytes the range asks for: the buffer's size, known before it is taken.
    public let count: Int
    private var take: (() -> UnsafeMutableRawBufferPointer)?
    private var taken: UnsafeMutableRawBufferPointer?

    public init(_ buffer: UnsafeMutableRawBufferPointer) {
        count = buffer.count
        taken = buffer
    }

    /// `take` is called at most once, on the thread performing the request, when the first
    /// body byte of a successful answer arrives (never for an error answer), and must return
    /// `count` bytes.
    public init(count: Int, takenAtFirstByte take: @escaping () -> UnsafeMutableRawBufferPointer) {
        self.count = count
        self.take = take
    }

    /// The buffer, taken now if it was not yet. Only the thread performing the request asks,
    /// one request at a time (a retry uses the same buffer).
    public var bytes: UnsafeMutableRawBufferPointer {
        if let taken { return taken }
        let b = take!()
        precondition(b.count == count, "RangeBuffer: took \(b.count) bytes for a range of \(count)")
        take = nil
        taken = b
        return b
    }
}
