import Testing
import StorageClient
@testable import StorefsCore

func object(_ name: String, size: Int64 = 1, generation: Int64 = 1) -> ObjectMetadata {
    ObjectMetadata(name: name, bucket: "b", size: size, generation: generation, updated: Timestamp(seconds: 100))
}

@Suite struct DirectoryListingTests {
    @Test func mergesPagesAndDeduplicatesPrefixes() {
        let pages = [
            ListPage(items: [object("d/a"), object("d/b")], prefixes: ["d/x/", "d/y/"], nextPageToken: "d/b"),
            ListPage(items: [object("d/c")], prefixes: ["d/x/", "d/y/", "d/z/"], nextPageToken: nil),
        ]
        let l = DirectoryListing(prefix: "d/", pages: pages)
        #expect(l.sortedNames == ["a", "b", "c", "x", "y", "z"])
        #expect(l[name: "x"] == .directory)
        #expect(l[name: "a"] == .file(FileRecord(object("d/a"))))
    }

    @Test func placeholderIsNotAnEntryOfItsOwnDirectory() {
        let l = DirectoryListing(prefix: "empty/", pages: [ListPage(items: [object("empty/")], prefixes: [], nextPageToken: nil)])
        #expect(l.entries.isEmpty)
    }

    @Test func directoryShadowsSameNamedFileOnAnyPage() {
        let pages = [
            ListPage(items: [object("clash")], prefixes: [], nextPageToken: "t"),
            ListPage(items: [], prefixes: ["clash/"], nextPageToken: nil),
        ]
        let l = DirectoryListing(prefix: "", pages: pages)
        #expect(l.names == ["clash"] && l.entries == [.directory])
        #expect(l.shadowedFiles == ["clash"])
    }

    @Test func unrepresentableNamesAreHiddenNotMangled() {
        let long = String(repeating: "x", count: 256)
        let pages = [ListPage(items: [object("w/."), object("w/.."), object("w/\(long)"), object("w/ok"),
                                      object("w/with space %+#?"), object("w/ünï 日本")],
                              prefixes: ["w//", "w/./", "w/\(long)/", "w/sub/"], nextPageToken: nil)]
        let l = DirectoryListing(prefix: "w/", pages: pages)
        #expect(l.sortedNames == ["ok", "sub", "with space %+#?", "ünï 日本"])
    }

    @Test func exactly255BytesIsRepresentable() {
        #expect(DirectoryListing.isRepresentable(String(repeating: "é", count: 127) + "x"))
        #expect(!DirectoryListing.isRepresentable(String(repeating: "é", count: 128)))
    }

    /// NFC and NFD spellings of one word, and K / KELVIN SIGN, are equal Swift Strings but
    /// different objects: each is its own entry, found by its own bytes only.
    @Test func canonicallyEquivalentNamesAreDifferentEntries() {
        let nfc = "caf\u{e9}.txt", nfd = "cafe\u{301}.txt", k = "Key.sh", kelvin = "\u{212A}ey.sh"
        #expect(nfc == nfd)  // what Swift says; storefs must not
        let l = DirectoryListing(prefix: "u/", pages: [ListPage(
            items: [object("u/" + nfc, size: 1), object("u/" + nfd, size: 2), object("u/" + k, size: 3), object("u/" + kelvin, size: 4)],
            prefixes: [], nextPageToken: nil)])
        #expect(l.entries.count == 4)
        #expect(l[name: nfc] == .file(FileRecord(object("u/" + nfc, size: 1))))
        #expect(l[name: nfd] == .file(FileRecord(object("u/" + nfd, size: 2))))
        #expect(l[name: kelvin] == .file(FileRecord(object("u/" + kelvin, size: 4))))
    }

    /// A prefix is matched by bytes: `e` + U+0301 does not start with `é`, and a `/` followed
    /// by a combining mark is still a `/` byte that splits the name.
    @Test func prefixesAndSlashesAreBytes() {
        let l = DirectoryListing(prefix: "caf\u{e9}/", pages: [ListPage(
            items: [object("caf\u{e9}/a"), object("cafe\u{301}/b"), object("caf\u{e9}/x/\u{301}deep")],
            prefixes: ["cafe\u{301}/sub/"], nextPageToken: nil)])
        #expect(l.sortedNames == ["a"])
    }
}

@Suite struct DownloadURLTests {
    @Test func firebaseTokenURLUsesTheFirstToken() {
        var m = object("images/a b+c.jpg")
        m.downloadTokens = ["tok-1", "tok-2"]
        #expect(DownloadURL(ownerUID: 0).url(for: m)
            == "https://firebasestorage.googleapis.com/v0/b/b/o/images%2Fa%20b%2Bc.jpg?alt=media&token=tok-1")
    }

    @Test func publicURLKeepsSlashes() {
        #expect(DownloadURL(ownerUID: 0).url(for: object("images/a b#.jpg")) == "https://storage.googleapis.com/b/images/a%20b%23.jpg")
    }

    /// protocol=gcs on an endpoint that is not Google's (fake-gcs-server serves no v0 path):
    /// a token object gets the endpoint's JSON API media URL, which that server serves, and
    /// the token stays out of it.
    @Test func gcsOnAnotherEndpointGivesTokenObjectsTheMediaURL() {
        var m = object("images/a b+c.jpg")
        m.downloadTokens = ["tok-1"]
        let urls = DownloadURL.forMount(protocol: .gcs, endpoint: "http://127.0.0.1:4443/", ownerUID: 0)
        #expect(urls.url(for: m) == "http://127.0.0.1:4443/download/storage/v1/b/b/o/images%2Fa%20b%2Bc.jpg?alt=media")
        #expect(urls.url(for: object("x/y")) == "http://127.0.0.1:4443/download/storage/v1/b/b/o/x%2Fy?alt=media")
    }

    /// Google's endpoints and protocol=firebase keep the Firebase token URL.
    @Test(arguments: [
        (StorageProtocol.gcs, "https://storage.googleapis.com",
         "https://firebasestorage.googleapis.com/v0/b/b/o/d%2Ff?alt=media&token=t", "https://storage.googleapis.com/b/d/f"),
        (.gcs, "https://firebasestorage.googleapis.com/",
         "https://firebasestorage.googleapis.com/v0/b/b/o/d%2Ff?alt=media&token=t", "https://storage.googleapis.com/b/d/f"),
        (.firebase, "https://firebasestorage.googleapis.com",
         "https://firebasestorage.googleapis.com/v0/b/b/o/d%2Ff?alt=media&token=t", "https://storage.googleapis.com/b/d/f"),
        (.firebase, "http://127.0.0.1:9199",
         "http://127.0.0.1:9199/v0/b/b/o/d%2Ff?alt=media&token=t", "http://127.0.0.1:9199/download/storage/v1/b/b/o/d%2Ff?alt=media"),
    ])
    func tokenURLsStayOnGoogleAndOnFirebase(p: StorageProtocol, endpoint: String, token: String, plain: String) {
        var m = object("d/f")
        m.downloadTokens = ["t"]
        let urls = DownloadURL.forMount(protocol: p, endpoint: endpoint, ownerUID: 0)
        #expect(urls.url(for: m) == token)
        #expect(urls.url(for: object("d/f")) == plain)
    }
}
