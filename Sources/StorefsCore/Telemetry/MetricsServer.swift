import Foundation
import Glibc

/// `metrics=ADDRESS:PORT`: Prometheus text at `GET /metrics` (docs/operations.md, "Metrics").
///
/// Bound before daemonizing (a taken port is an error at the prompt), served after on one
/// thread, one connection at a time: a scrape is a few kilobytes, and a client that sends
/// nothing, or too much, is dropped after `timeout` seconds or `maxRequest` bytes. Only
/// GET (and HEAD) of `/metrics` is answered; nothing a client sends changes anything.
public final class MetricsServer: @unchecked Sendable {
    public struct Refused: Error, Sendable {
        public let message: String
    }

    static let maxRequest = 8192
    static let timeout = 5

    private let fd: Int32
    public let port: Int

    /// Binds `host:port` (IPv4; `localhost` is 127.0.0.1). Port 0 takes a free one.
    public init(host: String, port: Int) throws(Refused) {
        var addr = sockaddr_in()
        addr.sin_family = sa_family_t(AF_INET)
        addr.sin_port = in_port_t(UInt16(port).bigEndian)
        let numeric = host == "localhost" ? "127.0.0.1" : host
        guard inet_pton(AF_INET, numeric, &addr.sin_addr) == 1 else {
            throw Refused(message: "metrics=\(host):\(port): \(host) is not an IPv4 address such as 127.0.0.1")
        }
        let fd = socket(AF_INET, Int32(SOCK_STREAM.rawValue) | Int32(SOCK_CLOEXEC.rawValue), 0)
        guard fd >= 0 else { throw Refused(message: "metrics: cannot make a socket: \(String(cString: strerror(errno)))") }
        var one: Int32 = 1
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, socklen_t(MemoryLayout<Int32>.size))
        let bound = withUnsafePointer(to: &addr) {
            $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { bind(fd, $0, socklen_t(MemoryLayout<sockaddr_in>.size)) }
        }
        guard bound == 0, listen(fd, 16) == 0 else {
            let why = String(cString: strerror(errno))
            close(fd)
            throw Refused(message: "metrics=\(host):\(port): cannot listen there: \(why) (choose another port)")
        }
        var actual = sockaddr_in()
        var length = socklen_t(MemoryLayout<sockaddr_in>.size)
        _ = withUnsafeMutablePointer(to: &actual) {
            $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { getsockname(fd, $0, &length) }
        }
        self.fd = fd
        self.port = Int(UInt16(bigEndian: actual.sin_port))
    }

    /// Serves scrapes on a thread of its own (start it after daemonizing).
    public func start(render: @escaping @Sendable () -> String) {
        let thread = Thread { [self] in
            while true {
                let client = accept(fd, nil, nil)
                if client < 0 {
                    if errno == EINTR || errno == ECONNABORTED || errno == EMFILE || errno == ENFILE { usleep(10_000); continue }
                    Log.error("metrics: accept failed, no more scrapes", ["error": String(cString: strerror(errno))])
                    return
                }
                _ = fcntl(client, F_SETFD, FD_CLOEXEC)
                serve(client, render: render)
                close(client)
            }
        }
        thread.name = "storefs-metrics"
        thread.start()
    }

    private func serve(_ client: Int32, render: () -> String) {
        var tv = timeval(tv_sec: Self.timeout, tv_usec: 0)
        setsockopt(client, SOL_SOCKET, SO_RCVTIMEO, &tv, socklen_t(MemoryLayout<timeval>.size))
        setsockopt(client, SOL_SOCKET, SO_SNDTIMEO, &tv, socklen_t(MemoryLayout<timeval>.size))
        guard let request = Self.readHead(client) else { return }
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
            let n = bytes.withUnsafeBytes { send(client, $0.baseAddress! + sent, bytes.count - sent, Int32(MSG_NOSIGNAL)) }
            if n <= 0 { return }
            sent += n
        }
    }

    /// The request's head (up to the blank line), or nil if it did not come whole in time
    /// and within `maxRequest` bytes.
    static func readHead(_ client: Int32) -> [UInt8]? {
        var buffer = [UInt8](repeating: 0, count: maxRequest)
        var used = 0
        let end: [UInt8] = [13, 10, 13, 10]
        while used < maxRequest {
            let n = buffer.withUnsafeMutableBytes { recv(client, $0.baseAddress! + used, maxRequest - used, 0) }
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
}
