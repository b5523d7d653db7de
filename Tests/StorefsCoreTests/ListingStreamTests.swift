import StorageClient
import Testing
@testable import StorefsCore

/// A listing handed out as its pages arrive (docs/architecture.md, "Listings as they
/// arrive"): at every page, what readdir got so far must be exactly the beginning of the
/// finished listing, so a handle's offsets never change meaning and no file is shown that a
/// later page hides behind a directory of its name.
@Suite struct ListingStreamTests {
    private func object(_ name: String) -> ObjectMetadata {
        ObjectMetadata(name: name, bucket: "b", size: Int64(name.utf8.count), generation: 1, updated: Timestamp(seconds: 0))
    }

    /// The pages of a delimited listing of `prefix`, in key order, cut every `pageSize` keys.
    private func pages(of names: [String], prefix: String, pageSize: Int) -> [ListPage] {
        var keys: [(String, Bool)] = []   // (full key, isPrefix)
        var seen = Set<String>()
        for n in names where n.hasBytePrefix(prefix) {
            let rel = n.droppingBytes(prefix.utf8.count)
            if let slash = rel.utf8.firstIndex(of: UInt8(ascii: "/")) {
                let p = prefix + String(rel.utf8[..<slash])! + "/"
                if seen.insert(p).inserted { keys.append((p, true)) }
            } else if seen.insert(n).inserted {
                keys.append((n, false))
            }
        }
        keys.sort { ByteName($0.0) < ByteName($1.0) }
        var out: [ListPage] = []
        var i = 0
        while i < keys.count {
            let chunk = keys[i..<min(keys.count, i + pageSize)]
            i += pageSize
            out.append(ListPage(items: chunk.filter { !$0.1 }.map { object($0.0) }, prefixes: chunk.filter(\.1).map(\.0),
                                nextPageToken: i < keys.count ? "t\(i)" : nil))
        }
        return out
    }

    private func given(_ s: ListingStream) -> [String] {
        (try? s.entries(from: 0, limit: .max, wait: false, isCancelled: nil))?.map(\.0) ?? []
    }

    @Test func whatIsHandedOutIsAlwaysTheBeginningOfTheListing() {
        // Names over a tiny alphabet where `-` and `.` sort before `/`: files shadowed by
        // directories, files listed before directories whose keys follow theirs.
        var rng = SystemRandomNumberGenerator()
        let alphabet = ["a", "b", "-", ".", "/"]
        for round in 0..<300 {
            var names = Set<String>()
            for _ in 0..<Int.random(in: 1...60, using: &rng) {
                var n = ""
                for _ in 0..<Int.random(in: 1...6, using: &rng) { n += alphabet.randomElement(using: &rng)! }
                names.insert(n)
            }
            let prefix = round % 3 == 0 ? "a/" : ""
            let all = pages(of: Array(names), prefix: prefix, pageSize: Int.random(in: 1...5, using: &rng))
            let whole = DirectoryListing(prefix: prefix, pages: all)
            let stream = ListingStream(prefix: prefix)
            for (k, page) in all.enumerated() {
                stream.add(page, last: k == all.count - 1)
                let got = given(stream)
                #expect(Array(whole.names.prefix(got.count)) == got, "round \(round) page \(k): \(got) vs \(whole.names)")
            }
            let built = stream.listing()
            #expect(built.names == whole.names && built.entries == whole.entries && built.shadowedFiles == whole.shadowedFiles,
                    "round \(round): the stream's listing is the one a builder makes of the same pages")
            stream.finish(.success(ListingSnapshot(built, fetched: 0)))
            #expect(given(stream) == whole.names, "round \(round)")
            let entries = (try? stream.entries(from: 0, limit: .max, wait: false, isCancelled: nil))?.map(\.1) ?? []
            #expect(entries == whole.entries)
        }
    }

    @Test func aFileWaitsForTheDirectoryThatHidesIt() {
        let stream = ListingStream(prefix: "")
        // Page 1 ends with `a.txt`; `a` (a file), `a-b` and `a.txt` may still be passed by `a/`.
        stream.add(ListPage(items: [object("0"), object("a"), object("a-b"), object("a.txt")], prefixes: [], nextPageToken: "x"),
                   last: false)
        #expect(given(stream) == ["0"])
        stream.add(ListPage(items: [object("b")], prefixes: ["a/"], nextPageToken: nil), last: true)
        #expect(given(stream) == ["0", "a", "a-b", "a.txt", "b"])
        #expect(stream.entry(at: 1)?.1 == .directory)
    }

    @Test func aDirectoryRepeatedOnTheNextPageIsListedOnce() {
        let stream = ListingStream(prefix: "p/")
        stream.add(ListPage(items: [object("p/a")], prefixes: ["p/m/"], nextPageToken: "x"), last: false)
        stream.add(ListPage(items: [object("p/z")], prefixes: ["p/m/"], nextPageToken: nil), last: true)
        #expect(given(stream) == ["a", "m", "z"])
    }

    @Test func pagesOutOfOrderStopTheStreamUntilTheListingIsWhole() {
        let first = ListPage(items: [object("m1"), object("m2")], prefixes: [], nextPageToken: "x")
        let second = ListPage(items: [object("a1"), object("z1")], prefixes: [], nextPageToken: nil)
        let stream = ListingStream(prefix: "")
        stream.add(first, last: false)
        let early = given(stream)
        stream.add(second, last: true)
        #expect(given(stream) == early, "nothing more once the order is broken")
        let built = stream.listing()
        #expect(built.names == DirectoryListing(prefix: "", pages: [first, second]).names)
        stream.finish(.success(ListingSnapshot(built, fetched: 0)))
        let all = given(stream)
        #expect(Set(all) == ["a1", "m1", "m2", "z1"] && all.count == 4 && Array(all.prefix(early.count)) == early)
    }

    @Test func aFailureReachesTheReaderAfterTheEntriesBeforeIt() {
        let stream = ListingStream(prefix: "")
        stream.add(ListPage(items: [object("a"), object("b"), object("c")], prefixes: [], nextPageToken: "x"), last: false)
        stream.finish(.failure(FilesystemError(.storage(.retryLimitExceeded), "page 2 failed")))
        #expect(given(stream) == ["a", "b"], "`c` was still waiting: a page that never came might have hidden it")
        #expect(throws: FilesystemError.self) { _ = try stream.entries(from: 3, limit: 10, wait: true, isCancelled: nil) }
    }
}
