// `withUnsafeBytes` and `withUTF8` for bodies that throw a typed error (the standard ones
// rethrow `any Error`): the manifest code throws `ManifestError` and `ManifestIndex.Damaged`.

extension Array where Element == UInt8 {
    func withBytes<R, E: Error>(_ body: (UnsafeRawBufferPointer) throws(E) -> R) throws(E) -> R {
        try withUnsafeBytes { b in Result { () throws(E) -> R in try body(b) } }.get()
    }
}

extension String {
    mutating func withUTF8Bytes<R, E: Error>(_ body: (UnsafeRawBufferPointer) throws(E) -> R) throws(E) -> R {
        try withUTF8 { u in Result { () throws(E) -> R in try body(UnsafeRawBufferPointer(u)) } }.get()
    }
}
