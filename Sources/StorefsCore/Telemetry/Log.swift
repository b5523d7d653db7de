import Glibc
import Synchronization

/// Levels of `log_level=`.
public enum LogLevel: Int, Sendable, Comparable, CaseIterable {
    case error, warn, info, debug, trace

    public init?(name: String) {
        switch name.lowercased() {
        case "error": self = .error
        case "warn", "warning": self = .warn
        case "info": self = .info
        case "debug": self = .debug
        case "trace": self = .trace
        default: return nil
        }
    }

    public static func < (a: LogLevel, b: LogLevel) -> Bool { a.rawValue < b.rawValue }

    var name: String { ["error", "warn", "info", "debug", "trace"][rawValue] }
    var syslogPriority: Int32 { [LOG_ERR, LOG_WARNING, LOG_INFO, LOG_DEBUG, LOG_DEBUG][rawValue] }
}

/// storefs's logger: constant messages with key=value context, to stderr in the foreground and
/// to syslog once daemonized. Callers never pass tokens, keys or signed URLs.
public enum Log {
    private struct State { var level: LogLevel = .info; var syslog = false }
    private static let state = Mutex(State())

    public static func configure(level: LogLevel) { state.withLock { $0.level = level } }

    /// Switch to syslog (after daemonizing, when stderr goes nowhere).
    public static func useSyslog() {
        openlog("storefs", LOG_PID, LOG_DAEMON)
        state.withLock { $0.syslog = true }
    }

    public static func enabled(_ level: LogLevel) -> Bool { state.withLock { level <= $0.level } }

    public static func error(_ message: @autoclosure () -> String) { emit(.error, message) }
    public static func warn(_ message: @autoclosure () -> String) { emit(.warn, message) }
    public static func info(_ message: @autoclosure () -> String) { emit(.info, message) }
    public static func debug(_ message: @autoclosure () -> String) { emit(.debug, message) }
    public static func trace(_ message: @autoclosure () -> String) { emit(.trace, message) }

    private static func emit(_ level: LogLevel, _ message: () -> String) {
        let (enabled, toSyslog) = state.withLock { (level <= $0.level, $0.syslog) }
        guard enabled else { return }
        let text = escaped(message())
        if toSyslog {
            withVaList([text]) { vsyslog(level.syslogPriority, "%s", $0) }
        } else {
            let line = "storefs[\(level.name)] \(text)\n"
            _ = line.withCString { write(2, $0, strlen($0)) }
        }
    }

    /// `text` with every control character (C0, DEL, C1) written as `\xNN` and `\` as `\\`:
    /// object names and server messages reach log lines, and a newline or an escape sequence
    /// in them must not forge a line or drive a terminal.
    public static func escaped(_ text: String) -> String {
        func plain(_ s: Unicode.Scalar) -> Bool { s.value >= 0x20 && s.value != 0x7f && !(0x80..<0xa0).contains(s.value) && s != "\\" }
        if text.unicodeScalars.allSatisfy(plain) { return text }
        var out = String.UnicodeScalarView()
        let hex = Array("0123456789abcdef".unicodeScalars)
        for s in text.unicodeScalars {
            if plain(s) {
                out.append(s)
            } else if s == "\\" {
                out.append(contentsOf: "\\\\".unicodeScalars)
            } else {
                out.append(contentsOf: "\\x".unicodeScalars)
                out.append(hex[Int(s.value >> 4 & 15)])
                out.append(hex[Int(s.value & 15)])
            }
        }
        return String(out)
    }
}
