import Foundation

/// The GCS JSON API (docs/protocol.md §5): listing and metadata under `/storage/v1`, media under
/// `/download/storage/v1` with `alt=media`, every read pinned to a generation.
public final class GCSJSONStore: ObjectStore, ConnectionTuning {
    public static let defaultEndpoint = "https://storage.googleapis.com"
    /// Production caps pages at 1000 entries; fake-gcs-server's default is unlimited, so ask.
    public static let pageSize = 1000
    /// What a listing keeps of each object (`FileRecord`: size, generation, time, crc32c;
    /// custom metadata for mtime): the rest of the resource is fetched when an extended
    /// attribute asks. Less text to send and to read: ~40% of a full page.
    static let listFields = "items(name,size,generation,updated,timeCreated,crc32c,metadata),prefixes,nextPageToken"

    public let bucket: String
    private var endpoint: String { client.endpoint }
    private let client: AuthorizedHTTP

    public func claimIdleConnection() -> ConnectionClaim? { client.http.claimIdleConnection() }

    public var connectionCount: Int? { client.http.connectionCount }

    public var fastestFirstByte: Double? { client.fastest.seconds }

    public func openConnection(forReading name: String, generation: Int64) {
        openConnection(through: client.http, forReading: name, generation: generation)
    }

    public init(bucket: String, endpoint: String, http: HTTPClient, credentials: Credentials,
                retry: RetryPolicy = RetryPolicy()) throws(StorageError) {
        self.bucket = bucket
        client = try AuthorizedHTTP(endpoint: endpoint, http: http, credentials: credentials, retry: retry)
    }

    private var bucketPath: String { "\(endpoint)/storage/v1/b/\(ObjectName.encode(bucket))/o" }

    private func listURL(prefix: String, pageToken: String?, maxResults: Int, fields: String, delimited: Bool = true) -> String {
        var query: [(String, String)] = delimited ? [("delimiter", "/")] : []
        query += [("maxResults", "\(maxResults)"), ("fields", fields)]
        if !prefix.isEmpty { query.append(("prefix", prefix)) }
        if let pageToken { query.append(("pageToken", pageToken)) }
        return "\(bucketPath)?\(ObjectName.query(query))"
    }

    public func list(prefix: String, pageToken: String?, isCancelled: (@Sendable () -> Bool)?,
                     connection: ConnectionClaim?) throws(StorageError) -> ListPage {
        let url = listURL(prefix: prefix, pageToken: pageToken, maxResults: Self.pageSize, fields: Self.listFields)
        let what = "list gs://\(bucket)/\(prefix)"
        return try ListPageParser.parse(try client.getJSONBytes(url, what: what, isCancelled: isCancelled, connection: connection),
                                        what: what, defaultBucket: bucket)
    }

    /// One page of every object under `prefix`, at any depth (no delimiter): what
    /// `storefs manifest` reads, a bucket in a thousand objects a request.
    public func listAll(prefix: String, pageToken: String?, isCancelled: (@Sendable () -> Bool)? = nil) throws(StorageError) -> ListPage {
        let url = listURL(prefix: prefix, pageToken: pageToken, maxResults: Self.pageSize,
                          fields: "items(name,size,generation,updated,timeCreated,crc32c,metadata),nextPageToken", delimited: false)
        let what = "list gs://\(bucket)/\(prefix)"
        do throws(StorageError) {
            return try ListPageParser.parse(try client.getJSONBytes(url, what: what, isCancelled: isCancelled), what: what,
                                            defaultBucket: bucket)
        } catch {
            guard pageToken == nil else { throw error }
            throw AuthorizedHTTP.explainAccessError(error, bucket: bucket, prefix: prefix, endpoint: endpoint)
        }
    }

    public func hasChildren(prefix: String, isCancelled: (@Sendable () -> Bool)?) throws(StorageError) -> Bool {
        let url = listURL(prefix: prefix, pageToken: nil, maxResults: 1, fields: "prefixes,items(name)")
        let json = try client.getJSON(url, what: "list gs://\(bucket)/\(prefix)", isCancelled: isCancelled)
        return !((json["items"] as? [Any]) ?? []).isEmpty || !((json["prefixes"] as? [Any]) ?? []).isEmpty
    }

    public func metadata(of name: String, isCancelled: (@Sendable () -> Bool)?) throws(StorageError) -> ObjectMetadata {
        let json = try client.getJSON("\(bucketPath)/\(ObjectName.encode(name))", what: "metadata of gs://\(bucket)/\(name)",
                                      isCancelled: isCancelled)
        return try ObjectMetadata.parse(json: json, defaultBucket: bucket)
    }

    @discardableResult
    public func read(_ name: String, generation: Int64, offset: Int64, into buffer: RangeBuffer,
                     isCancelled: (@Sendable () -> Bool)?, connection: ConnectionClaim?) throws(StorageError) -> ReadTiming {
        let url = "\(endpoint)/download/storage/v1/b/\(ObjectName.encode(bucket))/o/\(ObjectName.encode(name))"
            + "?alt=media&generation=\(generation)"
        do throws(StorageError) {
            let response = try client.getRange(url, what: "read gs://\(bucket)/\(name)", start: offset, into: buffer,
                                               isCancelled: isCancelled, connection: connection)
            return ReadTiming(firstByte: response.firstByte)
        } catch {
            guard error.code == .notFound else { throw error }
            // With generation= pinned, 404 means that generation is gone: the object changed.
            throw StorageError(.generationChanged, "gs://\(bucket)/\(name) generation \(generation) is no longer current",
                               httpStatus: 404)
        }
    }

    @discardableResult
    public func checkAccess(prefix: String) throws(StorageError) -> ListPage? {
        // The first page of the mount's root, as `list` asks for it: the check costs no more
        // round trips, and the page answers the first lookups (docs/architecture.md, "Lookups
        // in one round trip").
        let url = listURL(prefix: prefix, pageToken: nil, maxResults: Self.pageSize, fields: Self.listFields)
        let what = "list gs://\(bucket)/\(prefix)"
        do throws(StorageError) {
            return try ListPageParser.parse(try client.getJSONBytes(url, what: what, policy: .startup), what: what,
                                            defaultBucket: bucket)
        } catch {
            throw AuthorizedHTTP.explainAccessError(error, bucket: bucket, prefix: prefix, endpoint: endpoint)
        }
    }
}
