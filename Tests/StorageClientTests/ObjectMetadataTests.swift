import Foundation
import Testing
@testable import StorageClient

@Suite struct TimestampTests {
    @Test(arguments: [
        ("1970-01-01T00:00:00Z", Int64(0), Int32(0)),
        ("2020-09-18T00:31:33.328Z", Int64(1_600_389_093), Int32(328_000_000)),
        ("2026-11-29T19:15:01.123456Z", Int64(1_795_979_701), Int32(123_456_000)),
        ("2026-11-29T19:15:01.1234567891Z", Int64(1_795_979_701), Int32(123_456_789)),
        ("2026-11-29T21:15:01+02:00", Int64(1_795_979_701), Int32(0)),
        ("2000-02-29T00:00:00z", Int64(951_782_400), Int32(0)),
    ])
    func parsesRFC3339(text: String, seconds: Int64, nanos: Int32) {
        #expect(Timestamp.parseRFC3339(text) == Timestamp(seconds: seconds, nanoseconds: nanos))
    }

    @Test(arguments: ["", "2020-09-18", "2020-09-18T00:31:33", "2020-13-01T00:00:00Z", "2020-09-18T00:31:33.Z"])
    func rejectsMalformed(text: String) {
        #expect(Timestamp.parseRFC3339(text) == nil)
    }
}

@Suite struct ObjectMetadataTests {
    @Test func parsesGCSResourceWithStringNumbers() throws {
        let m = try ObjectMetadata.parse(json: [
            "name": "a/b.txt", "bucket": "bkt", "size": "42", "generation": "1795979756647549", "metageneration": "3",
            "updated": "2026-11-29T19:15:01.5Z", "contentType": "text/plain", "contentEncoding": "gzip",
            "md5Hash": "SsmzRVi10vozaSElbNvGRg==", "crc32c": "RsJyrg==",
            "metadata": ["firebaseStorageDownloadTokens": "tok-1, tok-2", "color": "blue"],
        ], defaultBucket: "x")
        #expect(m.size == 42 && m.generation == 1_795_979_756_647_549 && m.metageneration == 3)
        #expect(m.downloadTokens == ["tok-1", "tok-2"])
        #expect(m.custom["color"] == "blue")
        #expect(m.contentEncoding == "gzip")
        #expect(m.updated == Timestamp(seconds: 1_795_979_701, nanoseconds: 500_000_000))
    }

    @Test func parsesFirebaseResourceWithNumbersAndDownloadTokens() throws {
        let m = try ObjectMetadata.parse(json: [
            "name": "x", "size": 7, "generation": 1_700_000_000_000, "downloadTokens": "uuid-1",
            "updated": "2026-01-01T00:00:00.000Z", "contentEncoding": "",
        ], defaultBucket: "b")
        #expect(m.bucket == "b" && m.size == 7 && m.generation == 1_700_000_000_000)
        #expect(m.downloadTokens == ["uuid-1"])
        #expect(m.contentEncoding == nil)
    }

    @Test func customMtimeWinsOverUpdated() throws {
        var m = try ObjectMetadata.parse(json: ["name": "x", "size": "1", "generation": "2", "updated": "2026-01-01T00:00:00Z",
                                                "metadata": ["goog-reserved-file-mtime": "1000"]], defaultBucket: "b")
        #expect(m.modificationTime == Timestamp(seconds: 1000))
        m.custom["mtime"] = "2001-09-09T01:46:40.5Z"
        #expect(m.modificationTime == Timestamp(seconds: 1_000_000_000, nanoseconds: 500_000_000))
    }

    @Test func nameIsRequired() {
        #expect(throws: StorageError.self) { try ObjectMetadata.parse(json: ["size": "1"], defaultBucket: "b") }
    }

    /// Size and generation are the object's identity (cache key, pinned reads): a resource
    /// without them, or with values no object can have, is refused instead of defaulting to 0.
    @Test(arguments: [
        #"{"name": "x", "generation": "5"}"#,                                  // no size
        #"{"name": "x", "size": "5"}"#,                                         // no generation
        #"{"name": "x", "size": "9223372036854775807", "generation": "5"}"#,    // Int64.max
        #"{"name": "x", "size": "9223372036854775207", "generation": "5"}"#,    // Int64.max - 600
        #"{"name": "x", "size": "-1", "generation": "5"}"#,
        #"{"name": "x", "size": "5", "generation": "0"}"#,
        #"{"name": "x", "size": 1.5, "generation": "5"}"#,
        #"{"name": "x", "size": 1e30, "generation": "5"}"#,
        #"{"name": "x", "size": "5", "generation": "seven"}"#,
    ])
    func identityMustBePresentAndInRange(json: String) throws {
        let object = try #require(try JSONSerialization.jsonObject(with: Data(json.utf8)) as? [String: Any])
        #expect(throws: StorageError.self) { try ObjectMetadata.parse(json: object, defaultBucket: "b") }
    }

    @Test func theLargestBelievedSizeIsFiveTiB() throws {
        let m = try ObjectMetadata.parse(json: ["name": "x", "size": "\(5 << 40)", "generation": "1"], defaultBucket: "b")
        #expect(m.size == ObjectMetadata.maxSize)
    }
}

@Suite struct ListPageTests {
    func parse(_ json: String, namesOnly: Bool = false) throws(StorageError) -> ListPage {
        try ListPageParser.parse(Array(json.utf8), what: "list", defaultBucket: "b", itemsAreNamesOnly: namesOnly)
    }

    @Test(arguments: [
        #"{"items": "not a list"}"#,
        #"{"items": {"name": "a"}}"#,
        #"{"items": [{"name": "a", "size": "1", "generation": "1"}, "x"]}"#,
        #"{"prefixes": ["a/", 7]}"#,
        #"{"prefixes": "a/"}"#,
        #"{"nextPageToken": 12}"#,
        #"{"items": [{"size": "1", "generation": "1"}]}"#,
        #"{"items": [{"name": "a", "size": "-1", "generation": "1"}]}"#,
        #"{"items": [{"name": "a", "size": "1", "generation": "0"}]}"#,
        #"{"items": [{"name": "a", "size": 1.5, "generation": 1}]}"#,
        #"{"items": [{"name": "a\ud800", "size": "1", "generation": "1"}]}"#,
        #"{"items": [{"name": "a", "size": "1", "generation": "1"}]"#,
        #"{"items": [] } x"#,
        "{\"items\": [{\"name\": \"a\u{01}\", \"size\": \"1\", \"generation\": \"1\"}]}",
        #"{"prefixes": [], }"#,
        #"[]"#,
    ])
    func aMalformedPageIsAnErrorNotAShorterListing(json: String) throws {
        #expect(throws: StorageError.self) { try parse(json) }
    }

    @Test func absentFieldsAreAnEmptyLastPage() throws {
        let page = try parse(#"{"kind": "storage#objects"}"#)
        #expect(page.items.isEmpty && page.prefixes.isEmpty && page.nextPageToken == nil)
    }

    @Test func nestingIsBounded() throws {
        let deep = String(repeating: "[", count: 100_000) + String(repeating: "]", count: 100_000)
        #expect(throws: StorageError.self) { try parse(#"{"x": "# + deep + "}") }
        let ok = String(repeating: "[", count: 60) + String(repeating: "]", count: 60)
        #expect(try parse(#"{"x": "# + ok + "}").items.isEmpty)
    }

    /// The scanner and the tree parser (`JSONSerialization` + `ObjectMetadata.parse`) agree
    /// on every field, escapes and non-ASCII names included.
    @Test func agreesWithTheTreeParser() throws {
        let json = #"""
        {"kind": "storage#objects", "nextPageToken": "tok\/1",
         "prefixes": ["d/sub/", "d/\u00e9t\u00e9/"],
         "items": [
          {"kind": "storage#object", "name": "d/a \"q\" \\ \/ \u00e9\ud83d\ude00\n", "bucket": "other",
           "size": "12", "generation": "1700000000000001", "metageneration": "3",
           "updated": "2024-05-06T07:08:09.123Z", "timeCreated": "2024-01-01T00:00:00Z",
           "contentType": "text/plain", "contentEncoding": "", "cacheControl": "no-cache",
           "md5Hash": "WvXEX5jvvFHBhCfGv53kLw==", "crc32c": "ezxp3g==",
           "metadata": {"mtime": "2020-01-01T00:00:00Z", "n": 5, "flag": true, "deep": {"x": 1},
                        "firebaseStorageDownloadTokens": "t1, t2"},
           "owner": {"entity": "x"}, "acl": [1, [2, {"a": null}]]},
          {"name": "d/n", "size": 7, "generation": 9, "updated": "bad"}
         ]}
        """#
        let page = try parse(json)
        let tree = try #require(try JSONSerialization.jsonObject(with: Data(json.utf8)) as? [String: Any])
        let items = try #require(tree["items"] as? [[String: Any]])
        var expected: [ObjectMetadata] = []
        for item in items { expected.append(try ObjectMetadata.parse(json: item, defaultBucket: "b")) }
        #expect(page.items.count == 2)
        for (got, want) in zip(page.items, expected) {
            #expect(got.name == want.name && got.bucket == want.bucket && got.size == want.size)
            #expect(got.generation == want.generation && got.metageneration == want.metageneration)
            #expect(got.updated == want.updated && got.contentType == want.contentType)
            #expect(got.contentEncoding == want.contentEncoding && got.cacheControl == want.cacheControl)
            #expect(got.md5Hash == want.md5Hash && got.crc32c == want.crc32c)
            #expect(got.downloadTokens == want.downloadTokens)
            #expect(got.custom["mtime"] == want.custom["mtime"] && got.custom["n"] == want.custom["n"])
        }
        #expect(page.items[0].name == "d/a \"q\" \\ / \u{e9}\u{1F600}\n")
        #expect(page.prefixes == ["d/sub/", "d/\u{e9}t\u{e9}/"])
        #expect(page.nextPageToken == "tok/1")
    }

    @Test func v0ItemsAreNamesOnly() throws {
        let page = try parse(#"{"prefixes": ["p/"], "items": [{"name": "p/a", "bucket": "b"}], "nextPageToken": ""}"#,
                             namesOnly: true)
        #expect(page.items.map(\.name) == ["p/a"] && !page.metadataComplete && page.nextPageToken == nil)
        #expect(throws: StorageError.self) { try parse(#"{"items": [{"bucket": "b"}]}"#, namesOnly: true) }
    }
}

@Suite struct ContentRangeTests {
    @Test func parsesRanges() {
        #expect(ContentRange(header: "bytes 0-99/1000") == ContentRange(first: 0, last: 99, total: 1000))
        #expect(ContentRange(header: "bytes 5-5/*") == ContentRange(first: 5, last: 5, total: nil))
        #expect(ContentRange(header: "bytes */1000") == nil)
        #expect(ContentRange(header: "bytes 9-2/10") == nil)
        #expect(ContentRange(header: "items 0-1/2") == nil)
    }
}

@Suite struct StatusMappingTests {
    @Test(arguments: [
        (404, StorageError.Code.notFound), (401, .unauthenticated), (403, .unauthorized), (402, .quotaExceeded),
        (429, .quotaExceeded), (412, .generationChanged), (500, .retryLimitExceeded), (503, .retryLimitExceeded),
        (408, .retryLimitExceeded), (400, .invalidResponse),
    ])
    func classifiesStatus(status: Int, code: StorageError.Code) {
        #expect(StorageError.fromStatus(status, what: "x").code == code)
    }

    func isLoopback(_ url: String) -> Bool { URLOrigin(url)?.isLoopback == true }

    @Test func loopbackDetection() {
        #expect(isLoopback("http://127.0.0.1:4443"))
        #expect(isLoopback("http://localhost/x"))
        #expect(isLoopback("http://[::1]:80"))
        #expect(!isLoopback("http://10.0.0.1"))
        #expect(!isLoopback("http://localhost.evil.com"))
        // The host of `http://127.0.0.1:x@evil.example/` is evil.example: userinfo ends at '@'.
        #expect(!isLoopback("http://127.0.0.1:x@evil.example/"))
        #expect(!isLoopback("http://127.0.0.1.evil.example/"))
        #expect(!isLoopback("http://1270.0.0.1/"))
    }

    @Test(arguments: [
        ("http://127.0.0.1:x@evil.example", "user name"),
        ("http://user@127.0.0.1:80/", "user name"),
        ("oauth2.googleapis.com/token", "not an http"),
        ("ftp://127.0.0.1/token", "not an http"),
        ("http://evil.example/token", "plain http"),
        ("http://127.0.0.1.nip.io/", "plain http"),
    ])
    func secretsGoOnlyToHTTPSOrLoopback(url: String, reason: String) throws {
        let why = try #require(URLOrigin.refusalToSendSecrets(to: url))
        #expect(why.contains(reason))
        #expect(!why.contains("x@"), "a password in the URL must not reach a message")
    }

    @Test func secretsMayGoToHTTPSAndLoopback() {
        for url in ["https://oauth2.googleapis.com/token", "http://127.0.0.1:9099/x", "http://[::1]:80/", "http://localhost:1/"] {
            #expect(URLOrigin.refusalToSendSecrets(to: url) == nil, "\(url)")
        }
    }

    @Test func refusesSecretsOverPlainHTTPToRemoteHosts() throws {
        struct Secret: Credentials {
            func authorization(rejected: String?) throws(StorageError) -> String? { "Bearer x" }
            var sendsSecrets: Bool { true }
        }
        let http = HTTPClient(userAgent: "test")
        #expect(throws: StorageError.self) {
            try GCSJSONStore(bucket: "b", endpoint: "http://example.com", http: http, credentials: Secret())
        }
        _ = try GCSJSONStore(bucket: "b", endpoint: "http://127.0.0.1:1", http: http, credentials: Secret())
    }
}
