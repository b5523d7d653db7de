internal import CProcess
import Glibc

/// Reads an extended attribute of a path (the `storefs prefetch` and `storefs cache` tools
/// ask a mount through these).
public enum PathAttributes {
    /// The value of `name` on `path`, at most `limit` bytes; nil with `errno` set on failure.
    public static func get(_ path: String, _ name: String, limit: Int = 4096) -> [UInt8]? {
        var buffer = [UInt8](repeating: 0, count: limit)
        let n = buffer.withUnsafeMutableBytes { cprocess_getxattr(path, name, $0.baseAddress, UInt($0.count)) }
        guard n >= 0 else { return nil }
        return Array(buffer[0..<n])
    }
}

/// `open(2)` flags Glibc's Swift module leaves out.
public enum OpenFlags {
    public static var direct: Int32 { cprocess_o_direct() }
}
