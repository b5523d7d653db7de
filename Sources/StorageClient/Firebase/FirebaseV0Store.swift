import Foundation

/// The Firebase Storage v0 REST API (docs/protocol.md §2): what the Firebase SDKs speak, checked by
/// Security Rules. Listing items carry only names (`metadataComplete: false`), so sizes and
/// times come from per-object metadata GETs. v0 reads may create a download token and bump
/// `metageneration`; content identity is `generation` alone.
public final class FirebaseV0Store: ObjectStore, ConnectionTuning {
    public static let defaultEndpoint = "https://firebasestorage.googleapis.com"

    public let bucket: String
    /// The mount's Firebase origin: download URLs are built on it.
    public var endpoint: String { client.endpoint }
    private let client: AuthorizedHTTP

    public var connectionCount: Int? { client.http.connectionCount }

    public func claimIdleConnection() -> ConnectionClaim? { client.http.claimIdleConnection() }

    public var fastestFirstByte: Double? { client.fastest.seconds }

    public func openConnection(forReading name: String, generation: Int64) {
        openConnection(through: client.http, forReading: name, generation: generation)
    }

    public init(bucket: String, endpoint: String, http: HTTPClient, credentials: Credentials,
                retry: RetryPolicy = RetryPolicy()) throws(StorageError) {
        self.bucket = bucket
        client = try AuthorizedHTTP(endpoint: endpoint, http: http, credentials: credentials, retry: retry)
    }

    private var bucketPath: String { "\(endpoint)/v0/b/\(ObjectName.encode(bucket))/o" }

    private func listURL(prefix: String, pageToken: String?, maxResults: Int?) -> String {
        var query: [(String, String)] = [("prefix", prefix), ("delimiter", "/")]
        if let maxResults { query.append(("maxResults", "\(maxResults)")) }
        if let pageToken { query.append(("pageToken", pageToken)) }
        return "\(bucketPath)?\(ObjectName.query(query))"
    }

    public func list(prefix: String, pageToken: String?, isCancelled: (@Sendable () -> Bool)?,
                     connection: ConnectionClaim?) throws(StorageError) -> ListPage {
        // maxResults is left out on purpose, as listAll() does: the server picks the page size.
        let what = "list gs://\(bucket)/\(prefix)"
        let page = try ListPageParser.parse(try client.getJSONBytes(listURL(prefix: prefix, pageToken: pageToken, maxResults: nil),
                                                                    what: what, isCancelled: isCancelled,
                                                                    connection: connection),
                                            what: what, defaultBucket: bucket, itemsAreNamesOnly: true)
        // Names only (§2.4): size and generation come from a metadata GET when asked for.
        let prefixes = page.prefixes.map { $0.hasSuffix("/") ? $0 : $0 + "/" }
        return ListPage(items: page.items, prefixes: prefixes, nextPageToken: page.nextPageToken, metadataComplete: false)
    }

    /// v0 listings give names only: sizes cost a metadata GET each.
    public var listingsCarrySizes: Bool { false }

    public func hasChildren(prefix: String, isCancelled: (@Sendable () -> Bool)?) throws(StorageError) -> Bool {
        let json = try client.getJSON(listURL(prefix: prefix, pageToken: nil, maxResults: 1), what: "list gs://\(bucket)/\(prefix)",
                                      isCancelled: isCancelled)
        // v0 hides the placeholder itself, and a page can be empty yet not the last (§2.4).
        return !((json["items"] as? [Any]) ?? []).isEmpty || !((json["prefixes"] as? [Any]) ?? []).isEmpty
            || json["nextPageToken"] as? String != nil
    }

    public func metadata(of name: String, isCancelled: (@Sendable () -> Bool)?) throws(StorageError) -> ObjectMetadata {
        let json = try client.getJSON("\(bucketPath)/\(ObjectName.encode(name))", what: "metadata of gs://\(bucket)/\(name)",
                                      isCancelled: isCancelled)
        return try ObjectMetadata.parse(json: json, defaultBucket: bucket)
    }

    @discardableResult
    public func read(_ name: String, generation: Int64, offset: Int64, into buffer: RangeBuffer,
                     isCancelled: (@Sendable () -> Bool)?, connection: ConnectionClaim?) throws(StorageError) -> ReadTiming {
        // v0 has no generation parameter: the answer's x-goog-generation tells which one came.
        let url = "\(bucketPath)/\(ObjectName.encode(name))?alt=media"
        let response = try client.getRange(url, what: "read gs://\(bucket)/\(name)", start: offset, into: buffer,
                                           isCancelled: isCancelled, connection: connection)
        // Without the header nothing says which generation these bytes are: never cache them
        // under the one pinned at open.
        guard let served = response.headers["x-goog-generation"].flatMap({ Int64($0) }) else {
            throw StorageError(.invalidResponse, "gs://\(bucket)/\(name): the answer does not say its generation (x-goog-generation)")
        }
        if served != generation {
            throw StorageError(.generationChanged, "gs://\(bucket)/\(name) changed (generation \(served), opened \(generation))")
        }
        return ReadTiming(firstByte: response.firstByte)
    }

    /// v0 lookups need a metadata GET (listings carry no sizes): the first bytes are asked in
    /// the same round trip, and the answer's headers say which generation they are.
    public func readStart(_ name: String, into buffer: UnsafeMutableRawBufferPointer,
                          isCancelled: (@Sendable () -> Bool)?) throws(StorageError) -> ObjectStart? {
        let url = "\(bucketPath)/\(ObjectName.encode(name))?alt=media"
        let response = try client.getRange(url, what: "read gs://\(bucket)/\(name)", start: 0, into: RangeBuffer(buffer), untilEnd: true,
                                           isCancelled: isCancelled)
        guard let served = response.headers["x-goog-generation"].flatMap({ Int64($0) }) else {
            throw StorageError(.invalidResponse, "gs://\(bucket)/\(name): the answer does not say its generation (x-goog-generation)")
        }
        var size = response.headers["content-range"].flatMap(ContentRange.init(header:))?.total
        if size == nil, response.status == 200, response.bytesRead < buffer.count { size = Int64(response.bytesRead) }
        return ObjectStart(generation: served, size: size, count: response.bytesRead)
    }

    @discardableResult
    public func checkAccess(prefix: String) throws(StorageError) -> ListPage? {
        do throws(StorageError) {
            // Names without sizes would answer little (docs/protocol.md §2.4): the check stays small.
            _ = try client.getJSON(listURL(prefix: prefix, pageToken: nil, maxResults: 1),
                                   what: "list gs://\(bucket)/\(prefix)", policy: .startup)
            return nil
        } catch {
            throw AuthorizedHTTP.explainAccessError(error, bucket: bucket, prefix: prefix, endpoint: endpoint)
        }
    }
}
