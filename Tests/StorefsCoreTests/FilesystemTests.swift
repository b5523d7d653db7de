import Foundation
import Synchronization
import Glibc
import Testing
import StorageClient
@testable import StorefsCore
import StorefsTestSupport

@Suite struct FilesystemTests {
    let store = MemoryStore(pageSize: 3)

    func makeFS(prefix: String = "", negativeTTL: Double = 5) -> Filesystem {
        Filesystem(store: store, reference: StorageReference(bucket: "b", prefix: prefix),
                   config: .init(statTTL: 60, listTTL: 60, negativeTTL: negativeTTL, uid: 1, gid: 2))
    }

    func read(_ fs: Filesystem, _ handle: UInt64, at offset: Int64, count: Int) throws -> [UInt8] {
        var out = [UInt8](repeating: 0, count: count)
        let n = try out.withUnsafeMutableBytes { try fs.readWaiting(handle, at: offset, into: $0) }
        return Array(out.prefix(n))
    }

    /// Every read looks its handle up: 16 readers' lookups go to 16 tables, each under its own
    /// lock, not to one (docs/architecture.md, "Locks"). Handles opened, read and released on
    /// many threads at once are each found, and all gone after.
    @Test func sixteenFilesOpenAtOnceHaveTheirHandlesInSixteenTables() throws {
        let bytes = pattern(1000, seed: 9)
        store.put("f", bytes)
        let fs = makeFS()
        let f = try fs.lookup(parent: Filesystem.rootInode, name: "f")
        let opened = try (0..<16).map { _ in try fs.open(f.inode, flags: O_RDONLY).handle }
        #expect(Set(opened.map(Handles.stripe(of:))).count == 16, "tables of 16 handles: \(opened.map(Handles.stripe(of:)))")
        for h in opened { fs.release(h) }

        let threads = 16, each = 50
        let seen = Mutex([UInt64]()), wrong = Atomic<Int>(0)
        let group = DispatchGroup()
        for _ in 0..<threads {
            group.enter()
            Thread {
                for _ in 0..<each {
                    guard let h = try? fs.open(f.inode, flags: O_RDONLY).handle,
                          (try? read(fs, h, at: 10, count: 20)) == Array(bytes[10..<30]) else {
                        wrong.add(1, ordering: .relaxed)
                        continue
                    }
                    seen.withLock { $0.append(h) }
                    fs.release(h)
                }
                group.leave()
            }.start()
        }
        group.wait()
        let handles = seen.withLock { $0 }
        #expect(wrong.load(ordering: .relaxed) == 0)
        #expect(handles.count == threads * each && Set(handles).count == handles.count)
        #expect(fs.handles.count == 0)
        #expect(throws: FilesystemError.self) { _ = try fs.openFile(handles[0]) }
    }

    @Test func lookupProbesNestedPathsAndDirectoriesWin() throws {
        store.put("a/b/c.txt", Array("hello".utf8))
        store.put("a", Array("shadowed".utf8))
        let fs = makeFS()
        let a = try fs.lookup(parent: Filesystem.rootInode, name: "a")
        #expect(a.kind == .directory)
        let b = try fs.lookup(parent: a.inode, name: "b")
        let c = try fs.lookup(parent: b.inode, name: "c.txt")
        #expect(c.kind == .file && c.size == 5 && c.uid == 1 && c.gid == 2 && c.mode == 0o644)
    }

    @Test func missingNamesAreNegativelyCached() throws {
        let fs = makeFS()
        for _ in 0..<3 {
            #expect(throws: FilesystemError.self) { try fs.lookup(parent: Filesystem.rootInode, name: "nope") }
        }
        // One probe (a list and a metadata GET at once), plus the first page of the parent
        // fetched beside it (for the next name looked up there): nothing for the repeats.
        let deadline = monotonicNow() + 5
        while !fs.firstPages.withLock({ $0.inFlight.isEmpty }) && monotonicNow() < deadline { usleep(1000) }
        #expect(store.requests == .init(list: 2, metadata: 1, read: 0))
    }

    /// Waits for the requests lookups leave running in the background to end: directories'
    /// first pages, and probe halves they no longer waited for once "a directory" came back.
    func settle(_ fs: Filesystem) {
        let deadline = monotonicNow() + 5
        var last = store.requests
        while monotonicNow() < deadline {
            usleep(20_000)
            let seen = store.requests
            if seen == last && fs.firstPages.withLock({ $0.inFlight.isEmpty }) { return }
            last = seen
        }
    }

    /// `user.storefs.cached` answers from what the cache holds now, on the FUSE thread that
    /// asks, never waiting for a cache copy still being written (docs/security.md, "Local
    /// users on an allow_other mount"): a reader's own download has its copy written after the
    /// reply (here 0.3 s after, as a busy thread would), and the count follows once it is.
    @Test func theCachedAttributeAnswersAtOnceAndCountsTheCopyOnceWritten() throws {
        store.put("f", pattern(100_000, seed: 3), crc32c: true)
        let cache = try BlockCache(directory: temporaryDirectory(), capacity: 64 << 20, blockSize: 16 << 10)
        let reader = BlockReader(store: store, cache: cache, endpoint: "e",
                                 config: .init(blockSize: 16 << 10, readAhead: 0, partSize: 4 << 20, memoryLimit: 64 << 20))
        let fs = Filesystem(store: store, reference: StorageReference(bucket: "b", prefix: ""), config: .init(), reader: reader)
        let f = try fs.lookup(parent: Filesystem.rootInode, name: "f")
        let handle = try fs.open(f.inode, flags: O_RDONLY).handle
        let held = HeldReply()
        var out = [UInt8](repeating: 0, count: 100_000)
        let n = try out.withUnsafeMutableBytes { try fs.readWaiting(handle, at: 0, into: $0, isCancelled: { false }, held: held) }
        #expect(n == 100_000)
        fs.release(handle)  // `cat` closes the file before `getfattr` asks
        let copy = Thread { usleep(300_000); held.finish() }
        copy.start()
        let t0 = monotonicNow()
        let early = try fs.extendedAttribute(f.inode, name: "user.storefs.cached")
        #expect(monotonicNow() - t0 < 0.1)
        #expect(Int(String(decoding: early, as: UTF8.self))! < 100_000)
        while !copy.isFinished { usleep(1000) }
        let cached = try fs.extendedAttribute(f.inode, name: "user.storefs.cached")
        #expect(String(decoding: cached, as: UTF8.self) == "100000")
    }

    @Test func theCachedAttributeIsTheMountingUsersAndRootsOnly() throws {
        store.put("f", [1, 2, 3])
        let fs = Filesystem(store: store, reference: StorageReference(bucket: "b", prefix: ""),
                            config: .init(downloadURL: DownloadURL(ownerUID: 1000)))
        let f = try fs.lookup(parent: Filesystem.rootInode, name: "f")
        #expect(throws: FilesystemError.self) { _ = try fs.extendedAttribute(f.inode, name: "user.storefs.cached", requester: 1001) }
        #expect(!(try fs.extendedAttributeNames(f.inode, requester: 1001)).contains("user.storefs.cached"))
        #expect(try fs.extendedAttribute(f.inode, name: "user.storefs.cached", requester: 1000) == Array("0".utf8))
        #expect(try fs.extendedAttributeNames(f.inode, requester: 0).contains("user.storefs.cached"))
    }

    /// One directory is bounded, and so is the sum of the listings being fetched at once: the
    /// 64 metadata and 4 list-ahead threads could each hold a huge directory (issue 43, item 10).
    @Test func listingsFetchedAtOnceAreBoundedTogether() throws {
        let store = MemoryStore(pageSize: 10)
        for d in 0..<3 { for i in 0..<100 { store.put("d\(d)/f\(String(format: "%03d", i))", [1]) } }
        store.delayAll(0.02)  // each page takes a while: the three listings overlap
        var config = Filesystem.Config()
        config.listingEntriesInFlightLimit = 150
        let fs = Filesystem(store: store, reference: StorageReference(bucket: "b", prefix: ""), config: config)
        let failures = Mutex([String]())
        let threads = (0..<3).map { d in
            Thread {
                do throws(FilesystemError) {
                    _ = try fs.fullListing("d\(d)")
                } catch {
                    failures.withLock { $0.append(error.message) }
                }
            }
        }
        threads.forEach { $0.start() }
        while threads.contains(where: { !$0.isFinished }) { usleep(2000) }
        let messages = failures.withLock { $0 }
        #expect(!messages.isEmpty && messages.allSatisfy { $0.contains("listings being fetched at once hold more than 150 entries") })
        #expect(fs.listingEntriesInFlight.load(ordering: .relaxed) == 0)
        // Alone, a directory under the bound lists whole.
        store.delayAll(0)
        let failed = try #require(messages.first.flatMap { m in (0..<3).first { m.contains("d\($0)/") } })
        #expect(try fs.fullListing("d\(failed)").names.count == 100)
    }

    @Test func readdirListsEveryPageOnceAndLookupsThenCostNothing() throws {
        for i in 0..<10 { store.put(String(format: "d/f%02d", i), [UInt8(i)]) }
        store.put("d/sub/x", [1])
        let fs = makeFS()
        let d = try fs.lookup(parent: Filesystem.rootInode, name: "d")
        settle(fs)
        let before = store.requests
        let h = try fs.openListedDirectory(d.inode)
        let names = try fs.readDirectory(h, from: 0).map(\.name)
        #expect(names == [".", ".."] + (0..<10).map { String(format: "f%02d", $0) } + ["sub"])
        #expect(store.requests.list - before.list == 4)  // 10 items at 3 per page
        for i in 0..<10 { _ = try fs.lookup(parent: d.inode, name: String(format: "f%02d", i)) }
        #expect(store.requests.list - before.list == 4 && store.requests.metadata == before.metadata)
        let tail = try fs.readDirectory(h, from: 11)
        #expect(tail.map(\.name) == ["f09", "sub"] && tail.last?.nextOffset == 13)
        fs.release(h)
    }

    @Test func readsClampAtEndOfFileWithoutExtraRequests() throws {
        store.put("f", Array(0..<100))
        store.put("empty", [])
        let fs = makeFS()
        let f = try fs.open(try fs.lookup(parent: Filesystem.rootInode, name: "f").inode, flags: O_RDONLY)
        #expect(try read(fs, f.handle, at: 90, count: 50) == Array(90..<100))
        #expect(try read(fs, f.handle, at: 100, count: 50) == [])
        let e = try fs.open(try fs.lookup(parent: Filesystem.rootInode, name: "empty").inode, flags: O_RDONLY)
        #expect(try read(fs, e.handle, at: 0, count: 10) == [])
        #expect(store.requests.read == 1)
    }

    @Test func writeIntentIsReadOnly() throws {
        store.put("f", [1])
        let fs = makeFS()
        let f = try fs.lookup(parent: Filesystem.rootInode, name: "f")
        for flags in [O_WRONLY, O_RDWR, O_RDONLY | O_TRUNC] {
            #expect { _ = try fs.open(f.inode, flags: flags) } throws: { ($0 as? FilesystemError)?.code == .readOnly }
        }
    }

    @Test func storageErrorsKeepTheirCode() throws {
        store.put("f", [1])
        let fs = makeFS()
        store.failAll(with: StorageError(.unauthorized, "denied", httpStatus: 403))
        #expect { _ = try fs.lookup(parent: Filesystem.rootInode, name: "f") } throws: {
            ($0 as? FilesystemError)?.code == .storage(.unauthorized)
        }
    }

    @Test func newGenerationGetsANewInodeAndOpenHandlesStayPinned() throws {
        store.put("f", Array("old".utf8), generation: 1)
        let fs = Filesystem(store: store, reference: StorageReference(bucket: "b"),
                            config: .init(statTTL: 0, listTTL: 0, negativeTTL: 0))
        let first = try fs.lookup(parent: Filesystem.rootInode, name: "f")
        let h = try fs.open(first.inode, flags: O_RDONLY)
        store.put("f", Array("newer".utf8), generation: 2)
        let second = try fs.lookup(parent: Filesystem.rootInode, name: "f")
        #expect(second.inode != first.inode && second.size == 5)
        #expect { _ = try read(fs, h.handle, at: 0, count: 3) } throws: {
            ($0 as? FilesystemError)?.code == .storage(.generationChanged)
        }
    }

    /// The kernel drops a file's page cache at an open that does not keep it, waiting for the
    /// pages other readers of the file are reading in. The first open of an inode has none to
    /// drop, and keeps them (as every later open of the same generation does); so does the
    /// first open after the kernel forgot the inode, its pages with it.
    @Test func theFirstOpenOfAFileKeepsThePageCache() throws {
        store.put("f", Array("hello".utf8), generation: 1)
        let fs = makeFS()
        let f = try fs.lookup(parent: Filesystem.rootInode, name: "f")
        #expect(try fs.open(f.inode, flags: O_RDONLY).keepCache, "the first open dropped the page cache")
        #expect(try fs.open(f.inode, flags: O_RDONLY).keepCache)
        fs.forget(f.inode, count: 1)
        let again = try fs.lookup(parent: Filesystem.rootInode, name: "f")
        #expect(try fs.open(again.inode, flags: O_RDONLY).keepCache)
    }

    @Test func knownNamesResolveWhileTheBucketIsUnreachable() throws {
        store.put("d/cached.bin", [1, 2, 3])
        // Every lookup asks the bucket here (no outage hold), to see each answer's effect.
        let reader = BlockReader(store: store, cache: nil, endpoint: "", config: .init(), health: BucketHealth(holdSeconds: 0))
        let fs = Filesystem(store: store, reference: StorageReference(bucket: "b"),
                            config: .init(statTTL: 0, listTTL: 0.2, negativeTTL: 0), reader: reader)
        let d = try fs.lookup(parent: Filesystem.rootInode, name: "d")
        fs.release(try fs.openListedDirectory(d.inode))
        let f = try fs.lookup(parent: d.inode, name: "cached.bin")
        fs.forget(f.inode, count: 1)  // the kernel dropped it
        usleep(300_000)  // the listing expires
        store.failAll(with: StorageError(.unreachable, "connection refused"))
        #expect(try fs.lookup(parent: d.inode, name: "cached.bin").size == 3)
        #expect { _ = try fs.lookup(parent: d.inode, name: "never-listed") } throws: {
            ($0 as? FilesystemError)?.code == .noEntry
        }
        store.failAll(with: StorageError(.unauthorized, "denied", httpStatus: 403))
        #expect { _ = try fs.lookup(parent: d.inode, name: "cached.bin") } throws: {
            ($0 as? FilesystemError)?.code == .storage(.unauthorized)
        }
    }

    @Test func mountedPrefixIsTheRoot() throws {
        store.put("photos/2024/a.jpg", [1, 2])
        store.put("other/x", [1])
        let fs = makeFS(prefix: "photos")
        let h = try fs.openListedDirectory(Filesystem.rootInode)
        #expect(try fs.readDirectory(h, from: 2).map(\.name) == ["2024"])
        let y = try fs.lookup(parent: Filesystem.rootInode, name: "2024")
        #expect(try fs.lookup(parent: y.inode, name: "a.jpg").size == 2)
    }

    @Test func extendedAttributes() throws {
        store.put("dir/f.txt", [1], custom: ["firebaseStorageDownloadTokens": "t1,t2", "color": "blue"])
        let fs = makeFS()
        let d = try fs.lookup(parent: Filesystem.rootInode, name: "dir")
        let f = try fs.lookup(parent: d.inode, name: "f.txt")
        let names = try fs.extendedAttributeNames(f.inode)
        #expect(names.contains("user.storefs.download_url") && names.contains("user.storefs.meta.color"))
        #expect(!names.contains { $0.contains("firebaseStorageDownloadTokens") })
        #expect(String(decoding: try fs.extendedAttribute(f.inode, name: "user.storefs.download_url"), as: UTF8.self)
            == "https://firebasestorage.googleapis.com/v0/b/b/o/dir%2Ff.txt?alt=media&token=t1")
        #expect(String(decoding: try fs.extendedAttribute(f.inode, name: "user.storefs.gs_uri"), as: UTF8.self) == "gs://b/dir/f.txt")
        #expect { _ = try fs.extendedAttribute(f.inode, name: "user.storefs.content_encoding") } throws: {
            ($0 as? FilesystemError)?.code == .noAttribute
        }
        #expect(String(decoding: try fs.extendedAttribute(d.inode, name: "user.storefs.gs_uri"), as: UTF8.self) == "gs://b/dir/")
    }

    /// A refresh that finds a new generation leaves the inode describing its own generation
    /// (before: it was rewritten in place, one inode with two generations).
    @Test func aRefreshNeverRewritesAnInodesGeneration() throws {
        store.put("f", Array("old".utf8), generation: 1)
        let fs = Filesystem(store: store, reference: StorageReference(bucket: "b"),
                            config: .init(statTTL: 0, listTTL: 0, negativeTTL: 0))
        let first = try fs.lookup(parent: Filesystem.rootInode, name: "f")
        store.put("f", Array("newer".utf8), generation: 2)
        let again = try fs.attributes(of: first.inode)
        #expect(again.inode == first.inode && again.size == 3)
        let second = try fs.lookup(parent: Filesystem.rootInode, name: "f")
        #expect(second.inode != first.inode && second.size == 5)
        #expect(try fs.attributes(of: first.inode).size == 3)
    }

    /// FUSE threads ask with `.never`: known answers come back, anything that needs the bucket
    /// says `.wouldBlock` without a request.
    @Test func withoutTheNetworkKnownAnswersComeAndTheRestWouldBlock() throws {
        store.put("d/a", [1])
        let fs = Filesystem(store: store, reference: StorageReference(bucket: "b"),
                            config: .init(statTTL: 60, listTTL: 60, negativeTTL: 60))
        #expect { _ = try fs.lookup(parent: Filesystem.rootInode, name: "d", network: .never) } throws: {
            ($0 as? FilesystemError)?.code == .wouldBlock
        }
        #expect { _ = try fs.openListedDirectory(Filesystem.rootInode, network: .never) } throws: {
            ($0 as? FilesystemError)?.code == .wouldBlock
        }
        #expect(store.requests == .init())
        fs.release(try fs.openListedDirectory(Filesystem.rootInode))
        let requests = store.requests
        let d = try fs.lookup(parent: Filesystem.rootInode, name: "d", network: .never)
        #expect(try fs.attributes(of: d.inode, network: .never).kind == .directory)
        #expect(store.requests == requests)
    }

    /// An interrupted caller stops waiting at once (FUSE INTERRUPT), whatever the server does.
    @Test func anInterruptedLookupReturnsPromptly() throws {
        store.put("slow", [1])
        store.delayAll(5)
        let fs = Filesystem(store: store, reference: StorageReference(bucket: "b"),
                            config: .init(statTTL: 0, listTTL: 0, negativeTTL: 0))
        let start = Date()
        let cancelled: @Sendable () -> Bool = { Date().timeIntervalSince(start) > 0.2 }
        #expect { _ = try fs.lookup(parent: Filesystem.rootInode, name: "slow", network: .allowed(isCancelled: cancelled)) } throws: {
            ($0 as? FilesystemError)?.code == .storage(.cancelled)
        }
        #expect(Date().timeIntervalSince(start) < 2)
    }

    /// "Is it a directory?" and "what is the object?" are asked at once: a lookup costs one
    /// server delay, not two.
    @Test func aLookupAsksBothQuestionsAtOnce() throws {
        store.put("f", [1])
        store.delayAll(0.5)
        let fs = Filesystem(store: store, reference: StorageReference(bucket: "b"),
                            config: .init(statTTL: 0, listTTL: 0, negativeTTL: 0))
        let start = Date()
        #expect(try fs.lookup(parent: Filesystem.rootInode, name: "f").size == 1)
        #expect(Date().timeIntervalSince(start) < 0.9)
    }

    /// A server that does not answer costs one `request_timeout`, not one per path component:
    /// while the outage holds, known names answer at once without asking, and an unknown one
    /// asks as the outage's one probe (BucketHealthTests: the others fail at once meanwhile).
    @Test func duringAnOutageKnownNamesAnswerWithoutAsking() throws {
        store.put("d/f", [1])
        let fs = Filesystem(store: store, reference: StorageReference(bucket: "b"),
                            config: .init(statTTL: 0, listTTL: 0, negativeTTL: 0))
        let d = try fs.lookup(parent: Filesystem.rootInode, name: "d")
        let f = try fs.lookup(parent: d.inode, name: "f")
        store.failAll(with: StorageError(.retryLimitExceeded, "no answer in time"))
        #expect(try fs.lookup(parent: d.inode, name: "f").inode == f.inode)  // asks once, falls back
        let asked = store.requests
        #expect(try fs.attributes(of: f.inode).size == 1)
        #expect(try fs.lookup(parent: Filesystem.rootInode, name: "d").inode == d.inode)
        #expect(store.requests == asked, "nothing was asked about known names during the outage")
        #expect { _ = try fs.lookup(parent: d.inode, name: "unknown") } throws: {
            ($0 as? FilesystemError)?.code == .storage(.retryLimitExceeded)
        }
        #expect(store.requests.metadata == asked.metadata + 1, "the unknown name was asked about once")
    }

    /// A listing fetched to answer a lookup (its directory's first page, here the whole
    /// directory) vouches for the names it holds for `stat_ttl`, as the lookup would; a
    /// directory someone listed answers for `list_ttl` (issue 49, item 8).
    @Test func aListingLearntByALookupKeepsNoNameFresherThanStatTTL() throws {
        store.put("d/f.txt", [1])
        store.put("d/g.txt", [1])
        store.put("listed/f.txt", [1])
        let fs = Filesystem(store: store, reference: StorageReference(bucket: "b"),
                            config: .init(statTTL: 0.3, listTTL: 60, negativeTTL: 0.3))
        let d = try fs.lookup(parent: Filesystem.rootInode, name: "d")
        #expect(try fs.lookup(parent: d.inode, name: "f.txt").size == 1)
        settle(fs)
        #expect(fs.freshListing("d") != nil, "the first page beside the lookup was the whole directory")
        store.put("d/f.txt", [2, 2], generation: 2)
        store.remove("d/g.txt")
        usleep(350_000)
        #expect(try fs.lookup(parent: d.inode, name: "f.txt").size == 2, "the overwrite is seen after stat_ttl")
        #expect { _ = try fs.lookup(parent: d.inode, name: "g.txt") } throws: {
            ($0 as? FilesystemError)?.code == .noEntry
        }
        // Listed by a user: the listing answers for list_ttl (README, "Namespace semantics").
        let listed = try fs.lookup(parent: Filesystem.rootInode, name: "listed")
        let h = try fs.openListedDirectory(listed.inode)
        #expect(try fs.readDirectory(h, from: 0, limit: 10).map(\.name).contains("f.txt"))
        fs.release(h)
        store.put("listed/f.txt", [3, 3, 3], generation: 2)
        usleep(350_000)
        #expect(try fs.lookup(parent: listed.inode, name: "f.txt").size == 1)
    }

    /// An operation that failed while the bucket answered others is one unlucky request, not
    /// an outage: reads and lookups that start next still ask the bucket.
    @Test func aFailureWhileTheBucketAnsweredOthersIsNoOutage() {
        let health = BucketHealth(holdSeconds: 5)
        var unlucky = StorageError(.retryLimitExceeded, "503 after 10 tries", httpStatus: 503)
        unlucky.answeredOthers = true
        health.note(unlucky)
        #expect(health.outage == nil)
        health.note(StorageError(.retryLimitExceeded, "no answer in time"))
        #expect(health.outage?.code == .retryLimitExceeded)
    }

    /// readdir costs what it returns: the kernel asks for a bufferful at a time, deep offsets
    /// included, and every handle shares one snapshot of the listing.
    @Test func readdirReturnsAtMostItsLimitFromAnyOffset() throws {
        for i in 0..<3000 { store.put(String(format: "big/f%05d", i), [1]) }
        let fs = makeFS()
        let d = try fs.lookup(parent: Filesystem.rootInode, name: "big")
        let handles = try (0..<50).map { _ in try fs.openListedDirectory(d.inode) }
        let page = try fs.readDirectory(handles[7], from: 2990, limit: 5)
        #expect(page.map(\.name) == (2988..<2993).map { String(format: "f%05d", $0) })
        #expect(page.map(\.nextOffset) == Array(2991...2995))
        #expect(try fs.readDirectory(handles[0], from: 3001, limit: 10).map(\.name) == ["f02999"])
        #expect(try fs.readDirectory(handles[0], from: 3002, limit: 10).isEmpty)
        #expect(try fs.readDirectory(handles[0], from: 0, limit: 2).map(\.name) == [".", ".."])
        #expect(try fs.readDirectory(handles[0], from: 0, limit: 2).map(\.inode) == [d.inode, Filesystem.rootInode])
        for h in handles { fs.release(h) }
    }

    /// `du` and `ls -l` look up every name of the directory they read: while it is open its
    /// listing answers, even after the cache evicted it for other directories' listings.
    @Test func anOpenDirectoryAnswersLookupsAfterItsListingWasEvicted() throws {
        for d in 0..<4 { for i in 0..<600 { store.put(String(format: "d%d/f%03d", d, i), [1]) } }
        let fs = Filesystem(store: store, reference: StorageReference(bucket: "b"),
                            config: .init(statTTL: 60, listTTL: 60, metadataCacheSize: 1024))
        let d0 = try fs.lookup(parent: Filesystem.rootInode, name: "d0")
        let h = try fs.openListedDirectory(d0.inode)
        for d in 1..<4 {   // each listing (600 entries) evicts the one before from a 1024-entry cache
            let other = try fs.lookup(parent: Filesystem.rootInode, name: "d\(d)")
            fs.release(try fs.openListedDirectory(other.inode))
        }
        #expect(fs.cachedListingCounts.entries <= 1024)
        settle(fs)
        let before = store.requests
        for i in 0..<600 { _ = try fs.lookup(parent: d0.inode, name: String(format: "f%03d", i), network: .never) }
        #expect(store.requests == before, "lookups in an open directory asked the bucket")
        fs.release(h)
        #expect(throws: FilesystemError.self) { _ = try fs.lookup(parent: d0.inode, name: "f599x", network: .never) }
    }

    /// Any local user can look up names that do not exist: what is remembered of them stays
    /// bounded by metadata_cache_size.
    @Test func theNegativeCacheIsBounded() throws {
        let fs = Filesystem(store: store, reference: StorageReference(bucket: "b"),
                            config: .init(statTTL: 60, listTTL: 0, negativeTTL: 600, metadataCacheSize: 2048))
        for i in 0..<(2048 + 500) {
            #expect(throws: FilesystemError.self) { try fs.lookup(parent: Filesystem.rootInode, name: "missing\(i)") }
        }
        #expect(fs.rememberedPathCount <= 2048)
        #expect(fs.rememberedPathCount > 1024, "eviction drops the oldest eighth, not everything")
    }

    /// The inode number readdir reports for an entry is the one a lookup then gives, files and
    /// directories alike (before: synthetic numbers for names not looked up yet).
    @Test func readdirInodesAreTheInodesLookupsGive() throws {
        for i in 0..<500 { store.put(String(format: "many/f%03d", i), [1], generation: Int64(7 + i)) }
        store.put("many/sub/x", [1])
        let fs = makeFS()
        let d = try fs.lookup(parent: Filesystem.rootInode, name: "many")
        let h = try fs.openListedDirectory(d.inode)
        let listed = try fs.readDirectory(h, from: 2)
        #expect(listed.count == 501)
        for e in listed {
            #expect(try fs.lookup(parent: d.inode, name: e.name).inode == e.inode, "\(e.name)")
        }
        fs.release(h)
    }

    /// A lookup's cancellation check reads its FUSE request, which libfuse frees once the
    /// lookup has replied: work the lookup started must never call it after the lookup returns
    /// (CI caught a segfault there: the background metadata GET polled a freed request).
    @Test func nothingCallsALookupsCancellationCheckAfterItReturns() throws {
        store.put("slow", [1])
        store.delayAll(1)
        let fs = Filesystem(store: store, reference: StorageReference(bucket: "b"),
                            config: .init(statTTL: 0, listTTL: 0, negativeTTL: 0))
        let start = Date()
        let replied = Atomic<Bool>(false)
        let callsAfterReply = Atomic<Int>(0)
        // Only the lookup's own thread sees the interruption (as with a real request, whose
        // flag after the reply is garbage): work left running keeps asking unless it was cut off.
        let caller = pthread_self()
        let check: @Sendable () -> Bool = {
            if replied.load(ordering: .acquiring) { callsAfterReply.add(1, ordering: .relaxed) }
            return pthread_equal(pthread_self(), caller) != 0 && Date().timeIntervalSince(start) > 0.1
        }
        #expect(throws: FilesystemError.self) { _ = try fs.lookup(parent: Filesystem.rootInode, name: "slow", network: .allowed(isCancelled: check)) }
        replied.store(true, ordering: .releasing)
        Thread.sleep(forTimeInterval: 1.5)  // the metadata GET would have polled it meanwhile
        #expect(callsAfterReply.load(ordering: .relaxed) == 0)
    }
}

/// `opendir` returns its handle after the listing's first page; the rest of the listing is what
/// the returned value fetches when its caller finishes it, after the reply (issue 44, item 1).
@Suite struct OpenDirectoryTests {
    @Test func theHandleComesAfterTheFirstPageAndTheRestWhenFinished() throws {
        let store = MemoryStore(pageSize: 10)
        for i in 0..<35 { store.put(String(format: "d/f%02d", i), [1]) }
        let fs = Filesystem(store: store, reference: StorageReference(bucket: "b"), config: .init())
        let d = try fs.lookup(parent: Filesystem.rootInode, name: "d")
        // The lookup answers with its first answer; its other requests (the probe's "is it a
        // directory?" list) may land after it: counted before the open, not by it.
        var listsBefore = store.requests.list
        repeat {
            listsBefore = store.requests.list
            Thread.sleep(forTimeInterval: 0.3)
        } while store.requests.list != listsBefore
        let opened: OpenedDirectory = try fs.openDirectory(d.inode, network: .allowed(isCancelled: nil))
        #expect(store.requests.list - listsBefore == 1, "one page fetched before the handle")
        let first = try fs.readDirectory(opened.handle, from: 0, network: .never)
        #expect(first.count > 2 && first.count <= 12, "`.`, `..` and what the first page settled: \(first.count)")
        let handle = opened.handle
        opened.finishListing()
        #expect(store.requests.list - listsBefore >= 4, "the other pages, fetched when it was finished")
        let all = try fs.readDirectory(handle, from: 0, network: .never)
        #expect(all.count == 37)
        fs.release(handle)
    }
}
