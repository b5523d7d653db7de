import Testing
import StorageClient
@testable import FuseAdapter
@testable import StorefsCore

/// The FUSE adapter's own logic: filling readdir replies, and stat conversion of hostile sizes.
@Suite struct DirectoryReplyTests {
    struct Failure: Error {}

    @Test func entriesGoInWhileTheyFitAndOnlyThoseAreAdded() throws {
        var added: [Int] = []
        let used = try DirectoryReply.pack([40, 40, 40, 40], into: 100, entrySize: { $0 }) { e, at in added.append(at) }
        #expect(used == 80 && added == [0, 40])
    }

    @Test func anErrorAfterSomeEntriesEndsTheReplyWithThem() throws {
        var calls = 0
        let used = try DirectoryReply.pack([8, 8, 8], into: 100, entrySize: { $0 }) { _, _ in
            calls += 1
            if calls == 2 { throw Failure() }
        }
        #expect(used == 8)
        #expect(throws: Failure.self) {
            _ = try DirectoryReply.pack([8], into: 100, entrySize: { $0 }) { _, _ in throw Failure() }
        }
    }

    /// readdirplus hands the kernel one reference per entry it sends: with a buffer too small
    /// for all, the entries left out hold none (before, each was counted and then forgotten).
    @Test func aPartialReaddirplusCountsALookupPerSentEntryOnly() throws {
        let store = MemoryStoreForAdapter()
        for i in 0..<10 { store.names.append("d/f\(i)") }
        let fs = Filesystem(store: store, reference: StorageReference(bucket: "b"), config: .init(statTTL: 60, listTTL: 60))
        let d = try fs.lookup(parent: Filesystem.rootInode, name: "d")
        let h = try fs.openListedDirectory(d.inode)
        let entries = try fs.readDirectory(h, from: 0)
        // As the readdirplus op does: how many fit, then one batch of lookups for those.
        let fit = DirectoryReply.fitting(entries.map { _ in 48 }, into: 5 * 48 + 47)
        #expect(fit == 5)
        let sent = try fs.lookupListed(h, offsets: 0..<fit).compactMap { $0?.inode }
        #expect(sent.count == 3)  // ".", "..", then three files in five slots
        for ino in sent {
            fs.forget(ino, count: 1)
            #expect(throws: FilesystemError.self) { _ = try fs.attributes(of: ino) }  // exactly one reference
        }
        for e in entries.dropFirst(5) {
            #expect(throws: FilesystemError.self) { _ = try fs.attributes(of: e.inode) }  // never referenced
        }
        fs.release(h)
    }

    @Test func statOfTheLargestSizeDoesNotTrap() {
        let a = FileAttributes(inode: 2, kind: .file, size: Int64.max, mode: 0o444, uid: 0, gid: 0,
                               modified: Timestamp(seconds: 0), linkCount: 1)
        let st = makeStat(a)
        #expect(st.st_blocks == Int(Int64.max / 512 + 1))
    }
}

/// A bucket of empty objects (names only) for the adapter's tests.
final class MemoryStoreForAdapter: ObjectStore, @unchecked Sendable {
    let bucket = "b"
    var names: [String] = []

    private func meta(_ name: String) -> ObjectMetadata {
        ObjectMetadata(name: name, bucket: bucket, size: 1, generation: 1, updated: Timestamp(seconds: 0))
    }

    func list(prefix: String, pageToken: String?, isCancelled: (@Sendable () -> Bool)?,
              connection: ConnectionClaim?) throws(StorageError) -> ListPage {
        let direct = names.filter { $0.hasPrefix(prefix) && !$0.dropFirst(prefix.count).contains("/") }
        let dirs = Set(names.filter { $0.hasPrefix(prefix) && $0.dropFirst(prefix.count).contains("/") }
            .map { prefix + $0.dropFirst(prefix.count).split(separator: "/")[0] + "/" })
        return ListPage(items: direct.map(meta), prefixes: dirs.sorted(), nextPageToken: nil)
    }

    func hasChildren(prefix: String, isCancelled: (@Sendable () -> Bool)?) throws(StorageError) -> Bool {
        names.contains { $0.hasPrefix(prefix) }
    }

    func metadata(of name: String, isCancelled: (@Sendable () -> Bool)?) throws(StorageError) -> ObjectMetadata {
        guard names.contains(name) else { throw StorageError(.notFound, "no \(name)", httpStatus: 404) }
        return meta(name)
    }

    func read(_ name: String, generation: Int64, offset: Int64, into buffer: RangeBuffer,
              isCancelled: (@Sendable () -> Bool)?, connection: ConnectionClaim?) throws(StorageError) -> ReadTiming {
        ReadTiming(firstByte: 0)
    }

    func checkAccess(prefix: String) throws(StorageError) -> ListPage? { nil }
}
