internal import CProcess
import Glibc

/// Reads an extended attribute of a path (the `storefs prefetch` and `storefs cache` tools
/// ask a mount through these).
public enum PathAttributes {
    /// The value of `name` on `path`, at most `limit` bytes; nil with `errno` set on failure.
    public static func get(_ path: String, _ name: String, limit: Int = 4096) -> [UInt8]? {
        read(limit) { cprocess_getxattr(path, name, $0, $1) }
    }

    /// The value of `name` on the file or directory `fd` is open on.
    public static func get(descriptor fd: Int32, _ name: String, limit: Int = 4096) -> [UInt8]? {
        read(limit) { cprocess_fgetxattr(fd, name, $0, $1) }
    }

    /// The value of `name` on the entry `entry` of the directory `directoryFD` is open on,
    /// not following a link there: the path is `/proc/self/fd/N/entry`, which the kernel
    /// resolves from that very directory, whatever its path names now.
    public static func get(directory directoryFD: Int32, entry: String, _ name: String, limit: Int = 4096) -> [UInt8]? {
        let path = "/proc/self/fd/\(directoryFD)/\(entry)"
        return read(limit) { cprocess_lgetxattr(path, name, $0, $1) }
    }

    private static func read(_ limit: Int, _ call: (UnsafeMutableRawPointer?, UInt) -> Int) -> [UInt8]? {
        var buffer = [UInt8](repeating: 0, count: limit)
        let n = buffer.withUnsafeMutableBytes { call($0.baseAddress, UInt($0.count)) }
        guard n >= 0 else { return nil }
        return Array(buffer[0..<n])
    }
}

/// `open(2)` flags Glibc's Swift module leaves out.
public enum OpenFlags {
    public static var direct: Int32 { cprocess_o_direct() }
    public static var path: Int32 { cprocess_o_path() }
}
