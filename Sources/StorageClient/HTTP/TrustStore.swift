internal import CCurl
import Glibc

/// The CA certificates https connections are verified against (docs/security.md, "TLS").
///
/// Parsed once per process and handed to every new TLS context (ccurl.h says why: OpenSSL 3
/// spends ~20 ms of CPU on the system bundle, and libcurl would parse it again for every new
/// connection). Where the certificates come from, first match wins:
/// 1. `ca_file=PATH`: a PEM bundle trusted *instead of* the system store;
/// 2. `CURL_CA_BUNDLE`, then `SSL_CERT_FILE`, from the environment, as curl, Python and Go
///    honour them;
/// 3. the system store: libcurl's default bundle (Debian: /etc/ssl/certs/ca-certificates.crt),
///    or its certificate directory when there is no bundle.
/// Verification of the peer and of its host name is always on; nothing turns it off.
public final class TrustStore: @unchecked Sendable {
    /// The OpenSSL X509_STORE; never changed after loading (OpenSSL locks its own lookups).
    let store: UnsafeMutableRawPointer
    /// Where the certificates came from, for `-d` logs: "ca_file=/etc/x.pem (2 certificates)".
    public let summary: String

    private init(store: UnsafeMutableRawPointer, summary: String) {
        self.store = store
        self.summary = summary
    }

    deinit { ccurl_trust_free(store) }

    /// The store the options and environment choose (see the type's comment). A named file
    /// is loaded now, so a bad one is an error at the prompt; nil means the system store,
    /// which `HTTPClient` loads at its first https request.
    public static func chosen(caFile: String?, environment: [String: String]) throws(StorageError) -> TrustStore? {
        if let caFile { return try load(file: caFile, named: "ca_file=\(caFile)") }
        for variable in ["CURL_CA_BUNDLE", "SSL_CERT_FILE"] {
            if let path = environment[variable], !path.isEmpty {
                return try load(file: path, named: "\(variable)=\(path) (from the environment)")
            }
        }
        return nil
    }

    /// Every certificate of the PEM file at `path`; `name` says in errors where the path came from.
    public static func load(file path: String, named name: String) throws(StorageError) -> TrustStore {
        var st = stat()
        guard stat(path, &st) == 0 else {
            let reason = String(cString: strerror(errno))
            throw StorageError(.invalidArgument, "\(name): cannot read it (\(reason)): give a PEM file of the CA certificates to trust")
        }
        guard st.st_mode & S_IFMT == S_IFREG else {
            throw StorageError(.invalidArgument, "\(name) is not a regular file: give a PEM file (a bundle of CA certificates)")
        }
        guard access(path, R_OK) == 0 else {
            let reason = String(cString: strerror(errno))
            throw StorageError(.invalidArgument, "\(name): cannot read it (\(reason)): give a PEM file of the CA certificates to trust")
        }
        var count: Int32 = 0
        var reason = [CChar](repeating: 0, count: 512)
        guard let store = ccurl_trust_load_file(path, &count, &reason, reason.count) else {
            let why = Self.text(reason)
            if why.hasPrefix("it holds no PEM certificate") {
                throw StorageError(.invalidArgument, "\(name) holds no PEM certificate (-----BEGIN CERTIFICATE-----): give the CA's certificate in PEM form")
            }
            throw StorageError(.invalidArgument, "\(name): \(why): give a PEM file of the CA certificates to trust")
        }
        return TrustStore(store: store, summary: "\(name) (\(count) certificate\(count == 1 ? "" : "s"))")
    }

    /// A C buffer's text up to its NUL.
    private static func text(_ buffer: [CChar]) -> String {
        String(decoding: buffer.prefix { $0 != 0 }.map { UInt8(bitPattern: $0) }, as: UTF8.self)
    }

    /// libcurl's default bundle, else its certificate directory.
    static func system() throws(StorageError) -> TrustStore {
        CurlGlobal.ensureInitialised()
        guard let h = curl_easy_init() else { throw StorageError(.invalidArgument, "curl_easy_init failed: out of memory") }
        defer { curl_easy_cleanup(h) }
        var file: UnsafeMutablePointer<CChar>? = nil
        var directory: UnsafeMutablePointer<CChar>? = nil
        _ = ccurl_getinfo_str(h, CURLINFO_CAINFO, &file)
        _ = ccurl_getinfo_str(h, CURLINFO_CAPATH, &directory)
        let bundle = file.map { String(cString: $0) }
        let folder = directory.map { String(cString: $0) }
        if let bundle, access(bundle, R_OK) == 0 {
            return try load(file: bundle, named: "the system CA bundle \(bundle)")
        }
        if let folder, access(folder, R_OK | X_OK) == 0 {
            var reason = [CChar](repeating: 0, count: 512)
            guard let store = ccurl_trust_load_directory(folder, &reason, reason.count) else {
                throw StorageError(.invalidArgument, "the system CA directory \(folder): \(Self.text(reason))")
            }
            return TrustStore(store: store, summary: "the system CA directory \(folder)")
        }
        let looked = [bundle, folder].compactMap { $0 }.joined(separator: " or ")
        throw StorageError(.invalidArgument,
                           "no system CA store (\(looked.isEmpty ? "libcurl names none" : "no \(looked)")): install Debian's ca-certificates, or give -o ca_file=FILE")
    }
}

/// The HTTP version a mount speaks over https (`http_version=`). HTTP/2 is offered by ALPN and
/// used only when the server picks it; plain http is always HTTP/1.1.
public enum HTTPVersion: String, Sendable {
    case http1_1 = "1.1"
    case http2 = "2"
}
