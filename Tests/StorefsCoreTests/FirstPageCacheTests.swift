import Testing
import StorageClient
@testable import StorefsCore

/// What a directory's partial first page may say about a name (docs/architecture.md,
/// "Lookups in one round trip"): only names it reaches, and a directory wins over a file.
@Suite struct FirstPageCacheTests {
    func item(_ name: String) -> ObjectMetadata {
        ObjectMetadata(name: name, bucket: "b", size: 3, generation: 1, metageneration: 1,
                       updated: Timestamp(seconds: 1_700_000_000))
    }

    /// A first page of `d/`: files a, b.txt, m; directories b/ and c/; the next page holds more.
    func page() -> FirstPageCache.Page {
        let list = ListPage(items: [item("d/a"), item("d/b"), item("d/b.txt"), item("d/m")], prefixes: ["d/b/", "d/c/"],
                            nextPageToken: "next")
        var builder = DirectoryListing.Builder(prefix: "d/")
        builder.add(list)
        return .init(listing: builder.build(), reached: FirstPageCache.reached(by: list, prefix: "d/"), fetched: 0)
    }

    @Test func namesThePageReachesAreAnswered() {
        let p = page()
        #expect(p.reached == ByteName("m"))
        guard case .file?? = FirstPageCache.answer(p, name: "a") else { Issue.record("a is a file"); return }
        #expect(FirstPageCache.answer(p, name: "c") == .some(.directory))
        // `b` is both an object and a prefix: the directory wins.
        #expect(FirstPageCache.answer(p, name: "b") == .some(.directory))
        // Absent, and the page reached past both `ab` and `ab/`.
        #expect(FirstPageCache.answer(p, name: "ab") == .some(nil))
    }

    @Test func namesBeyondThePageAreNotAnswered() {
        let p = page()
        #expect(FirstPageCache.answer(p, name: "z") == nil)
        // The file `m` is in the page, but a directory `m/` would sort after it, past the page.
        #expect(FirstPageCache.answer(p, name: "m") == nil)
    }

    @Test func thePagesKeptAreBounded() {
        var cache = FirstPageCache()
        for i in 0..<(FirstPageCache.maxPages + 10) {
            let dir = ByteName("d\(i)")
            let first = cache.begin(dir)
            let second = cache.begin(dir)
            #expect(first && !second)  // one fetch per directory at a time
            cache.end(dir, page())
        }
        #expect(cache.count == FirstPageCache.maxPages)
        #expect(cache.page(ByteName("d0")) == nil && cache.page(ByteName("d\(FirstPageCache.maxPages + 9)")) != nil)
        #expect(cache.inFlight.isEmpty)
    }
}
