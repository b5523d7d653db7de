import Glibc
import Synchronization

/// What one HTTP exchange was for: the label of request counters and latency histograms
/// (docs/operations.md, "Metrics").
public enum RequestKind: String, Sendable, CaseIterable {
    /// A listing page (`…/o?prefix=…`).
    case list
    /// An object's or the bucket's resource (JSON).
    case metadata
    /// Object bytes (`alt=media`, ranged reads).
    case media
    /// Token services (sign-in, refresh, the metadata server).
    case token

    /// The kind of a request, from its method and URL (never from anything secret in it).
    static func of(url: String, isPost: Bool, isRanged: Bool) -> RequestKind {
        if isPost { return .token }
        // Every part of a read is ranged, and none goes to the metadata server: decided before
        // any search of the URL.
        if isRanged { return .media }
        if url.contains("computeMetadata") { return .token }
        let queryStart = url.firstIndex(of: "?") ?? url.endIndex
        let query = url[queryStart...]
        if query.contains("alt=media") { return .media }
        if url[..<queryStart].hasSuffix("/o") { return .list }
        return .metadata
    }
}

/// One finished (or failed) HTTP exchange, as the daemon's logs and metrics see it.
public struct HTTPExchangeRecord: Sendable {
    public var method: String
    public var kind: RequestKind
    /// The whole URL, query too (a key or a token may be in it): seen in this module only;
    /// logs and metrics get `target`.
    let url: String
    /// `scheme://host:port/path` without the query or a user:password, made when a log line
    /// asks for it, not for every request.
    public var target: String { StorageTelemetry.target(of: url) }
    /// The HTTP status; 0 when no answer came (refused, reset, timed out, cancelled).
    public var status: Int
    /// Body bytes received.
    public var bytes: Int
    public var seconds: Double
    /// 1 for the first try of an operation, 2 for its first retry, and so on.
    public var attempt: Int
    /// Why it failed when no status came.
    public var failure: String?
    /// "1.1" or "2": the HTTP version of the answer; empty when none came.
    public var httpVersion = ""
}

/// Hooks through which the daemon counts and logs what the storage client does. Set once at
/// start-up, before any request thread exists; nil hooks cost nothing.
public enum StorageTelemetry {
    nonisolated(unsafe) public static var onExchange: (@Sendable (HTTPExchangeRecord) -> Void)? = nil
    /// A failed try that will be tried again (after the backoff).
    nonisolated(unsafe) public static var onRetry: (@Sendable (StorageError) -> Void)? = nil

    /// `url` without its query or fragment, and without any user:password part.
    static func target(of url: String) -> String {
        let end = url.firstIndex(where: { $0 == "?" || $0 == "#" }) ?? url.endIndex
        let path = url[..<end]
        guard let r = path.range(of: "://") else { return String(path) }
        let rest = path[r.upperBound...]
        let slash = rest.firstIndex(of: "/") ?? rest.endIndex
        if let at = rest[..<slash].lastIndex(of: "@") {
            return String(path[..<r.upperBound]) + rest[rest.index(after: at)...]
        }
        return String(path)
    }
}

/// How many answers one store has had from its server that say it serves requests (any but
/// 408, 429 and 5xx): a failing operation that sees the count move knows the bucket answers
/// others, and that its own failures are a flaky request, not an outage (`RetryPolicy`).
public final class AnswerCount: Sendable {
    private let count = Atomic<UInt64>(0)

    public init() {}

    public func note() { count.add(1, ordering: .relaxed) }

    public var value: UInt64 { count.load(ordering: .relaxed) }
}

/// The fastest first byte of any answer one store has had from its server (a lookup, the
/// start-up listing, a download): how far the server is, before any download has said. One per
/// store, so one mount (or one test) never reads another's distance; token services, which
/// may be much nearer than the bucket (a metadata server), never count.
public final class FastestAnswer: Sendable {
    private let bits = Atomic<UInt64>(0)

    public init() {}

    /// An answer's first byte came after `seconds`. A busy machine or server can make any one
    /// answer slow, but nothing makes a far server answer faster than its distance.
    public func note(_ seconds: Double) {
        guard seconds > 0, seconds.isFinite else { return }
        var seen = bits.load(ordering: .relaxed)
        while seen == 0 || seconds < Double(bitPattern: seen) {
            let (done, now) = bits.compareExchange(expected: seen, desired: seconds.bitPattern, ordering: .relaxed)
            if done { break }
            seen = now
        }
    }

    /// Seconds to the fastest first byte yet; nil before any answer.
    public var seconds: Double? {
        let b = bits.load(ordering: .relaxed)
        return b == 0 ? nil : Double(bitPattern: b)
    }
}
