import StorageClient

/// Where a file handle's bytes come from: the step between "this handle wants bytes
/// [offset, offset+n)" and HTTP. `DirectRangeReader` issues one ranged GET per request;
/// the block cache (issue 3) plugs in here.
public protocol RangeReader: Sendable {
    func read(_ object: ObjectMetadata, at offset: Int64, into buffer: UnsafeMutableRawBufferPointer,
              isCancelled: (@Sendable () -> Bool)?) throws(StorageError)
}

/// One ranged GET, pinned to the generation seen at open, straight into the reply buffer.
public struct DirectRangeReader: RangeReader {
    let store: ObjectStore

    public init(store: ObjectStore) { self.store = store }

    public func read(_ object: ObjectMetadata, at offset: Int64, into buffer: UnsafeMutableRawBufferPointer,
                     isCancelled: (@Sendable () -> Bool)?) throws(StorageError) {
        try store.read(object.name, generation: object.generation, offset: offset, into: buffer, isCancelled: isCancelled)
    }
}
