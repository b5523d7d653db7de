/// The origin of a URL (`scheme://host:port`) and the one rule for where secrets may go.
///
/// Every decision "may a token travel to this URL?" is made here (docs/security.md,
/// "Credentials"): https anywhere, plain http only to a loopback host, never to a URL that
/// carries a user name (`http://127.0.0.1:x@evil/` names the host `evil`, not 127.0.0.1),
/// never without a scheme.
public struct URLOrigin: Sendable, Equatable {
    /// Lower-cased: `http` or `https` (other schemes do not parse).
    public var scheme: String
    /// Lower-cased; IPv6 without brackets.
    public var host: String
    public var port: Int?
    /// The authority had a `user[:password]@` part.
    public var hasUserInfo: Bool

    /// Parses `scheme://[userinfo@]host[:port][/path][?query][#fragment]`; nil for anything
    /// else, including other schemes and scheme-less text.
    public init?(_ url: String) {
        guard let sep = url.range(of: "://") else { return nil }
        let scheme = url[..<sep.lowerBound].lowercased()
        guard scheme == "http" || scheme == "https" else { return nil }
        let rest = url[sep.upperBound...]
        let authority = rest.prefix { $0 != "/" && $0 != "?" && $0 != "#" && $0 != "\\" }
        var hostPort = authority
        hasUserInfo = false
        if let at = authority.lastIndex(of: "@") {
            hasUserInfo = true
            hostPort = authority[authority.index(after: at)...]
        }
        var host: Substring
        var portText: Substring?
        if hostPort.hasPrefix("[") {
            guard let close = hostPort.firstIndex(of: "]") else { return nil }
            host = hostPort[hostPort.index(after: hostPort.startIndex)..<close]
            let after = hostPort[hostPort.index(after: close)...]
            if !after.isEmpty {
                guard after.hasPrefix(":") else { return nil }
                portText = after.dropFirst()
            }
        } else {
            let parts = hostPort.split(separator: ":", maxSplits: 1, omittingEmptySubsequences: false)
            host = parts[0]
            portText = parts.count > 1 ? parts[1] : nil
        }
        guard !host.isEmpty else { return nil }
        if let portText {
            guard let p = Int(portText), (1...65535).contains(p) else { return nil }
            port = p
        } else {
            port = nil
        }
        self.scheme = scheme
        self.host = host.lowercased()
    }

    /// `localhost`, `127.0.0.0/8` in dotted form, or `::1`: this machine.
    public var isLoopback: Bool {
        if host == "localhost" || host == "::1" || host == "0:0:0:0:0:0:0:1" { return true }
        let octets = host.split(separator: ".", omittingEmptySubsequences: false)
        guard octets.count == 4, octets.allSatisfy({ !$0.isEmpty && $0.count <= 3 && $0.allSatisfy(\.isASCII) && UInt8($0) != nil }) else {
            return false
        }
        return octets[0] == "127"
    }

    /// Why secrets (tokens, passwords, key grants) must not be sent to `url`, or nil when they may.
    public static func refusalToSendSecrets(to url: String) -> String? {
        guard let o = URLOrigin(url) else {
            return "\(HTTPClient.origin(of: url)) is not an http:// or https:// URL"
        }
        if o.hasUserInfo {
            return "the URL \(HTTPClient.origin(of: url)) carries a user name (user@host): credentials come from options, never from URLs"
        }
        if o.scheme == "http" && !o.isLoopback {
            return "refusing to send credentials over plain http to \(HTTPClient.origin(of: url)): use https, a loopback endpoint, or -o anonymous"
        }
        return nil
    }
}
