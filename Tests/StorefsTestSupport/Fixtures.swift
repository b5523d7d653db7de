import Foundation

/// A new empty directory under the system's temporary directory.
public func temporaryDirectory() -> String {
    let path = NSTemporaryDirectory() + "storefs-test-\(UUID().uuidString)"
    try! FileManager.default.createDirectory(atPath: path, withIntermediateDirectories: true)
    return path
}

/// `count` bytes of a pattern that differs from block to block (`seed` makes another).
public func pattern(_ count: Int, seed: UInt8 = 7) -> [UInt8] {
    (0..<count).map { UInt8(truncatingIfNeeded: $0 &* 31 &+ Int(seed) &+ ($0 >> 11)) }
}
