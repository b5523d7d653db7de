import Foundation

/// The mounts this process sees (`/proc/self/mountinfo`), parsed in one place: the mount point
/// is unescaped (the kernel writes space, tab, newline and backslash as `\040`, `\011`, `\012`
/// and `\134`) and compared as bytes.
public struct MountTable: Sendable {
    public struct Mount: Sendable, Equatable {
        /// `major:minor` of the mount's device: its backing device info in `/sys/class/bdi/`.
        public var device: String
        public var mountPoint: String
        /// `fuse.storefs`, `ext4`, ...
        public var type: String
        /// What was mounted (for storefs, the SOURCE as given).
        public var source: String
    }

    public let mounts: [Mount]

    /// The table now; nil if it cannot be read.
    public static func current() -> MountTable? {
        guard let text = try? String(contentsOfFile: "/proc/self/mountinfo", encoding: .utf8) else { return nil }
        return MountTable(parsing: text)
    }

    /// Lines are `ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTIONS [OPTIONAL...] - TYPE SOURCE SUPEROPTIONS`;
    /// a line that is not is skipped.
    public init(parsing text: String) {
        var mounts: [Mount] = []
        for line in text.split(separator: "\n") {
            let fields = line.split(separator: " ", omittingEmptySubsequences: false)
            guard fields.count > 6, let dash = fields.firstIndex(of: "-"), dash >= 6, dash + 2 < fields.count else { continue }
            mounts.append(Mount(device: String(fields[2]), mountPoint: Self.unescape(fields[4]),
                                type: Self.unescape(fields[dash + 1]), source: Self.unescape(fields[dash + 2])))
        }
        self.mounts = mounts
    }

    /// The mount on top at `path` (the last one listed there), if `path` is a mount point.
    public func mount(at path: String) -> Mount? {
        mounts.last { $0.mountPoint.utf8.elementsEqual(path.utf8) }
    }

    /// A field with the kernel's octal escapes (`\ooo`) turned back into bytes.
    static func unescape(_ field: Substring) -> String {
        var out: [UInt8] = []
        let bytes = Array(field.utf8)
        var i = 0
        while i < bytes.count {
            if bytes[i] == UInt8(ascii: "\\"), let value = Self.octal(bytes[(i + 1)..<min(i + 4, bytes.count)]) {
                out.append(value)
                i += 4
            } else {
                out.append(bytes[i])
                i += 1
            }
        }
        return String(decoding: out, as: UTF8.self)
    }

    private static func octal(_ digits: ArraySlice<UInt8>) -> UInt8? {
        guard digits.count == 3 else { return nil }
        var v = 0
        for d in digits {
            guard d >= UInt8(ascii: "0"), d <= UInt8(ascii: "7") else { return nil }
            v = v * 8 + Int(d - UInt8(ascii: "0"))
        }
        return v <= 255 ? UInt8(v) : nil
    }
}
