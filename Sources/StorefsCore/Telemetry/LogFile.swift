import Foundation
import Glibc

/// `log_file=PATH`: opened for appending, never through a link and never a file someone
/// else could have put there (docs/security.md, "The log file"): a root daemon told to log to
/// `/tmp/x` must not append to whatever a local user linked there. Every directory above the
/// file is held to the cache directory's rules (TrustedPath); the file's own directory stays
/// open, and the file is (re)opened relative to it, so SIGHUP reopens it in that directory
/// whatever a link on the path names by then.
public final class LogFile: @unchecked Sendable {
    public struct Refused: Error, Sendable {
        public let message: String
    }

    /// The directory the file lives in, opened once; every log file reopened on SIGHUP shares it.
    private final class Directory: Sendable {
        let fd: Int32
        init(fd: Int32) { self.fd = fd }
        deinit { Glibc.close(fd) }
    }

    public let path: String
    private let name: String
    private let directory: Directory
    private let fd: Int32

    /// Opens (creating with mode 0640) `path` (absolute) for appending. Refused: an ancestor
    /// another user owns or may write (without the sticky bit), or a link on the way another
    /// user owns; and a file that is a symbolic link, not a regular file, owned by another
    /// user, with more than one name (a hard link), or writable by group or others.
    public convenience init(path: String) throws(Refused) {
        let slash = path.utf8.lastIndex(of: UInt8(ascii: "/"))
        guard path.hasPrefix("/"), let slash else {
            throw Refused(message: "log_file=\(path) is not an absolute path")
        }
        let name = String(path[path.utf8.index(after: slash)...])
        guard !name.isEmpty, name != ".", name != ".." else {
            throw Refused(message: "log_file=\(path) names a directory: give the path of a file")
        }
        let parent = slash == path.utf8.startIndex ? "/" : String(path[..<slash])
        let dirFD: Int32
        do throws(TrustedPath.Refused) {
            dirFD = try TrustedPath.openDirectory(parent, subject: "log_file=\(path)", owner: geteuid(), create: false,
                                                  last: .ancestor)
        } catch {
            throw Refused(message: error.message)
        }
        try self.init(path: path, name: name, directory: Directory(fd: dirFD))
    }

    private init(path: String, name: String, directory: Directory) throws(Refused) {
        self.path = path
        self.name = name
        self.directory = directory
        let fd = openat(directory.fd, name, O_WRONLY | O_APPEND | O_CREAT | O_NOFOLLOW | O_NOCTTY | O_CLOEXEC | O_NONBLOCK, 0o640)
        guard fd >= 0 else {
            let err = errno
            if err == ELOOP {
                throw Refused(message: "log_file=\(path) is a symbolic link: give the real path of a file you own")
            }
            throw Refused(message: "cannot open log_file=\(path): \(String(cString: strerror(err)))")
        }
        var st = stat()
        guard fstat(fd, &st) == 0 else {
            Glibc.close(fd)
            throw Refused(message: "cannot stat log_file=\(path)")
        }
        let problem: String? =
            st.st_mode & S_IFMT != S_IFREG ? "is not a regular file"
            : st.st_uid != geteuid() ? "belongs to uid \(st.st_uid), not to the mounting user (uid \(geteuid()))"
            : st.st_nlink != 1 ? "has \(st.st_nlink) names (hard links)"
            : st.st_mode & 0o022 != 0 ? "is writable by group or others (mode \(String(st.st_mode & 0o777, radix: 8)))"
            : nil
        if let problem {
            Glibc.close(fd)
            throw Refused(message: "log_file=\(path) \(problem): give a file only you can write (chmod go-w, or a new path)")
        }
        // Appends of one line each: O_NONBLOCK only mattered for opening (a FIFO would block).
        _ = fcntl(fd, F_SETFL, O_WRONLY | O_APPEND)
        self.fd = fd
    }

    /// The file opened again (SIGHUP, after logrotate moved it), in the directory this one
    /// was opened in, with the same checks.
    func reopened() throws(Refused) -> LogFile {
        try LogFile(path: path, name: name, directory: directory)
    }

    func write(_ line: String) {
        _ = line.withCString { Glibc.write(fd, $0, strlen($0)) }
    }

    func close() { Glibc.close(fd) }
}

/// How one log line is written (docs/operations.md, "Logs").
enum LogLine {
    /// RFC 3339, UTC, milliseconds: `2026-11-30T23:59:01.123Z`.
    static func timestamp() -> String {
        var ts = timespec()
        clock_gettime(CLOCK_REALTIME, &ts)
        var t = ts.tv_sec
        var tm = Glibc.tm()
        gmtime_r(&t, &tm)
        func pad(_ n: Int32, _ width: Int) -> String {
            let s = String(n)
            return String(repeating: "0", count: max(0, width - s.count)) + s
        }
        return "\(pad(tm.tm_year + 1900, 4))-\(pad(tm.tm_mon + 1, 2))-\(pad(tm.tm_mday, 2))T"
            + "\(pad(tm.tm_hour, 2)):\(pad(tm.tm_min, 2)):\(pad(tm.tm_sec, 2)).\(pad(Int32(ts.tv_nsec / 1_000_000), 3))Z"
    }

    /// logfmt: `ts=… level=… msg="…" key=value`, values quoted when they need it.
    static func text(time: String?, level: String, message: String, fields: [(String, String)]) -> String {
        var out = ""
        if let time { out += "ts=\(time) " }
        out += "level=\(level) msg=\(quoted(message))"
        for (k, v) in fields { out += " \(k)=\(quoted(v))" }
        return out
    }

    /// One JSON object; values that are plain numbers are written as numbers.
    static func json(time: String?, level: String, message: String, fields: [(String, String)]) -> String {
        var out = "{"
        if let time { out += "\"ts\":\"\(time)\"," }
        out += "\"level\":\"\(level)\",\"msg\":\(jsonString(message))"
        for (k, v) in fields { out += ",\(jsonString(k)):\(isNumber(v) ? v : jsonString(v))" }
        return out + "}"
    }

    /// A logfmt value: control characters as `\xNN` (`Log.escaped`), quoted with `"` when
    /// empty or holding a space, `=` or `"`.
    static func quoted(_ value: String) -> String {
        let v = Log.escaped(value)
        guard v.isEmpty || v.contains(where: { $0 == " " || $0 == "=" || $0 == "\"" }) else { return v }
        return "\"" + v.replacingOccurrences(of: "\"", with: "\\\"") + "\""
    }

    static func jsonString(_ s: String) -> String {
        var out = "\""
        for u in s.unicodeScalars {
            switch u {
            case "\"": out += "\\\""
            case "\\": out += "\\\\"
            case "\n": out += "\\n"
            case "\t": out += "\\t"
            case "\r": out += "\\r"
            default:
                if u.value < 0x20 || u.value == 0x7f || (0x80..<0xa0).contains(u.value) {
                    let hex = String(u.value, radix: 16)
                    out += "\\u" + String(repeating: "0", count: 4 - hex.count) + hex
                } else {
                    out.unicodeScalars.append(u)
                }
            }
        }
        return out + "\""
    }

    /// `seconds` as milliseconds with three decimals.
    static func milliseconds(_ seconds: Double) -> String {
        String(format: "%.3f", seconds * 1000)
    }

    static func isNumber(_ v: String) -> Bool {
        let b = Array(v.utf8)
        guard !b.isEmpty, b.count <= 20 else { return false }
        var i = b[0] == UInt8(ascii: "-") ? 1 : 0
        guard i < b.count, b[i] >= 48, b[i] <= 57, !(b[i] == 48 && i + 1 < b.count && b[i + 1] != UInt8(ascii: ".")) else { return false }
        var dot = false
        while i < b.count {
            if b[i] == UInt8(ascii: ".") {
                guard !dot, i + 1 < b.count else { return false }
                dot = true
            } else if b[i] < 48 || b[i] > 57 {
                return false
            }
            i += 1
        }
        return true
    }
}
