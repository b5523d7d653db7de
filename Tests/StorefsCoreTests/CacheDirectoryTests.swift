import Foundation
import Glibc
import Testing
import StorageClient
@testable import StorefsCore
import StorefsTestSupport

/// The cache directory as another local user would attack it (docs/security.md). These run as
/// root (as CI does): "another user" is uid 65534, made the owner with chown.
@Suite struct CacheDirectoryTests {
    let base = temporaryDirectory()
    let meta = ObjectMetadata(name: "x.bin", bucket: "b", size: 10_000, generation: 1, updated: Timestamp(seconds: 0))
    static let other: uid_t = 65534

    func refusal(_ directory: String) -> String? {
        do {
            _ = try BlockCache(directory: directory, capacity: 1 << 20, blockSize: 4096)
            return nil
        } catch {
            return error.message
        }
    }

    func mode(_ path: String) -> mode_t {
        var st = stat()
        lstat(path, &st)
        return st.st_mode & 0o7777
    }

    /// An outside directory holding one file, to check nothing there is touched.
    func bystander() -> (dir: String, file: String) {
        let dir = base + "/outside"
        mkdir(dir, 0o755)
        chmod(dir, 0o755)
        let file = dir + "/keep.txt"
        _ = FileManager.default.createFile(atPath: file, contents: Data("keep me".utf8))
        chmod(file, 0o644)
        return (dir, file)
    }

    func untouched(_ b: (dir: String, file: String)) -> Bool {
        mode(b.dir) == 0o755 && mode(b.file) == 0o644
            && FileManager.default.contents(atPath: b.file) == Data("keep me".utf8)
            && (try? FileManager.default.contentsOfDirectory(atPath: b.dir)) == ["keep.txt"]
    }

    @Test func aDirectoryOwnedByAnotherUserIsRefusedByName() throws {
        let dir = base + "/theirs"
        mkdir(dir, 0o700)
        try #require(chown(dir, Self.other, Self.other) == 0, "these tests need root")
        let why = try #require(refusal(dir))
        #expect(why.contains(dir) && why.contains("owned by uid 65534"))
    }

    @Test func aSymlinkedCacheDirectoryIsRefused() throws {
        let real = base + "/real"
        mkdir(real, 0o700)
        symlink(real, base + "/link")
        let why = try #require(refusal(base + "/link"))
        #expect(why.contains("symbolic link"))
        #expect((try? FileManager.default.contentsOfDirectory(atPath: real)) == [])
    }

    @Test(arguments: [0o770, 0o777, 0o1777] as [mode_t])
    func aDirectoryOthersMayWriteIsRefusedAndLeftAsItWas(mode wanted: mode_t) throws {
        let dir = base + "/loose"
        mkdir(dir, 0o700)
        chmod(dir, wanted)
        let why = try #require(refusal(dir))
        #expect(why.contains("writable by other users") && why.contains("chmod go-w"))
        #expect(mode(dir) == wanted)
        #expect((try? FileManager.default.contentsOfDirectory(atPath: dir)) == [])
    }

    @Test func tmpItselfIsRefusedAndKeepsItsMode() throws {
        let before = mode("/tmp")
        #expect(refusal("/tmp") != nil)
        #expect(mode("/tmp") == before)
    }

    @Test func aParentOthersMayWriteWithoutTheStickyBitIsRefused() throws {
        let parent = base + "/open"
        mkdir(parent, 0o777)
        chmod(parent, 0o777)
        let why = try #require(refusal(parent + "/cache"))
        #expect(why.contains("parent \(parent)") && why.contains("sticky"))
        #expect(!FileManager.default.fileExists(atPath: parent + "/cache"))
    }

    @Test func aSymlinkOnTheWayOwnedByAnotherUserIsRefused() throws {
        let real = base + "/realparent"
        mkdir(real, 0o755)
        symlink(real, base + "/theirlink")
        try #require(lchown(base + "/theirlink", Self.other, Self.other) == 0)
        let why = try #require(refusal(base + "/theirlink/cache"))
        #expect(why.contains("symbolic link owned by uid 65534"))
        // A link root or we made is followed, as for /var/run-style layouts.
        try #require(lchown(base + "/theirlink", 0, 0) == 0)
        #expect(refusal(base + "/theirlink/cache") == nil)
    }

    @Test func aVersionDirectoryOwnedByAnotherUserIsRefused() throws {
        let dir = base + "/c"
        mkdir(dir, 0o700)
        mkdir(dir + "/v1", 0o700)
        try #require(chown(dir + "/v1", Self.other, Self.other) == 0)
        #expect(refusal(dir)?.contains("\(dir)/v1 is owned by uid 65534") == true)
    }

    @Test func aMissingDirectoryIsCreatedPrivate() throws {
        let dir = base + "/new/deeper/cache"
        #expect(refusal(dir) == nil)
        #expect(mode(dir) == 0o700 && mode(base + "/new") == 0o700)
    }

    @Test func symlinkedVersionDirectoryIsReplacedNotFollowed() throws {
        let b = bystander()
        let dir = base + "/c"
        mkdir(dir, 0o700)
        symlink(b.dir, dir + "/v1")
        let cache = try BlockCache(directory: dir, capacity: 1 << 20, blockSize: 4096)
        let o = try #require(cache.acquire(endpoint: "e", meta: meta))
        pattern(10_000).withUnsafeBytes { o.store(first: 0, $0) }
        cache.release(o)
        #expect(untouched(b))
        var st = stat()
        lstat(dir + "/v1", &st)
        #expect(st.st_mode & S_IFMT == S_IFDIR)
    }

    @Test func symlinkedShardAndCacheFileAreRemovedNotFollowed() throws {
        let b = bystander()
        let dir = base + "/c"
        let (path, hex) = try { () throws -> (String, String) in
            let first = try BlockCache(directory: dir, capacity: 1 << 20, blockSize: 4096)
            let o = try #require(first.acquire(endpoint: "e", meta: meta))
            pattern(10_000).withUnsafeBytes { o.store(first: 0, $0) }
            first.release(o)
            return (o.path, o.hex)
        }()
        // The cache file becomes a link to the bystander; another shard becomes a link to its dir.
        unlink(path)
        symlink(b.file, path)
        let otherShard = dir + "/v1/" + (hex.hasPrefix("ff") ? "00" : "ff")
        symlink(b.dir, otherShard)
        let second = try BlockCache(directory: dir, capacity: 1 << 20, blockSize: 4096)
        #expect(untouched(b))
        #expect(!FileManager.default.fileExists(atPath: otherShard))
        // Opening the object makes a fresh private file, never writes through a link.
        let again = try #require(second.acquire(endpoint: "e", meta: meta))
        pattern(10_000).withUnsafeBytes { again.store(first: 0, $0) }
        second.release(again)
        #expect(untouched(b))
        var st = stat()
        lstat(path, &st)
        #expect(st.st_mode & S_IFMT == S_IFREG && st.st_mode & 0o777 == 0o600)
    }

    /// A shard swapped for a link while the cache is in use (after the start-up scan) is
    /// found when a file is made in it: the shard is opened before anything is made, and a
    /// link there is removed and a private directory made in its place (three steps: the
    /// link's open fails, the name is empty, the made directory opens).
    @Test func aShardSwappedForALinkWhileInUseIsReplacedWhenAFileIsMade() throws {
        let b = bystander()
        let dir = base + "/c"
        let cache = try BlockCache(directory: dir, capacity: 1 << 20, blockSize: 4096)
        let hex = BlockCache.hex(BlockCache.keyHash(endpoint: "e", bucket: meta.bucket, name: meta.name, generation: meta.generation))
        let shard = dir + "/v1/" + String(hex.prefix(2))
        rmdir(shard)
        #expect(symlink(b.dir, shard) == 0)
        let o = try #require(cache.acquire(endpoint: "e", meta: meta), "no cache file made: the cache paused")
        pattern(10_000).withUnsafeBytes { o.store(first: 0, $0) }
        #expect(o.cachedBytes(from: 0, upTo: 10_000) == 10_000)
        cache.release(o)
        #expect(untouched(b))
        var st = stat()
        #expect(lstat(shard, &st) == 0 && st.st_mode & S_IFMT == S_IFDIR && st.st_mode & 0o777 == 0o700)
        #expect(lstat(o.path, &st) == 0 && st.st_mode & S_IFMT == S_IFREG && st.st_mode & 0o777 == 0o600)
    }

    @Test func aFifoOrAForeignFileInTheCacheIsRemovedWithoutBlocking() throws {
        let dir = base + "/c"
        _ = try BlockCache(directory: dir, capacity: 1 << 20, blockSize: 4096)
        let shard = dir + "/v1/ab"
        mkdir(shard, 0o700)
        let fifo = shard + "/ab" + String(repeating: "0", count: 62) + ".blk"
        let foreign = shard + "/ab" + String(repeating: "1", count: 62) + ".blk"
        try #require(mkfifo(fifo, 0o600) == 0)
        unlink(dir + "/v1/.lock")
        try #require(mkfifo(dir + "/v1/.lock", 0o600) == 0)
        _ = FileManager.default.createFile(atPath: foreign, contents: Data(repeating: 1, count: 4096))
        try #require(chown(foreign, Self.other, Self.other) == 0)
        // Before the fix this open blocked forever in open(2) on the FIFO.
        _ = try BlockCache(directory: dir, capacity: 1 << 20, blockSize: 4096)
        #expect(!FileManager.default.fileExists(atPath: fifo) && !FileManager.default.fileExists(atPath: foreign))
        var st = stat()
        lstat(dir + "/v1/.lock", &st)
        #expect(st.st_mode & S_IFMT == S_IFREG)
    }

    /// A server may say an object is huge: opening it must not cost memory in proportion
    /// (a 1 TiB object used to allocate 1 GiB of index at open).
    @Test func aHugeObjectCostsNoIndexMemoryUntilItIsRead() throws {
        let huge = ObjectMetadata(name: "huge.bin", bucket: "b", size: 1 << 40, generation: 1, updated: Timestamp(seconds: 0))
        let last = try { () throws -> Int in
            let cache = try BlockCache(directory: base + "/c", capacity: 64 << 20, blockSize: 16 << 10)
            let before = residentBytes()
            let o = try #require(cache.acquire(endpoint: "e", meta: huge))
            let last = o.format.blockCount - 1
            pattern(16 << 10).withUnsafeBytes { o.store(first: last, $0) }
            #expect(o.isCached(last) && !o.isCached(0))
            #expect(residentBytes() - before < 32 << 20)
            cache.release(o)
            return last
        }()
        // Its cache file loads again (the index is read in chunks, only present blocks kept).
        let again = try BlockCache(directory: base + "/c", capacity: 64 << 20, blockSize: 16 << 10)
        let o = try #require(again.acquire(endpoint: "e", meta: huge))
        #expect(o.isCached(last) && !o.isCached(0))
        again.release(o)
    }

    func residentBytes() -> Int {
        guard let text = try? String(contentsOfFile: "/proc/self/statm", encoding: .utf8) else { return 0 }
        return (Int(text.split(separator: " ")[1]) ?? 0) * 4096
    }
}
