/// A mount source: a bucket plus an optional object prefix (the sub-tree that is mounted).
///
/// Accepted forms, parsed the way the Firebase SDKs build a storage reference (docs/protocol.md §1):
/// - `bucket`
/// - `gs://bucket[/prefix]` (no percent-decoding, as in the iOS SDK)
/// - `http(s)://host/v0/b/bucket[/o[/encoded-prefix]]` (path components percent-decoded; host not checked)
///
/// The prefix is normalised like iOS `StoragePath`: repeated `/` collapse, leading and trailing
/// `/` are trimmed, so `gs://b//photos//` mounts `photos`.
public struct StorageReference: Sendable, Equatable, CustomStringConvertible {
    public let bucket: String
    /// Normalised prefix without leading or trailing `/`; "" is the whole bucket.
    public let prefix: String

    public init(bucket: String, prefix: String = "") {
        self.bucket = bucket
        self.prefix = StorageReference.normalise(prefix)
    }

    /// `gs://bucket/prefix`.
    public var description: String { "gs://\(bucket)/\(prefix)" }

    /// The listing prefix of the mount root: "" or `prefix/`.
    public var rootListingPrefix: String { prefix.isEmpty ? "" : prefix + "/" }

    public static func normalise(_ path: String) -> String {
        var p = path
        while p.contains("//") { p = p.replacingOccurrences(of: "//", with: "/") }
        while p.hasPrefix("/") { p.removeFirst() }
        while p.hasSuffix("/") { p.removeLast() }
        return p
    }

    /// Parses a mount SOURCE. The error message says what form was expected.
    public static func parse(_ source: String) throws(StorageError) -> StorageReference {
        let lower = source.lowercased()
        if lower.hasPrefix("gs://") {
            let rest = String(source.dropFirst(5))
            let bucket: String
            let object: String
            if let slash = rest.firstIndex(of: "/") {
                bucket = String(rest[..<slash])
                object = String(rest[rest.index(after: slash)...])
            } else {
                bucket = rest
                object = ""
            }
            try validateBucket(bucket, source: source)
            return StorageReference(bucket: bucket, prefix: object)
        }
        if lower.hasPrefix("http://") || lower.hasPrefix("https://") {
            return try parseHTTP(source)
        }
        if source.contains("://") {
            throw StorageError(.invalidArgument,
                               "source '\(source)' has an unsupported scheme: use BUCKET, gs://BUCKET/PREFIX or https://HOST/v0/b/BUCKET/o/PREFIX")
        }
        try validateBucket(source, source: source)
        return StorageReference(bucket: source)
    }

    private static func parseHTTP(_ source: String) throws(StorageError) -> StorageReference {
        // Strip scheme://host[:port], then query and fragment; split the path into components.
        let afterScheme = source[source.range(of: "://")!.upperBound...]
        guard let pathStart = afterScheme.firstIndex(of: "/") else {
            throw badURL(source)
        }
        var path = afterScheme[pathStart...]
        if let q = path.firstIndex(where: { $0 == "?" || $0 == "#" }) { path = path[..<q] }
        var components: [String] = []
        for raw in path.split(separator: "/", omittingEmptySubsequences: true) {
            guard let decoded = ObjectName.decode(String(raw)) else { throw badURL(source) }
            components.append(decoded)
        }
        guard components.count >= 3, components[0] == "v0", components[1] == "b" else { throw badURL(source) }
        let bucket = components[2]
        try validateBucket(bucket, source: source)
        if components.count == 3 { return StorageReference(bucket: bucket) }
        guard components[3] == "o" else { throw badURL(source) }
        return StorageReference(bucket: bucket, prefix: components.dropFirst(4).joined(separator: "/"))
    }

    private static func badURL(_ source: String) -> StorageError {
        StorageError(.invalidArgument,
                     "source '\(source)' is not a Firebase Storage URL: expected https://HOST/v0/b/BUCKET/o/PREFIX")
    }

    /// Bucket names: 3–222 characters of `[a-z0-9._-]` (the JS SDK also admits upper case).
    private static func validateBucket(_ bucket: String, source: String) throws(StorageError) {
        let ok = !bucket.isEmpty && bucket.count <= 222 && bucket.utf8.allSatisfy { b in
            switch b {
            case UInt8(ascii: "a")...UInt8(ascii: "z"), UInt8(ascii: "A")...UInt8(ascii: "Z"),
                 UInt8(ascii: "0")...UInt8(ascii: "9"), UInt8(ascii: "."), UInt8(ascii: "-"), UInt8(ascii: "_"):
                return true
            default:
                return false
            }
        }
        guard ok else {
            throw StorageError(.invalidArgument,
                               "source '\(source)' does not name a valid bucket (letters, digits, '.', '-', '_')")
        }
    }
}

/// Which API a mount speaks (`protocol=`): the GCS JSON API (docs/protocol.md §5), access
/// decided by IAM, or the Firebase Storage v0 REST API (§2), access decided by Security Rules.
public enum StorageProtocol: String, Sendable {
    case gcs, firebase
}
