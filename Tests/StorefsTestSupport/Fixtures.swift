import Foundation
import Synchronization

/// A new empty directory under the system's temporary directory, removed with everything in it
/// when the test process exits.
public func temporaryDirectory() -> String {
    let path = NSTemporaryDirectory() + "storefs-test-\(UUID().uuidString)"
    try! FileManager.default.createDirectory(atPath: path, withIntermediateDirectories: true)
    removeAtExit(path)
    return path
}

/// Paths the test process made and removes when it exits (`atexit`), so a run leaves nothing in
/// /tmp: before, every run of the suite left about a hundred cache directories behind.
private let madeByTheseTests = Mutex<[String]>([])

/// Removes `path`, file or directory, when the test process exits.
public func removeAtExit(_ path: String) {
    let first = madeByTheseTests.withLock { paths in
        paths.append(path)
        return paths.count == 1
    }
    if first {
        atexit {
            for path in madeByTheseTests.withLock({ $0 }) {
                // A test may have taken its own permissions away; give them back first.
                _ = chmod(path, 0o700)
                try? FileManager.default.removeItem(atPath: path)
            }
        }
    }
}

/// `count` bytes of a pattern that differs from block to block (`seed` makes another).
public func pattern(_ count: Int, seed: UInt8 = 7) -> [UInt8] {
    (0..<count).map { UInt8(truncatingIfNeeded: $0 &* 31 &+ Int(seed) &+ ($0 >> 11)) }
}
