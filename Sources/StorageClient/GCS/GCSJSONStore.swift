import Foundation

/// The GCS JSON API (protocol.md §5): listing and metadata under `/storage/v1`, media under
/// `/download/storage/v1` with `alt=media`, every read pinned to a generation.
public final class GCSJSONStore: ObjectStore {
    public static let defaultEndpoint = "https://storage.googleapis.com"
    /// Production caps pages at 1000 entries; fake-gcs-server's default is unlimited, so ask.
    public static let pageSize = 1000
    static let listFields =
        "items(name,bucket,size,generation,metageneration,updated,timeCreated,contentType,contentEncoding,cacheControl,md5Hash,crc32c,metadata),prefixes,nextPageToken"

    public let bucket: String
    private let endpoint: String
    private let http: HTTPClient
    private let credentials: Credentials
    private let retry: RetryPolicy

    public init(bucket: String, endpoint: String, http: HTTPClient, credentials: Credentials,
                retry: RetryPolicy = RetryPolicy()) throws(StorageError) {
        self.bucket = bucket
        var e = endpoint
        while e.hasSuffix("/") { e.removeLast() }
        self.endpoint = e
        self.http = http
        self.credentials = credentials
        self.retry = retry
        if credentials.sendsSecrets && e.lowercased().hasPrefix("http://") && !Self.isLoopback(e) {
            throw StorageError(.invalidArgument,
                               "refusing to send credentials over plain http to \(e): use https, a loopback endpoint, or -o anonymous")
        }
    }

    static func isLoopback(_ url: String) -> Bool {
        guard let r = url.range(of: "://") else { return false }
        var hostPort = url[r.upperBound...]
        if let slash = hostPort.firstIndex(of: "/") { hostPort = hostPort[..<slash] }
        let host: Substring
        if hostPort.hasPrefix("[") {
            host = hostPort[hostPort.index(after: hostPort.startIndex)..<(hostPort.firstIndex(of: "]") ?? hostPort.endIndex)]
        } else {
            host = hostPort.split(separator: ":", maxSplits: 1).first ?? hostPort
        }
        return host == "localhost" || host == "::1" || (host.hasPrefix("127.") && host.allSatisfy { $0.isNumber || $0 == "." })
    }

    private var bucketPath: String { "\(endpoint)/storage/v1/b/\(ObjectName.encode(bucket))/o" }

    private func headers(forceRefresh: Bool) throws(StorageError) -> [String] {
        guard let auth = try credentials.authorization(forceRefresh: forceRefresh) else { return [] }
        return ["Authorization: \(auth)"]
    }

    /// One authorised exchange, with a single forced credential refresh after a 401.
    private func exchange(_ what: String, _ send: ([String]) throws(StorageError) -> HTTPResponse) throws(StorageError) -> HTTPResponse {
        var response = try send(try headers(forceRefresh: false))
        if response.status == 401 && credentials.sendsSecrets {
            response = try send(try headers(forceRefresh: true))
        }
        guard (200..<300).contains(response.status) else {
            throw StorageError.fromStatus(response.status, what: "\(what): \(Self.errorMessage(response))")
        }
        return response
    }

    public func list(prefix: String, pageToken: String?) throws(StorageError) -> ListPage {
        var query: [(String, String)] = [("delimiter", "/"), ("maxResults", "\(Self.pageSize)"), ("fields", Self.listFields)]
        if !prefix.isEmpty { query.append(("prefix", prefix)) }
        if let pageToken { query.append(("pageToken", pageToken)) }
        let url = "\(bucketPath)?\(ObjectName.query(query))"
        let response = try retry.run { () throws(StorageError) -> HTTPResponse in
            try exchange("list gs://\(bucket)/\(prefix)") { h throws(StorageError) in try http.get(url, headers: h) }
        }
        let json = try Self.jsonObject(response.body)
        var items: [ObjectMetadata] = []
        for case let item as [String: Any] in (json["items"] as? [Any]) ?? [] {
            items.append(try ObjectMetadata.parse(json: item, defaultBucket: bucket))
        }
        let prefixes = (json["prefixes"] as? [Any])?.compactMap { $0 as? String } ?? []
        let token = (json["nextPageToken"] as? String).flatMap { $0.isEmpty ? nil : $0 }
        return ListPage(items: items, prefixes: prefixes, nextPageToken: token)
    }

    public func metadata(of name: String) throws(StorageError) -> ObjectMetadata {
        let url = "\(bucketPath)/\(ObjectName.encode(name))"
        let response = try retry.run { () throws(StorageError) -> HTTPResponse in
            try exchange("metadata of gs://\(bucket)/\(name)") { h throws(StorageError) in try http.get(url, headers: h) }
        }
        return try ObjectMetadata.parse(json: try Self.jsonObject(response.body), defaultBucket: bucket)
    }

    public func read(_ name: String, generation: Int64, offset: Int64, into buffer: UnsafeMutableRawBufferPointer,
                     isCancelled: (@Sendable () -> Bool)?) throws(StorageError) {
        let url = "\(endpoint)/download/storage/v1/b/\(ObjectName.encode(bucket))/o/\(ObjectName.encode(name))"
            + "?alt=media&generation=\(generation)"
        _ = try retry.run { () throws(StorageError) -> HTTPResponse in
            do throws(StorageError) {
                return try exchange("read gs://\(bucket)/\(name)") { h throws(StorageError) in
                    try http.getRange(url, headers: h, start: offset, into: buffer, isCancelled: isCancelled)
                }
            } catch {
                guard error.code == .notFound else { throw error }
                // With generation= pinned, 404 means that generation is gone: the object changed.
                throw StorageError(.generationChanged, "gs://\(bucket)/\(name) generation \(generation) is no longer current",
                                   httpStatus: 404)
            }
        }
    }

    public func checkAccess(prefix: String) throws(StorageError) {
        var query: [(String, String)] = [("delimiter", "/"), ("maxResults", "1"), ("fields", "prefixes,nextPageToken,items(name)")]
        if !prefix.isEmpty { query.append(("prefix", prefix)) }
        let url = "\(bucketPath)?\(ObjectName.query(query))"
        do throws(StorageError) {
            _ = try RetryPolicy.startup.run { () throws(StorageError) -> HTTPResponse in
                try exchange("list gs://\(bucket)/\(prefix)") { h throws(StorageError) in try http.get(url, headers: h) }
            }
        } catch {
            switch error.code {
            case .notFound:
                throw StorageError(.notFound, "bucket '\(bucket)' does not exist at \(endpoint)", httpStatus: error.httpStatus)
            case .unauthenticated, .unauthorized:
                throw StorageError(error.code,
                                   "the credentials may not read gs://\(bucket)/\(prefix) (HTTP \(error.httpStatus ?? 0)): check token_file=, credentials= or the bucket's IAM",
                                   httpStatus: error.httpStatus)
            case .unreachable:
                throw StorageError(.unreachable, "\(error.message): check endpoint= (or STORAGE_EMULATOR_HOST) and the network")
            default:
                throw error
            }
        }
    }

    static func jsonObject(_ body: [UInt8]) throws(StorageError) -> [String: Any] {
        do {
            guard let obj = try JSONSerialization.jsonObject(with: Data(body)) as? [String: Any] else {
                throw StorageError(.invalidResponse, "expected a JSON object from the server")
            }
            return obj
        } catch let e as StorageError {
            throw e
        } catch {
            throw StorageError(.invalidResponse, "the server's answer is not JSON")
        }
    }

    /// The human part of an error body (JSON `error.message`, or the first line of text).
    static func errorMessage(_ response: HTTPResponse) -> String {
        if let obj = try? JSONSerialization.jsonObject(with: Data(response.body)) as? [String: Any],
           let err = obj["error"] as? [String: Any], let msg = err["message"] as? String {
            return msg
        }
        let text = String(decoding: response.body.prefix(200), as: UTF8.self)
        return text.split(separator: "\n").first.map(String.init) ?? "HTTP \(response.status)"
    }
}
