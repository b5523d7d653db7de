import Foundation
import Glibc
import StorageClient
import Synchronization
import Locking

/// `metrics=ADDRESS:PORT` or `metrics=unix:PATH`: Prometheus text at `GET /metrics`
/// (docs/operations.md, "Metrics"; docs/security.md, "Local users on an allow_other mount").
///
/// - **A TCP port** is open to every local user (nothing authenticates a scrape). A port that
///   cannot be bound (another process holds it, say one that grabbed it while storefs was
///   restarting) does not keep the mount down: it is a warning, and the port is tried again
///   every `retrySeconds` until it is free.
/// - **A unix socket** (`unix:PATH`) is mode 0660: the mounting user and its group. Its
///   directory must exist; a stale socket of ours is replaced, anything else at PATH refuses
///   the mount (a file someone else put there is never removed).
///
/// Scrapes are served by `servers` threads at once, each bounded by one `deadline` for the
/// whole request (a client trickling a byte every few seconds is dropped when it runs out,
/// not kept alive by each byte) and `maxRequest` bytes. Only GET (and HEAD) of `/metrics` is
/// answered; nothing a client sends changes anything.
public final class MetricsServer: @unchecked Sendable {
    public struct Refused: Error, Sendable {
        public let message: String
    }

    /// Where scrapes come in.
    public enum Address: Sendable, Equatable {
        case tcp(host: String, port: Int)
        case unix(path: String)

        var text: String {
            switch self {
            case .tcp(let host, let port): return "\(host):\(port)"
            case .unix(let path): return "unix:\(path)"
            }
        }
    }

    static let maxRequest = 8192
    /// Seconds one scrape may take from accept to the last byte sent.
    static let deadline = 5.0
    /// Threads serving scrapes at once.
    static let servers = 4
    /// Seconds between tries of a TCP port that could not be bound.
    static let retrySeconds = 10.0

    public let address: Address
    /// The listening socket and the TCP port it has (port 0 asks for a free one: this says
    /// which), once bound: set once, by `init` or the retry thread, then only read.
    private let listener = OrderedMutex<(fd: Int32, port: Int)>(.metricsServer, (-1, 0))
    /// Why the TCP port could not be bound at mount (a warning then; `start` keeps trying).
    public let bindProblem: String?

    /// The TCP port listened on; 0 while not bound, or for a unix socket.
    public var port: Int { listener.withLock { $0.port } }

    /// Binds `address`. A unix socket that cannot be made, or an address that is not an IPv4
    /// one, is refused; a TCP bind failure is kept in `bindProblem` and retried from `start`.
    public init(_ address: Address) throws(Refused) {
        self.address = address
        switch address {
        case .tcp(let host, let port):
            var addr = sockaddr_in()
            guard inet_pton(AF_INET, host == "localhost" ? "127.0.0.1" : host, &addr.sin_addr) == 1 else {
                throw Refused(message: "metrics=\(host):\(port): \(host) is not an IPv4 address such as 127.0.0.1")
            }
            switch Self.bindTCP(addr: addr, port: port) {
            case .success(let bound):
                listener.withLock { $0 = bound }
                bindProblem = nil
            case .failure(let why):
                bindProblem = "metrics=\(host):\(port): cannot listen there (\(why.message)): retrying every \(Int(Self.retrySeconds)) s; choose another port if it stays taken"
            }
        case .unix(let path):
            let fd = try Self.bindUnix(path)
            listener.withLock { $0 = (fd, 0) }
            bindProblem = nil
        }
    }

    deinit {
        let fd = listener.withLock { $0.fd }
        if fd >= 0 { close(fd) }
    }

    private static func bindTCP(addr: sockaddr_in, port: Int) -> Result<(fd: Int32, port: Int), Refused> {
        var addr = addr
        addr.sin_family = sa_family_t(AF_INET)
        addr.sin_port = in_port_t(UInt16(port).bigEndian)
        let fd = socket(AF_INET, Int32(SOCK_STREAM.rawValue) | Int32(SOCK_CLOEXEC.rawValue), 0)
        guard fd >= 0 else { return .failure(Refused(message: errnoText())) }
        var one: Int32 = 1
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, socklen_t(MemoryLayout<Int32>.size))
        let bound = withUnsafePointer(to: &addr) {
            $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { bind(fd, $0, socklen_t(MemoryLayout<sockaddr_in>.size)) }
        }
        guard bound == 0, listen(fd, 64) == 0 else {
            let why = errnoText()
            close(fd)
            return .failure(Refused(message: why))
        }
        var actual = sockaddr_in()
        var length = socklen_t(MemoryLayout<sockaddr_in>.size)
        _ = withUnsafeMutablePointer(to: &actual) {
            $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { getsockname(fd, $0, &length) }
        }
        return .success((fd: fd, port: Int(UInt16(bigEndian: actual.sin_port))))
    }

    /// A listening unix socket at `path`, mode 0660. A socket left there by an earlier run of
    /// this user is replaced; anything else (a file, a link, someone else's socket) refuses.
    static func bindUnix(_ path: String) throws(Refused) -> Int32 {
        var addr = sockaddr_un()
        addr.sun_family = sa_family_t(AF_UNIX)
        let bytes = Array(path.utf8)
        let room = MemoryLayout.size(ofValue: addr.sun_path)
        guard path.hasPrefix("/"), bytes.count < room else {
            throw Refused(message: "metrics=unix:\(path): give an absolute path of at most \(room - 1) bytes")
        }
        var st = stat()
        if lstat(path, &st) == 0 {
            guard st.st_mode & S_IFMT == S_IFSOCK, st.st_uid == geteuid() else {
                throw Refused(message: "metrics=unix:\(path): something that is not a socket of this user is there already: remove it or choose another path")
            }
        }
        withUnsafeMutableBytes(of: &addr.sun_path) { raw in
            raw.copyBytes(from: bytes)
            raw[bytes.count] = 0
        }
        if st.st_mode & S_IFMT == S_IFSOCK {
            guard !isListenedOn(addr) else {
                throw Refused(message: "metrics=unix:\(path): another process serves that socket: choose another path")
            }
            unlink(path)  // ours, left by a run that ended without cleaning up
        }
        let fd = socket(AF_UNIX, Int32(SOCK_STREAM.rawValue) | Int32(SOCK_CLOEXEC.rawValue), 0)
        guard fd >= 0 else { throw Refused(message: "metrics=unix:\(path): cannot make a socket: \(errnoText())") }
        // Made 0660 from the start (no window in which it is wider), owner and group.
        let oldMask = umask(0o117)
        let bound = withUnsafePointer(to: &addr) {
            $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { bind(fd, $0, socklen_t(MemoryLayout<sockaddr_un>.size)) }
        }
        umask(oldMask)
        guard bound == 0, listen(fd, 64) == 0 else {
            let why = errnoText()
            close(fd)
            throw Refused(message: "metrics=unix:\(path): cannot listen there: \(why)")
        }
        return fd
    }

    /// Whether something accepts connections on the unix socket `addr`.
    private static func isListenedOn(_ addr: sockaddr_un) -> Bool {
        var addr = addr
        let fd = socket(AF_UNIX, Int32(SOCK_STREAM.rawValue) | Int32(SOCK_CLOEXEC.rawValue), 0)
        guard fd >= 0 else { return false }
        defer { close(fd) }
        return withUnsafePointer(to: &addr) {
            $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { connect(fd, $0, socklen_t(MemoryLayout<sockaddr_un>.size)) }
        } == 0
    }

    /// Serves scrapes (start it after daemonizing); a TCP port not bound yet is tried again
    /// every `retrySeconds` first.
    public func start(render: @escaping @Sendable () -> String) {
        let retry = Thread { [self] in
            while listener.withLock({ $0.fd }) < 0 {
                Thread.sleep(forTimeInterval: Self.retrySeconds)
                guard case .tcp(let host, let port) = address else { return }
                var addr = sockaddr_in()
                _ = inet_pton(AF_INET, host == "localhost" ? "127.0.0.1" : host, &addr.sin_addr)
                if case .success(let bound) = Self.bindTCP(addr: addr, port: port) {
                    listener.withLock { $0 = bound }
                    Log.info("metrics: now listening", ["address": address.text])
                }
            }
            for i in 0..<Self.servers {
                let thread = Thread { [self] in acceptLoop(render: render) }
                thread.name = "storefs-metrics-\(i)"
                thread.start()
            }
        }
        retry.name = "storefs-metrics"
        retry.start()
    }

    private func acceptLoop(render: @escaping @Sendable () -> String) {
        let fd = listener.withLock { $0.fd }
        while true {
            let client = accept(fd, nil, nil)
            if client < 0 {
                if errno == EINTR || errno == ECONNABORTED || errno == EMFILE || errno == ENFILE { usleep(10_000); continue }
                Log.error("metrics: accept failed, no more scrapes on this thread", ["error": Self.errnoText()])
                return
            }
            _ = fcntl(client, F_SETFD, FD_CLOEXEC)
            serve(client, render: render)
            close(client)
        }
    }

    private func serve(_ client: Int32, render: () -> String) {
        let deadline = monotonicNow() + Self.deadline
        guard let request = Self.readHead(client, deadline: deadline) else { return }
        let answer: (status: String, body: String, head: Bool)
        switch Self.route(request) {
        case .metrics(let head): answer = ("200 OK", render(), head)
        case .notFound: answer = ("404 Not Found", "not found: storefs serves GET /metrics\n", false)
        case .badMethod: answer = ("405 Method Not Allowed", "only GET and HEAD\n", false)
        }
        let body = Array(answer.body.utf8)
        let head = "HTTP/1.1 \(answer.status)\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
            + "Content-Length: \(body.count)\r\nConnection: close\r\n\r\n"
        var bytes = Array(head.utf8)
        if !answer.head { bytes += body }
        var sent = 0
        while sent < bytes.count {
            guard Self.wait(client, for: Int16(POLLOUT), until: deadline) else { return }
            let n = bytes.withUnsafeBytes { send(client, $0.baseAddress! + sent, bytes.count - sent, Int32(MSG_NOSIGNAL | MSG_DONTWAIT)) }
            if n < 0 && (errno == EAGAIN || errno == EINTR) { continue }
            if n <= 0 { return }
            sent += n
        }
    }

    /// Whether `client` became ready for `events` before `deadline` (monotonic seconds).
    static func wait(_ client: Int32, for events: Int16, until deadline: Double) -> Bool {
        while true {
            let left = deadline - monotonicNow()
            if left <= 0 { return false }
            var p = pollfd(fd: client, events: events, revents: 0)
            let n = poll(&p, 1, Int32(max(1, (left * 1000).rounded(.up))))
            if n > 0 { return true }
            if n < 0 && errno == EINTR { continue }
            return false
        }
    }

    /// The request's head (up to the blank line), or nil if it did not come whole before
    /// `deadline` and within `maxRequest` bytes.
    static func readHead(_ client: Int32, deadline: Double) -> [UInt8]? {
        var buffer = [UInt8](repeating: 0, count: maxRequest)
        var used = 0
        let end: [UInt8] = [13, 10, 13, 10]
        while used < maxRequest {
            guard wait(client, for: Int16(POLLIN), until: deadline) else { return nil }
            let n = buffer.withUnsafeMutableBytes { recv(client, $0.baseAddress! + used, maxRequest - used, Int32(MSG_DONTWAIT)) }
            if n < 0 && (errno == EAGAIN || errno == EINTR) { continue }
            if n <= 0 { return nil }
            used += n
            if used >= 4, buffer[0..<used].firstRange(of: end) != nil { return Array(buffer[0..<used]) }
            if buffer[0..<used].firstRange(of: [10, 10]) != nil { return Array(buffer[0..<used]) }
        }
        return nil
    }

    enum Route: Equatable { case metrics(head: Bool), notFound, badMethod }

    /// What the request line asks for: `GET /metrics` (a query string is ignored).
    static func route(_ head: [UInt8]) -> Route {
        let line = head.prefix { $0 != 13 && $0 != 10 }
        let parts = line.split(separator: 32)
        guard parts.count >= 2 else { return .notFound }
        let method = String(decoding: parts[0], as: UTF8.self)
        let target = String(decoding: parts[1], as: UTF8.self)
        guard method == "GET" || method == "HEAD" else { return .badMethod }
        let path = target.split(separator: "?", maxSplits: 1, omittingEmptySubsequences: false).first.map(String.init) ?? ""
        return path == "/metrics" ? .metrics(head: method == "HEAD") : .notFound
    }

    private static func errnoText() -> String { String(cString: strerror(errno)) }
}
