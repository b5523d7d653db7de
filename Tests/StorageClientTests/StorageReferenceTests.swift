import Testing
@testable import StorageClient

@Suite struct StorageReferenceTests {
    @Test(arguments: [
        ("my-app.appspot.com", "my-app.appspot.com", ""),
        ("gs://bucket", "bucket", ""),
        ("gs://bucket/", "bucket", ""),
        ("gs://bucket/photos", "bucket", "photos"),
        ("gs://bucket//photos//2024///", "bucket", "photos/2024"),
        ("gs://bucket/?/%/#", "bucket", "?/%/#"),
        ("https://firebasestorage.googleapis.com/v0/b/bucket/o/%3F/%25/%23", "bucket", "?/%/#"),
        ("https://firebasestorage.googleapis.com/v0/b/bucket/o/images%2Fa%20b", "bucket", "images/a b"),
        ("https://firebasestorage.googleapis.com/v0/b/bucket", "bucket", ""),
        ("https://firebasestorage.googleapis.com/v0/b/bucket/o", "bucket", ""),
        ("http://localhost:9199/v0/b/bucket/o/dir?alt=media&token=x", "bucket", "dir"),
    ])
    func parsesSources(source: String, bucket: String, prefix: String) throws {
        let ref = try StorageReference.parse(source)
        #expect(ref.bucket == bucket)
        #expect(ref.prefix == prefix)
    }

    @Test(arguments: [
        "gs://", "gs:///", "ftp://bucket/x", "https://firebasestorage.googleapis.com/v1/b/bucket/o/x",
        "https://firebasestorage.googleapis.com/v0/b/bucket/x/obj", "https://host/", "bad bucket", "",
    ])
    func rejectsMalformedSources(source: String) {
        #expect(throws: StorageError.self) { try StorageReference.parse(source) }
    }

    @Test func rootListingPrefixEndsInSlash() {
        #expect(StorageReference(bucket: "b", prefix: "a/b").rootListingPrefix == "a/b/")
        #expect(StorageReference(bucket: "b").rootListingPrefix == "")
    }
}

@Suite struct ObjectNameTests {
    @Test(arguments: [
        ("images/stars.jpg", "images%2Fstars.jpg"),
        ("a b+c", "a%20b%2Bc"),
        ("100%", "100%25"),
        ("what?#", "what%3F%23"),
        ("ünï", "%C3%BCn%C3%AF"),
        ("A-Z_a.z~09", "A-Z_a.z~09"),
        ("$&'()*,;=:@!", "%24%26%27%28%29%2A%2C%3B%3D%3A%40%21"),
    ])
    func encodesEverythingButUnreserved(name: String, encoded: String) {
        #expect(ObjectName.encode(name) == encoded)
        #expect(ObjectName.decode(encoded) == name)
    }

    @Test func keepsSlashWhenAsked() {
        #expect(ObjectName.encode("a dir/b+c.txt", keepingSlash: true) == "a%20dir/b%2Bc.txt")
    }

    @Test func rejectsMalformedEscapes() {
        #expect(ObjectName.decode("%4") == nil)
        #expect(ObjectName.decode("%zz") == nil)
        #expect(ObjectName.decode("%FF") == nil)  // not UTF-8
    }
}
