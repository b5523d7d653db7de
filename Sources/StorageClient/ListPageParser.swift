/// Reads a listing page (GCS JSON API or Firebase v0) straight from the bytes with
/// `JSONScanner`: each item becomes an `ObjectMetadata` through the same checks as
/// `ObjectMetadata.parse` (`ObjectMetadata.Resource`), and no generic tree is built.
/// The page's shape: `items` is a list of objects, `prefixes` a
/// list of strings, `nextPageToken` a string; anything else is an error, never a shorter list.
enum ListPageParser {
    /// `itemsAreNamesOnly`: v0 items carry a name (and bucket) alone; they are returned with
    /// size and generation 0 and the page marked incomplete.
    static func parse(_ bytes: [UInt8], what: String, defaultBucket: String,
                      itemsAreNamesOnly: Bool = false) throws(StorageError) -> ListPage {
        var s = JSONScanner(bytes, what: what)
        var items: [ObjectMetadata] = []
        var prefixes: [String] = []
        var token: String?
        try s.object { (s, key) throws(StorageError) in
            switch key {
            case "items":
                guard try s.peek() == UInt8(ascii: "[") else { throw StorageError(.invalidResponse, "\(what): 'items' is not a list") }
                try s.array { (s) throws(StorageError) in
                    guard try s.peek() == UInt8(ascii: "{") else { throw StorageError(.invalidResponse, "\(what): an item is not an object") }
                    let r = try resource(&s)
                    if itemsAreNamesOnly {
                        guard let name = r.name, !name.isEmpty else { throw StorageError(.invalidResponse, "\(what): an item has no name") }
                        items.append(ObjectMetadata(name: name, bucket: r.bucket ?? defaultBucket, size: 0, generation: 0,
                                                    updated: Timestamp(seconds: 0)))
                    } else {
                        items.append(try r.metadata(defaultBucket: defaultBucket))
                    }
                }
            case "prefixes":
                guard try s.peek() == UInt8(ascii: "[") else { throw StorageError(.invalidResponse, "\(what): 'prefixes' is not a list") }
                try s.array { (s) throws(StorageError) in
                    guard case .string(let p) = try s.scalarOrNested() else {
                        throw StorageError(.invalidResponse, "\(what): a prefix is not a string")
                    }
                    prefixes.append(p)
                }
            case "nextPageToken":
                guard case .string(let t) = try s.scalarOrNested() else {
                    throw StorageError(.invalidResponse, "\(what): 'nextPageToken' is not a string")
                }
                token = t.isEmpty ? nil : t
            default:
                try s.skip()
            }
        }
        try s.finish()
        return ListPage(items: items, prefixes: prefixes, nextPageToken: token, metadataComplete: !itemsAreNamesOnly)
    }

    /// One item's fields; unknown keys and values of an unexpected kind are skipped (as the
    /// tree parser's `as? String` does), so the checks in `Resource.metadata` decide.
    static func resource(_ s: inout JSONScanner) throws(StorageError) -> ObjectMetadata.Resource {
        var r = ObjectMetadata.Resource()
        try s.object { (s, key) throws(StorageError) in
            switch key {
            case "name": r.name = try s.stringIfString()
            case "bucket": r.bucket = try s.stringIfString()
            case "size": (r.size, r.sizeText) = try s.integer()
            case "generation": (r.generation, r.generationText) = try s.integer()
            case "metageneration": r.metageneration = try s.integer().0
            case "updated": r.updated = try s.stringIfString()
            case "timeCreated": r.timeCreated = try s.stringIfString()
            case "contentType": r.contentType = try s.stringIfString().flatMap { $0.isEmpty ? nil : $0 }
            case "contentEncoding": r.contentEncoding = try s.stringIfString().flatMap { $0.isEmpty ? nil : $0 }
            case "cacheControl": r.cacheControl = try s.stringIfString().flatMap { $0.isEmpty ? nil : $0 }
            case "md5Hash": r.md5Hash = try s.stringIfString().flatMap { $0.isEmpty ? nil : $0 }
            case "crc32c": r.crc32c = try s.stringIfString().flatMap { $0.isEmpty ? nil : $0 }
            case "downloadTokens": r.downloadTokens = try s.stringIfString()
            case "metadata":
                guard try s.peek() == UInt8(ascii: "{") else {
                    try s.skip()
                    return
                }
                try s.object { (s, k) throws(StorageError) in
                    switch try s.scalarOrNested() {
                    case .string(let v): r.custom[k] = v
                    case .number(let v): r.custom[k] = v
                    case .bool(let v): r.custom[k] = v ? "1" : "0"
                    case .null, nil: break
                    }
                }
            default: try s.skip()
            }
        }
        return r
    }
}

extension JSONScanner {
    /// A scalar, or nil after skipping an object or array.
    mutating func scalarOrNested() throws(StorageError) -> Scalar? {
        let b = try peek()
        if b == UInt8(ascii: "{") || b == UInt8(ascii: "[") {
            try skip(depth: 1)
            return nil
        }
        return try scalar()
    }

    /// The string, or nil for any other value (skipped).
    mutating func stringIfString() throws(StorageError) -> String? {
        if case .string(let v)? = try scalarOrNested() { return v }
        return nil
    }

    /// A whole number written as a string or a JSON number (as `ObjectMetadata.int64`
    /// accepts), and its text for messages; nil for anything else.
    mutating func integer() throws(StorageError) -> (Int64?, String?) {
        switch try scalarOrNested() {
        case .string(let v)?: return (Int64(v), v)
        case .number(let v)?:
            if let n = Int64(v) { return (n, v) }
            guard let d = Double(v), d.isFinite, d == d.rounded(), abs(d) < 9.2e18 else { return (nil, v) }
            return (Int64(d), v)
        case .bool(let v)?: return (nil, v ? "true" : "false")
        case .null?, nil: return (nil, nil)
        }
    }
}
