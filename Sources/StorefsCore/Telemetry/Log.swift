import Foundation
import Glibc
import StorageClient
import Synchronization
import Locking

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

/// `log_format=`.
public enum LogFormat: String, Sendable {
    /// `ts=… level=… msg="…" key=value …` (logfmt).
    case text
    /// One JSON object per line: `{"ts":…,"level":…,"msg":…,"key":value,…}`.
    case json
}

/// storefs's logger (docs/operations.md, "Logs"): a constant message with `key=value` fields,
/// one line each, with an RFC 3339 UTC timestamp in milliseconds and the level. It writes to
/// stderr in the foreground, to `log_file=` when given (reopened on SIGHUP), else to syslog
/// once daemonized. Repeats of one warning or error within `repeatWindow` become one line
/// with a count. Callers never pass tokens, keys, passwords or signed URLs.
public enum Log {
    private enum Destination { case stderr, syslog, file }

    private struct Repeat {
        var since: Double
        var suppressed: Int
        let level: LogLevel
        let message: String
        let fields: [(String, String)]
    }

    private struct State: ~Copyable {
        var format = LogFormat.text
        var destination = Destination.stderr
        var file: LogFile? = nil
        var repeats: [String: Repeat] = [:]
        var flusher = false
    }

    private static let state = OrderedMutex(.log, State())
    /// The level, read on every call: an atomic, so a disabled debug line costs a load.
    private static let level = Atomic<Int>(LogLevel.info.rawValue)

    /// Identical warnings and errors within this many seconds are logged once, then counted.
    public static let repeatWindow = 10.0
    /// Distinct repeating lines tracked at once; past it, new lines are not limited.
    static let maxTrackedRepeats = 1024
    /// Fields that differ between otherwise identical failures (not part of "identical").
    static let volatileFields: Set<String> = ["offset", "dur_ms", "bytes", "attempt"]

    public static func configure(level: LogLevel, format: LogFormat = .text) {
        self.level.store(level.rawValue, ordering: .relaxed)
        state.withLock { $0.format = format }
    }

    /// Lines go to `file` from now on (opened at start-up, before daemonizing, so a bad path
    /// is reported at the prompt).
    public static func use(file: LogFile) {
        state.withLock {
            $0.file = file
            $0.destination = .file
        }
    }

    /// Called once daemonized, when stderr goes nowhere: syslog, unless a log file is in use.
    public static func daemonized() {
        let toSyslog = state.withLock { s -> Bool in
            guard s.destination == .stderr else { return false }
            s.destination = .syslog
            return true
        }
        if toSyslog { openlog("storefs", LOG_PID, LOG_DAEMON) }
    }

    /// Reopens `log_file=` (SIGHUP, after logrotate moved it) in the directory it was first
    /// opened in (`LogFile.reopened`). On failure the old file stays in use and the reason is
    /// logged there.
    public static func reopen() {
        let result: Result<String, LogFile.Refused>? = state.withLock { s in
            guard let old = s.file else { return nil }
            do throws(LogFile.Refused) {
                let fresh = try old.reopened()
                s.file = fresh
                old.close()
                return .success(old.path)
            } catch {
                return .failure(error)
            }
        }
        switch result {
        case .success(let path)?: info("log file reopened", ["path": path])
        case .failure(let refused)?: error("cannot reopen the log file; still writing to the old one", ["error": refused.message])
        case nil: break
        }
    }

    /// Starts the thread that writes out counts of suppressed repeats (after daemonizing:
    /// fork keeps no thread).
    public static func startBackground() {
        let start = state.withLock { s -> Bool in
            defer { s.flusher = true }
            return !s.flusher
        }
        guard start else { return }
        let thread = Thread {
            while true {
                Thread.sleep(forTimeInterval: 1)
                flushRepeats(now: monotonicNow(), all: false)
            }
        }
        thread.name = "storefs-log"
        thread.start()
    }

    public static func enabled(_ level: LogLevel) -> Bool { level.rawValue <= self.level.load(ordering: .relaxed) }

    public static func error(_ message: @autoclosure () -> String, _ fields: @autoclosure () -> KeyValuePairs<String, String> = [:]) {
        emit(.error, message, fields)
    }
    public static func warn(_ message: @autoclosure () -> String, _ fields: @autoclosure () -> KeyValuePairs<String, String> = [:]) {
        emit(.warn, message, fields)
    }
    public static func info(_ message: @autoclosure () -> String, _ fields: @autoclosure () -> KeyValuePairs<String, String> = [:]) {
        emit(.info, message, fields)
    }
    public static func debug(_ message: @autoclosure () -> String, _ fields: @autoclosure () -> KeyValuePairs<String, String> = [:]) {
        emit(.debug, message, fields)
    }
    public static func trace(_ message: @autoclosure () -> String, _ fields: @autoclosure () -> KeyValuePairs<String, String> = [:]) {
        emit(.trace, message, fields)
    }

    /// A line whose fields are built at run time (check `enabled` first when they cost).
    public static func log(_ level: LogLevel, _ message: String, fields: [(String, String)]) {
        guard enabled(level) else { return }
        if level <= .warn, !admitRepeat(level, message, fields, now: monotonicNow()) { return }
        write(level, message, fields)
    }

    private static func emit(_ level: LogLevel, _ message: () -> String, _ fields: () -> KeyValuePairs<String, String>) {
        guard enabled(level) else { return }
        let msg = message()
        let pairs = fields().map { ($0.key, $0.value) }
        if level <= .warn, !admitRepeat(level, msg, pairs, now: monotonicNow()) { return }
        write(level, msg, pairs)
    }

    /// Whether a warning or error is written now: false while an identical one was written
    /// less than `repeatWindow` ago (it is counted instead).
    private static func admitRepeat(_ level: LogLevel, _ msg: String, _ fields: [(String, String)], now: Double) -> Bool {
        var key = level.name + "\u{0}" + msg
        for (k, v) in fields where !volatileFields.contains(k) { key += "\u{0}\(k)=\(v)" }
        let (admit, summary) = state.withLock { s -> (Bool, Repeat?) in
            if var r = s.repeats[key] {
                if now - r.since < repeatWindow {
                    r.suppressed += 1
                    s.repeats[key] = r
                    return (false, nil)
                }
                s.repeats[key] = Repeat(since: now, suppressed: 0, level: level, message: msg, fields: fields)
                return (true, r.suppressed > 0 ? r : nil)
            }
            if s.repeats.count < maxTrackedRepeats {
                s.repeats[key] = Repeat(since: now, suppressed: 0, level: level, message: msg, fields: fields)
            }
            return (true, nil)
        }
        if let summary { writeSummary(summary) }
        return admit
    }

    /// Writes the counts of repeats whose window has closed (`all`: every count, at once).
    static func flushRepeats(now: Double, all: Bool) {
        let due = state.withLock { s -> [Repeat] in
            var out: [Repeat] = []
            for (key, r) in s.repeats where all || now - r.since >= repeatWindow {
                if r.suppressed > 0 { out.append(r) }
                s.repeats.removeValue(forKey: key)
            }
            return out
        }
        for r in due { writeSummary(r) }
    }

    private static func writeSummary(_ r: Repeat) {
        write(r.level, r.message, r.fields + [("repeated", String(r.suppressed)), ("window_s", String(Int(repeatWindow)))])
    }

    private static func write(_ level: LogLevel, _ msg: String, _ fields: [(String, String)]) {
        state.withLock { s in
            let withTime = s.destination != .syslog  // syslog stamps its own time
            let line = s.format == .json
                ? LogLine.json(time: withTime ? LogLine.timestamp() : nil, level: level.name, message: msg, fields: fields)
                : LogLine.text(time: withTime ? LogLine.timestamp() : nil, level: level.name, message: msg, fields: fields)
            switch s.destination {
            case .syslog:
                withVaList([line]) { vsyslog(level.syslogPriority, "%s", $0) }
            case .file:
                s.file?.write(line + "\n")
            case .stderr:
                let out = line + "\n"
                _ = out.withCString { Glibc.write(2, $0, strlen($0)) }
            }
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
