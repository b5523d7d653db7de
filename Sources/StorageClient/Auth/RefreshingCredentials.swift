import Foundation
import Glibc
import Synchronization
import Locking

/// A bearer-style token and when it stops being valid (wall clock, seconds since the epoch).
public struct AccessToken: Sendable {
    public var value: String
    public var expiresAt: Double

    public init(value: String, expiresAt: Double) {
        self.value = value
        self.expiresAt = expiresAt
    }
}

func wallClock() -> Double {
    var ts = timespec()
    clock_gettime(CLOCK_REALTIME, &ts)
    return Double(ts.tv_sec) + Double(ts.tv_nsec) / 1e9
}

/// Credentials whose token comes from a token service and is renewed before it expires:
/// about 5 minutes early (as the iOS SDK does) and once, forced, after a 401. One refresh at
/// a time; concurrent callers wait for it instead of stampeding the token service.
///
/// A token that a 401 forced and that is itself turned away within `forcedRefreshSpacing`
/// (30 s) is not renewed again: a server that refuses a token just renewed refuses the
/// credentials, not the token's age, and every request after the first refresh carried the
/// fresh token, so each one's 401 forced a refresh of its own (one per file read while the
/// server refused them all). The caller's 401 stands (`EACCES`), and the next forced refresh
/// may come once the spacing has passed.
public final class RefreshingCredentials: Credentials {
    public static let refreshMargin: Double = 300

    private let scheme: String
    private let fetch: @Sendable (_ previous: AccessToken?) throws(StorageError) -> AccessToken
    private let current = OrderedMutex<AccessToken?>(.credentialsCurrent, nil)
    /// One refresh at a time, held across the token service's request (network I/O): callers
    /// that need a token wait for the refresh under way instead of each asking (a storm of
    /// refreshes after an expiry), within that request's own time bound (30 s).
    private let refreshing = OrderedLock(.credentialRefresh)
    /// The header value of the last token a rejection forced, and when (monotonic seconds).
    private let lastForced = OrderedMutex<(value: String, at: Double)?>(.credentialsLastForced, nil)
    private let forcedRefreshSpacing: Double
    /// What these credentials are, for messages ("service account x@y").
    public let label: String

    public init(scheme: String, label: String, forcedRefreshSpacing: Double = 30,
                fetch: @escaping @Sendable (_ previous: AccessToken?) throws(StorageError) -> AccessToken) {
        self.scheme = scheme
        self.label = label
        self.forcedRefreshSpacing = forcedRefreshSpacing
        self.fetch = fetch
    }

    public var sendsSecrets: Bool { true }

    public func authorization(rejected: String?) throws(StorageError) -> String? {
        let seen = current.withLock { $0 }
        if let seen, seen.expiresAt - wallClock() > Self.refreshMargin,
           rejected == nil || "\(scheme) \(seen.value)" != rejected {
            return "\(scheme) \(seen.value)"
        }
        refreshing.lock()
        defer { refreshing.unlock() }
        // Someone else may have refreshed while we waited for the lock: a token that is not the
        // one rejected (or not the stale one we saw) is fresh enough.
        let now = current.withLock { $0 }
        if let now, now.expiresAt - wallClock() > Self.refreshMargin,
           "\(scheme) \(now.value)" != (rejected ?? seen.map { "\(scheme) \($0.value)" }) {
            return "\(scheme) \(now.value)"
        }
        if let rejected, let now, now.expiresAt - wallClock() > Self.refreshMargin,
           let forced = lastForced.withLock({ $0 }), forced.value == rejected,
           monotonicNow() - forced.at < forcedRefreshSpacing {
            return rejected  // nothing newer to offer: the 401 stands
        }
        let fresh = try fetch(now)
        current.withLock { $0 = fresh }
        if rejected != nil { lastForced.withLock { $0 = ("\(scheme) \(fresh.value)", monotonicNow()) } }
        AuthLog.debugAuth("credentials=\(label) refreshed, valid for \(Int(fresh.expiresAt - wallClock()))s")
        return "\(scheme) \(fresh.value)"
    }
}

/// StorageClient has no logger of its own: the executable installs a sink for auth events
/// (which never carry secrets).
public enum AuthLog {
    nonisolated(unsafe) public static var authSink: (@Sendable (String) -> Void)? = nil
    static func debugAuth(_ message: String) { authSink?(message) }
}
