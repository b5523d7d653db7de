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
        #expect(l.entries["x"] == .directory)
        #expect(l.entries["a"] == .file(object("d/a")))
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
        #expect(l.entries == ["clash": .directory])
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
        #expect(DirectoryListing.isRepresentable(Substring(String(repeating: "é", count: 127) + "x")))
        #expect(!DirectoryListing.isRepresentable(Substring(String(repeating: "é", count: 128))))
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
}
