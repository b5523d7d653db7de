import Foundation

/// A point in time as the object resource gives it (RFC 3339), kept to the nanosecond.
public struct Timestamp: Sendable, Equatable, Comparable {
    public var seconds: Int64
    public var nanoseconds: Int32

    public init(seconds: Int64, nanoseconds: Int32 = 0) {
        self.seconds = seconds
        self.nanoseconds = nanoseconds
    }

    public static func < (a: Timestamp, b: Timestamp) -> Bool {
        (a.seconds, a.nanoseconds) < (b.seconds, b.nanoseconds)
    }

    /// Parses `YYYY-MM-DDTHH:MM:SS[.fraction]` followed by `Z` or `±HH:MM`, with 0–9 fraction
    /// digits (fake-gcs-server trims trailing zeros, the Firebase emulator always writes 3).
    public static func parseRFC3339(_ text: String) -> Timestamp? {
        var text = text
        return text.withUTF8 { parseRFC3339(bytes: UnsafeRawBufferPointer($0)) }
    }

    /// The same, from the text's UTF-8 bytes (manifests: no String per row).
    public static func parseRFC3339(bytes b: UnsafeRawBufferPointer) -> Timestamp? {
        func digits(_ at: Int, _ n: Int) -> Int? {
            guard at + n <= b.count else { return nil }
            var v = 0
            for i in at..<(at + n) {
                let c = b[i]
                guard c >= 48 && c <= 57 else { return nil }
                v = v * 10 + Int(c - 48)
            }
            return v
        }
        guard b.count >= 20, let year = digits(0, 4), b[4] == 45, let month = digits(5, 2), b[7] == 45,
              let day = digits(8, 2), b[10] == 84 || b[10] == 116 || b[10] == 32,
              let hour = digits(11, 2), b[13] == 58, let minute = digits(14, 2), b[16] == 58,
              let second = digits(17, 2) else { return nil }
        var i = 19
        var nanos = 0
        if i < b.count && b[i] == 46 {
            i += 1
            var count = 0
            while i < b.count, b[i] >= 48, b[i] <= 57 {
                if count < 9 { nanos = nanos * 10 + Int(b[i] - 48) }
                count += 1
                i += 1
            }
            guard count > 0 else { return nil }
            for _ in min(count, 9)..<9 { nanos *= 10 }
        }
        guard i < b.count else { return nil }
        var offset = 0
        if b[i] == 90 || b[i] == 122 {
            i += 1
        } else if b[i] == 43 || b[i] == 45, let oh = digits(i + 1, 2), b.count > i + 3, b[i + 3] == 58,
                  let om = digits(i + 4, 2) {
            offset = (oh * 3600 + om * 60) * (b[i] == 43 ? 1 : -1)
            i += 6
        } else {
            return nil
        }
        guard i == b.count, (1...12).contains(month), (1...31).contains(day), hour < 24, minute < 60, second < 61 else {
            return nil
        }
        // Days from civil (Howard Hinnant's algorithm): no locale, no Foundation formatter.
        let y = month <= 2 ? year - 1 : year
        let era = (y >= 0 ? y : y - 399) / 400
        let yoe = y - era * 400
        let mp = (month + 9) % 12
        let doy = (153 * mp + 2) / 5 + day - 1
        let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy
        let days = era * 146097 + doe - 719468
        let secs = Int64(days) * 86400 + Int64(hour * 3600 + minute * 60 + second) - Int64(offset)
        return Timestamp(seconds: secs, nanoseconds: Int32(nanos))
    }
}

/// What storefs knows about one object: the subset of the GCS object resource / v0 metadata
/// that the filesystem and its extended attributes use.
public struct ObjectMetadata: Sendable, Equatable {
    public var name: String
    public var bucket: String
    public var size: Int64
    /// Content identity: cached bytes are keyed by it (never by metageneration, docs/protocol.md §2.2).
    public var generation: Int64
    public var metageneration: Int64
    public var updated: Timestamp
    public var contentType: String?
    public var contentEncoding: String?
    public var cacheControl: String?
    public var md5Hash: String?
    public var crc32c: String?
    /// Custom metadata (`metadata` map), including `firebaseStorageDownloadTokens` on GCS.
    public var custom: [String: String]
    /// Firebase download tokens (v0 `downloadTokens`, or GCS `metadata.firebaseStorageDownloadTokens`).
    public var downloadTokens: [String]

    public init(name: String, bucket: String, size: Int64, generation: Int64, metageneration: Int64 = 1,
                updated: Timestamp, contentType: String? = nil, contentEncoding: String? = nil,
                cacheControl: String? = nil, md5Hash: String? = nil, crc32c: String? = nil,
                custom: [String: String] = [:], downloadTokens: [String] = []) {
        self.name = name
        self.bucket = bucket
        self.size = size
        self.generation = generation
        self.metageneration = metageneration
        self.updated = updated
        self.contentType = contentType
        self.contentEncoding = contentEncoding
        self.cacheControl = cacheControl
        self.md5Hash = md5Hash
        self.crc32c = crc32c
        self.custom = custom
        self.downloadTokens = downloadTokens
    }

    /// The modification time shown by `stat`: custom `mtime` (RFC 3339, rclone) or
    /// `goog-reserved-file-mtime` (unix seconds, gsutil) when present, else `updated`.
    public var modificationTime: Timestamp {
        if let m = custom["mtime"], let t = Timestamp.parseRFC3339(m) { return t }
        if let m = custom["goog-reserved-file-mtime"], let s = Int64(m) { return Timestamp(seconds: s) }
        return updated
    }

    /// The largest object size believed (GCS's own limit is 5 TiB): sizes are used in block,
    /// offset and `st_blocks` arithmetic, and a hostile `Int64.max` must not trap there.
    public static let maxSize: Int64 = 5 << 40

    /// Parses an object resource (GCS JSON API or Firebase v0); numbers may be strings or numbers.
    /// `size` and `generation` are the object's identity (its cache key and what every read is
    /// pinned to): a resource without them, or with values out of range, is refused, never
    /// given a default that two objects could share.
    public static func parse(json: [String: Any], defaultBucket: String) throws(StorageError) -> ObjectMetadata {
        var f = Resource()
        f.name = json["name"] as? String
        f.bucket = json["bucket"] as? String
        f.size = int64(json["size"])
        f.sizeText = json["size"].map { "\($0)" }
        f.generation = int64(json["generation"])
        f.generationText = json["generation"].map { "\($0)" }
        f.metageneration = int64(json["metageneration"])
        f.updated = json["updated"] as? String
        f.timeCreated = json["timeCreated"] as? String
        f.contentType = nonEmpty(json["contentType"])
        f.contentEncoding = nonEmpty(json["contentEncoding"])
        f.cacheControl = nonEmpty(json["cacheControl"])
        f.md5Hash = nonEmpty(json["md5Hash"])
        f.crc32c = nonEmpty(json["crc32c"])
        f.downloadTokens = json["downloadTokens"] as? String
        if let m = json["metadata"] as? [String: Any] {
            var custom: [String: String] = [:]
            for (k, v) in m {
                if let s = v as? String { custom[k] = s } else { custom[k] = "\(v)" }
            }
            f.custom = custom
        }
        return try f.metadata(defaultBucket: defaultBucket)
    }

    /// An object resource's fields as they arrived, before the checks `metadata` makes: the one
    /// place both parsers (`JSONSerialization` trees and the listing scanner) decide.
    struct Resource {
        var name: String?
        var bucket: String?
        var size: Int64?
        var sizeText: String?
        var generation: Int64?
        var generationText: String?
        var metageneration: Int64?
        var updated: String?
        var timeCreated: String?
        var contentType: String?
        var contentEncoding: String?
        var cacheControl: String?
        var md5Hash: String?
        var crc32c: String?
        var custom: [String: String] = [:]
        var downloadTokens: String?

        func metadata(defaultBucket: String) throws(StorageError) -> ObjectMetadata {
            guard let name, !name.isEmpty else {
                throw StorageError(.invalidResponse, "object resource without a name")
            }
            guard let size, (0...ObjectMetadata.maxSize).contains(size) else {
                throw StorageError(.invalidResponse, "object \(name): size \(sizeText.map { $0.prefix(40) } ?? "missing") is missing or out of range")
            }
            guard let generation, generation > 0 else {
                throw StorageError(.invalidResponse, "object \(name): generation \(generationText.map { $0.prefix(40) } ?? "missing") is missing or not positive")
            }
            var tokensText = downloadTokens
            if tokensText == nil { tokensText = custom["firebaseStorageDownloadTokens"] }
            let tokens = (tokensText ?? "").split(separator: ",").map {
                $0.trimmingCharacters(in: .whitespaces)
            }.filter { !$0.isEmpty }
            let when = updated.flatMap(Timestamp.parseRFC3339) ?? timeCreated.flatMap(Timestamp.parseRFC3339)
                ?? Timestamp(seconds: 0)
            return ObjectMetadata(name: name, bucket: bucket ?? defaultBucket, size: size, generation: generation,
                                  metageneration: metageneration ?? 1, updated: when, contentType: contentType,
                                  contentEncoding: contentEncoding, cacheControl: cacheControl, md5Hash: md5Hash,
                                  crc32c: crc32c, custom: custom, downloadTokens: tokens)
        }
    }

    private static func nonEmpty(_ v: Any?) -> String? {
        guard let s = v as? String, !s.isEmpty else { return nil }
        return s
    }

    /// A whole number given as a string or a JSON number; nil for anything else (a fraction,
    /// a number out of Int64's range).
    static func int64(_ v: Any?) -> Int64? {
        if let s = v as? String { return Int64(s) }
        if let n = v as? NSNumber {
            let d = n.doubleValue
            guard d.isFinite, d == d.rounded(), abs(d) < 9.2e18 else { return nil }
            return n.int64Value
        }
        return nil
    }
}

/// One page of a delimited listing.
public struct ListPage: Sendable {
    /// Objects directly under the prefix. On protocols whose list items carry only names
    /// (Firebase v0) `metadataComplete` is false and sizes must come from `metadata(of:)`.
    public var items: [ObjectMetadata]
    /// Sub-prefixes, each ending in `/`.
    public var prefixes: [String]
    public var nextPageToken: String?
    public var metadataComplete: Bool

    public init(items: [ObjectMetadata], prefixes: [String], nextPageToken: String?, metadataComplete: Bool = true) {
        self.items = items
        self.prefixes = prefixes
        self.nextPageToken = nextPageToken
        self.metadataComplete = metadataComplete
    }
}
